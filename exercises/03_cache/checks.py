"""Exercise 3's checks: the cache (README.md). Your write and commit run as model.KVCache's methods."""
import copy

import torch

import decode
from drafters import DraftModel
from exercises import harness
from heads import BlockHeads
from model import GPT, GPTConfig, KVCache

NAMES = ('write', 'commit')
SEAMS = {'model.KVCache.write': 'write', 'model.KVCache.commit': 'commit'}
REFERENCE = {'write': 'model.KVCache.write', 'commit': 'model.KVCache.commit'}   # in a handout: calls of student.py
STUBS = {}   # nothing else of the project is this answer (KVCache.keep_path is exercise 8's)
MAY_USE = ('model.KVCache', 'model.GPT.new_cache', 'model.GPT.forward_cached', 'model.CausalSelfAttention.forward')
TOL = 1e-10


def tokens(shape, seed):
    return torch.randint(32, shape, generator=torch.Generator().manual_seed(seed))


def block_keys(B=2, nh=2, L=3, hs=16, meta=False):
    """Keys and values (B, nh, L, hs) laid out as CausalSelfAttention.forward passes them to write:
    the k and v thirds of one (B, L, 3 nh hs) projection, each viewed (B, L, nh, hs) and transposed,
    not contiguous. Contiguous ones (torch.randn(B, nh, L, hs)) would refuse a right answer that
    views them as the model lays them out (k.transpose(1, 2).view(B * L, nh, hs)). meta: on 'meta'."""
    qkv = torch.randn(B, L, 3 * nh * hs, generator=torch.Generator().manual_seed(B * L), dtype=torch.float64)
    _, k, v = (harness.on_meta(qkv) if meta else qkv).split(nh * hs, dim=2)
    return tuple(t.view(B, L, nh, hs).transpose(1, 2) for t in (k, v))


@torch.no_grad()
def test_a_prefill_matches_the_full_forward(impl):
    """A prefill matches the full forward. The prompt's keys and values written, then committed:
    the logits equal a full causal forward over it, and each row's length is the prompt's; then one
    token a row, as plain decoding writes them; and the prefill again for a float32 target, into a
    float32 cache and into a float64 one (the cache keeps its own dtype).
    Hint: write at cache.k[layer_idx] along the position dimension (dim 2 of (B, nh, max_len, hs))."""
    model = harness.tiny_target()
    prompt = tokens((2, 9), 0)
    cache = model.new_cache(2, 32)
    h = model.forward_cached(prompt, cache)
    impl.commit(cache, 9)
    assert cache.lengths.tolist() == [9, 9], f"lengths {cache.lengths.tolist()} after committing 9 tokens, want [9, 9]"
    err = (model.lm_head(h) - model(prompt)[0]).abs().max().item()
    assert err < TOL, f"cached logits differ from the full forward by {err:.2e}, want below {TOL:g}"
    nxt = tokens((2, 1), 5)
    try:
        h = model.forward_cached(nxt, cache)
    except RuntimeError as e:
        raise harness.Fail(f"a block of one token (plain decoding's): {harness.first_line(e)}"
                           f"{harness.where_in_student(e)}", "squeeze() without a dimension drops every dimension "
                           "of size 1: with one token the positions' too; name the dimension")
    err = (model.lm_head(h)[:, -1] - model(torch.cat([prompt, nxt], 1))[0][:, -1]).abs().max().item()
    assert err < TOL, f"a block of one token: its logits differ from the full forward by {err:.2e}, want below {TOL:g}"
    model = copy.deepcopy(model).float()                    # the project's targets decode in float32
    cache = model.new_cache(2, 32)
    try:
        h = model.forward_cached(prompt, cache)
        impl.commit(cache, 9)
    except RuntimeError as e:
        raise harness.Fail(f"a float32 target: {harness.first_line(e)}{harness.where_in_student(e)}",
                           "the checks above run in float64; keys and values take the cache's own dtype "
                           "(cache.k.dtype), whatever the one they come in")
    err = (model.lm_head(h) - model(prompt)[0]).abs().max().item()
    assert err < 1e-5, f"a float32 target: cached logits differ from the full forward by {err:.2e}, want below 1e-5"
    cache = model.new_cache(2, 32, dtype=torch.float64)     # a cache of its own dtype (attention reads it in q's)
    try:
        h = model.forward_cached(prompt, cache)
    except RuntimeError as e:
        raise harness.Fail(f"a float32 target, a float64 cache (new_cache(..., dtype=torch.float64)): "
                           f"{harness.first_line(e)}{harness.where_in_student(e)}",
                           "k and v come in the model's compute dtype, and the cache keeps its own (under autocast "
                           "one may be bfloat16 and the other float32): write them in cache.k.dtype (k.to(...)); "
                           "scatter_ and an indexed assignment refuse a source of another dtype")
    err = (model.lm_head(h) - model(prompt)[0]).abs().max().item()
    assert err < 1e-5, f"a float32 target, a float64 cache: cached logits differ from the full forward by " \
        f"{err:.2e}, want below 1e-5"


def test_rows_keep_their_own_lengths(impl):
    """Rows keep their own lengths. commit(n) with n per row moves each row by its own n (0 too).
    Hint: cache.lengths += n, in place."""
    model = harness.tiny_target()
    cache = model.new_cache(3, 32)
    impl.commit(cache, torch.tensor([3, 0, 5]))
    impl.commit(cache, torch.tensor([1, 2, 0]))
    assert cache.lengths.tolist() == [4, 2, 5], f"lengths {cache.lengths.tolist()}, want [4, 2, 5]"


@torch.no_grad()
def test_rejected_entries_are_overwritten(impl):
    """After a rejection, the next block sees only what was kept. A 6-token block is written and
    rows keep 2 and 5 of it; the next blocks' logits equal a fresh forward over the kept tokens
    and the new ones (float64), and commit leaves the rejected entries as they were (no
    rollback). Hint: the next block is written at cache.lengths[b] + 0..L-1, on top of the rejected
    entries; attention masks everything past a row's positions."""
    model = harness.tiny_target()
    prompt, block, nxt, last = tokens((2, 7), 1), tokens((2, 6), 2), tokens((2, 3), 3), tokens((2, 2), 4)
    keep = torch.tensor([2, 5])
    cache = model.new_cache(2, 32)
    model.forward_cached(prompt, cache)
    impl.commit(cache, 7)
    model.forward_cached(block, cache)
    written = cache.k[:, :, :, 7:13].clone(), cache.v[:, :, :, 7:13].clone()
    impl.commit(cache, keep)
    for b in range(2):   # no rollback: what was refused stays where it is, past the row's length
        for name, buf, was in (('keys', cache.k, written[0]), ('values', cache.v, written[1])):
            if not torch.equal(buf[:, b, :, 7 + int(keep[b]):13], was[:, b, :, int(keep[b]):]):
                raise harness.Fail(f"row {b}: commit changed the refused entries' {name} (slots {7 + int(keep[b])} "
                                   f"to 12), want them left as they were", "there is no rollback: commit moves the "
                                   "lengths and nothing else (what fits: the slots past a row's length zeroed or "
                                   "rewritten, every step, over the whole cache)")
    got = model.lm_head(model.forward_cached(nxt, cache))
    # row 0 kept 2: the next 3 tokens land on slots 9..11, and slot 12, refused, is left as it was
    if not (torch.equal(cache.k[:, 0, :, 12], written[0][:, 0, :, 5]) and
            torch.equal(cache.v[:, 0, :, 12], written[1][:, 0, :, 5])):
        raise harness.Fail("row 0 (kept 2 of 6): the next block's write changed slot 12, past that block, want it "
                           "left as it was", "a write touches the block's own slots and nothing else (what fits: "
                           "the slots past the block cleared or masked at each write, the rollback done there)")
    impl.commit(cache, 3)
    got_last = model.lm_head(model.forward_cached(last, cache))
    for b in range(2):
        seq = torch.cat([prompt[b], block[b, :keep[b]], nxt[b]])
        err = (got[b] - model(seq[None])[0][0, -3:]).abs().max().item()
        assert err < TOL, \
            f"row {b} (kept {int(keep[b])} of 6): the next block's logits differ by {err:.2e}, want below {TOL:g}"
        seq = torch.cat([seq, last[b]])
        err = (got_last[b] - model(seq[None])[0][0, -2:]).abs().max().item()
        assert err < TOL, f"row {b}: the block after that differs by {err:.2e}, want below {TOL:g}"


def test_the_buffers_stay_in_place(impl):
    """The buffers stay in place. After write and commit (an int and a (B,) tensor), cache.k,
    cache.v and cache.lengths are the very tensors they were, at the same addresses, and write
    returns views of the layer's buffers, not copies: a compiled step and a CUDA graph hold on to
    these addresses, and a rebound buffer is one they never see; and neither touches the global
    RNG. Hint: everything in place:
    cache.lengths += n; index assignment or scatter_ into cache.k and cache.v."""
    model = harness.tiny_target()
    cache = model.new_cache(2, 32)
    before = {name: (getattr(cache, name), getattr(cache, name).data_ptr()) for name in ('k', 'v', 'lengths')}
    indices = {name: (getattr(cache, name), getattr(cache, name).clone()) for name in ('rows', 'layers')}
    k, v = block_keys()
    K, V = harness.assert_leaves_torch_alone('write', lambda: impl.write(cache, 1, k, v,
                                                                       torch.tensor([[0, 1, 2], [4, 5, 6]])))
    for name, got in (('K', K), ('V', V)):
        buffer = getattr(cache, name.lower())[1]
        if not (isinstance(got, torch.Tensor) and got.shape == buffer.shape and got.data_ptr() == buffer.data_ptr()):
            raise harness.Fail(f"write returned a {name} that is not cache.{name.lower()}[layer_idx] (want a view at "
                               f"its address {buffer.data_ptr():#x}, shape {tuple(buffer.shape)})",
                               f"return cache.{name.lower()}[layer_idx] itself, after writing into it in place")
    harness.assert_leaves_torch_alone('commit', lambda: impl.commit(cache, 1))
    harness.assert_leaves_torch_alone('commit', lambda: impl.commit(cache, torch.tensor([1, 2])))
    for name, (tensor, ptr) in before.items():
        now = getattr(cache, name)
        if now is not tensor or now.data_ptr() != ptr:
            hint = ("commit must move the lengths in place: cache.lengths += n, not cache.lengths = cache.lengths + n"
                    if name == 'lengths' else
                    f"write into cache.{name} in place (index assignment, or scatter_ on a view of it), not into a "
                    f"new tensor bound to it (torch.cat, scatter without the underscore, .clone())")
            raise harness.Fail(f"cache.{name} is a new tensor after {'commit' if name == 'lengths' else 'write'} "
                               f"(at {now.data_ptr():#x}), want the same tensor at {ptr:#x}", hint)
    for name, (tensor, values) in indices.items():
        now = getattr(cache, name)
        if now is not tensor or not torch.equal(now, values):
            raise harness.Fail(f"cache.{name} changed after write and commit, want it as KVCache made it",
                               "KVCache's own index tensors are read by its other methods (keep_path, a tree's "
                               "path): use them as they are, and keep what you make in a name of your own")
    assert cache.lengths.tolist() == [2, 3], \
        f"lengths {cache.lengths.tolist()} after commit(1), commit([1, 2]), want [2, 3]"


def test_nothing_the_size_of_a_layer_is_allocated(impl):
    """Nothing the size of a layer is allocated per write or commit. A 3-token block written into a
    cache of 256 slots, and a commit (of a tensor, of an int), allocates no tensor of even a quarter
    of a layer's elements (B, n_head, max_len, head_dim), of any dtype (a mask of bools too): the
    block's own few at most; and five writes (at two layers) and commits keep no more of the
    tensors they make, nor more bytes, than one of each (the n each was given included). Hint: write
    into the buffer itself (index assignment, or scatter_ on cache.k[layer_idx]); building the
    layer anew (scatter without the underscore, torch.where, a clone) and copying it back keeps the
    address and the values, and still allocates a whole layer at every step; a commit moves the
    lengths, nothing else; keep nothing of a call past it (a list, a tensor concatenated onto)."""
    model = harness.tiny_target()
    cache = model.new_cache(2, 256)
    layer = cache.k[0].numel()
    k, v = block_keys()
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    impl.write(cache, 1, k, v, pos)                                      # a first call may set things up
    for what, call in (('write', lambda: impl.write(cache, 1, k, v, pos)),
                       ('commit of a tensor', lambda: impl.commit(cache, torch.tensor([1, 2]))),
                       ('commit of an int', lambda: impl.commit(cache, 1))):
        with harness.Allocations() as allocations:
            call()
        big = [(op, size) for op, size in allocations.seen if size >= layer // 4]
        if big:
            raise harness.Fail(f"{what} allocated {len(big)} tensor(s) of {max(s for _, s in big)} elements "
                               f"({big[0][0]}), a layer's buffer holding {layer}: want nothing of a quarter of "
                               f"that or more")
    harness.assert_keeps_nothing('write', lambda i: [impl.write(cache, at, *block_keys(), pos.clone())
                                                     for at in (0, 1)])
    harness.assert_keeps_nothing('commit', lambda i: impl.commit(cache, torch.arange(1, 3)))   # n = [1, 2], made anew


def test_no_host_sync(impl):
    """No host sync, no tensor on another device. write and commit make the host wait for nothing
    (with two rows and with one), and make no tensor off the cache's device, commit given a tensor
    or an int (run on PyTorch's
    'meta' device, where an op that mixes a CPU tensor with the cache's fails as on CUDA), and send
    no tensor of the CPU to it by a copy (.to(device)), of one element as of many."""
    model = harness.tiny_target()
    cache = model.new_cache(2, 32)
    k, v = block_keys()
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    n = torch.tensor([1, 2])
    one = model.new_cache(1, 32)                               # one row, as generate.py decodes
    with harness.HostSyncs() as syncs:
        impl.write(cache, 1, k, v, pos)
        impl.commit(cache, n)
        impl.write(one, 1, *block_keys(B=1), pos[:1])
        impl.commit(one, n[:1])
        impl.commit(one, 1)
    if syncs.seen:
        raise harness.Fail(f"host syncs: {', '.join(sorted(set(syncs.seen)))}, want none",
                           "the ops listed make the host wait for the device: a value read back (.item(), int() of "
                           "a tensor, a Python loop over positions or rows read from one) or a shape that depends on "
                           "the data (boolean indexing, nonzero)")
    cache = KVCache(model.config, 2, 32, 'meta', torch.float64)
    (k, v), pos, n = block_keys(meta=True), harness.on_meta(pos), harness.on_meta(n)
    harness.assert_on_the_inputs_device('write', lambda: impl.write(cache, 1, k, v, pos), strict=True)
    harness.assert_on_the_inputs_device('commit', lambda: impl.commit(cache, n), strict=True)
    harness.assert_on_the_inputs_device('commit of an int', lambda: impl.commit(cache, 3), strict=True)
    with ScalarsSent() as sent, harness.autocast_off_on_meta():   # 0-dim ones, which the watch above lets pass
        try:
            impl.commit(cache, 3)
            impl.commit(cache, n)
            impl.write(cache, 1, k, v, pos)
        except Exception:                           # an op 'meta' cannot run: the watch above judged the devices
            pass
    if sent.seen:
        raise harness.Fail(f"{sent.seen[0]}, a tensor made on the CPU (a number made a tensor without device=, say "
                           f"torch.tensor(n)) sent to the cache's device (meta here); want no copy from the host",
                           "on CUDA a copy from the host to the GPU waits for the GPU (a host sync, at every drafted "
                           "token of a draft model, which commits 1 a token), and a CUDA graph cannot hold one. What "
                           "fits: torch.tensor(n).to(device) or torch.as_tensor(n).to(...); add the int itself "
                           "(cache.lengths += n), or make it on the device (torch.full_like(cache.lengths, n))")


class ScalarsSent(harness.EagerMode):
    """Each copy of a CPU tensor to 'meta', the stand-in for the GPU (.to(device), copy_), 0-dim ones
    included: on CUDA such a copy, of one number too, waits for the GPU (PyTorch syncs the stream after
    a copy from pageable host memory), and a CUDA graph refuses it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if (func is aten._to_copy.default and args[0].device.type == 'cpu' and str(kwargs.get('device')) == 'meta'
                or func is aten.copy_.default and args[0].device.type == 'meta' and args[1].device.type == 'cpu'):
            self.seen.append(f"{func}{harness.student_line()}")
        return func(*args, **kwargs)


def test_decodes_exactly_greedy(impl):
    """Decodes exactly greedy. Through decode.generate with your cache: the output is plain greedy
    decoding's, with drafts right, sometimes wrong and mostly wrong, rows of one batch advancing
    by their own tau. Hint: the checks above test write and commit alone and say which is off; if
    they pass and this fails, look at rows at different lengths: row b is written at its own
    cache.lengths[b] + 0..L-1 and moves by its own n[b]."""
    model = harness.tiny_target()
    prompts = tokens((3, 8), 5)
    m = 40
    full = harness.plain_greedy(model, prompts, m + 10)                  # the oracle drafts past the end too
    ref = full[:, :8 + m]
    for k, wrong in ((4, lambda t, j: t % 5 == 2 and j == t % 3), (6, lambda t, j: t % 2 == 0 and j == 1)):
        out, _ = decode.generate(model, prompts, m, drafter=harness.GreedyOracle(model, full, k, wrong), k=k)
        assert torch.equal(out, ref), \
            f"k={k}: the output differs from plain greedy decoding at {harness.first_difference(out, ref, 8)}"
    out, _ = decode.generate(model, prompts, m, drafter=harness.peaky(BlockHeads(model.config, 4), 0.5, 4), k=4)
    assert torch.equal(out, ref), \
        f"random heads: the output differs from plain greedy decoding at {harness.first_difference(out, ref, 8)}"
    # a draft model (drafters.DraftModel) keeps a cache of its own, of other heads and head size, written and
    # committed between the target's: what one cache's write keeps must not serve the other's
    small = harness.peaky(GPT(GPTConfig(block_size=96, vocab_size=32, n_layer=1, n_head=4, n_embd=16)), 0.3, 5)
    out, _ = decode.generate(model, prompts, m, drafter=DraftModel(small, k=4), k=4)
    if not torch.equal(out, ref):
        raise harness.Fail(f"a draft model beside the target (two caches, 4 heads of 4 beside 2 of 16): the output "
                           f"differs from plain greedy decoding at {harness.first_difference(out, ref, 8)}",
                           "the draft model's cache and the target's are written in turn, with blocks of the same "
                           "rows and lengths: something made once and kept across calls (a module-level index "
                           "keyed on pos's shape, the first cache's buffers) served the other cache. Key what you "
                           "keep on everything it depends on (the heads and head size, the device), or keep it on "
                           "the cache itself")


def try_it(impl, tryout):
    """BPD heads at k = 8, greedy, on train.py's target: on your cache next to the reference's (in
    a handout, the target alone)."""
    tryout.table(tryout.pair('BPD heads, k = 8', drafter=tryout.drafter('heads.pt'), k=8))
