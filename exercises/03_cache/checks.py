"""Exercise 3's checks: the cache (README.md). Your write and commit run as model.KVCache's methods."""
import torch

import decode
from exercises import harness
from heads import BlockHeads

NAMES = ('write', 'commit')
SEAMS = {'model.KVCache.write': 'write', 'model.KVCache.commit': 'commit'}
REFERENCE = {'write': 'model.KVCache.write', 'commit': 'model.KVCache.commit'}
TOL = 1e-10


def tokens(shape, seed):
    return torch.randint(32, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_a_prefill_matches_the_full_forward(impl):
    """A prefill matches the full forward. The prompt's keys and values written, then committed:
    the logits equal a full causal forward over it, and each row's length is the prompt's.
    Hint: write at cache.k[layer_idx] along the position dimension (dim 2 of (B, nh, max_len, hs))."""
    model = harness.tiny_target()
    prompt = tokens((2, 9), 0)
    cache = model.new_cache(2, 32)
    h = model.forward_cached(prompt, cache)
    impl.commit(cache, 9)
    assert cache.lengths.tolist() == [9, 9], f"lengths {cache.lengths.tolist()} after committing 9 tokens, want [9, 9]"
    err = (model.lm_head(h) - model(prompt)[0]).abs().max().item()
    assert err < TOL, f"cached logits differ from the full forward by {err:.2e}"


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
    and the new ones (float64). Hint: the next block is written at cache.lengths[b] + 0..L-1, on
    top of the rejected entries; attention masks everything past a row's positions."""
    model = harness.tiny_target()
    prompt, block, nxt, last = tokens((2, 7), 1), tokens((2, 6), 2), tokens((2, 3), 3), tokens((2, 2), 4)
    keep = torch.tensor([2, 5])
    cache = model.new_cache(2, 32)
    model.forward_cached(prompt, cache)
    impl.commit(cache, 7)
    model.forward_cached(block, cache)
    impl.commit(cache, keep)
    got = model.lm_head(model.forward_cached(nxt, cache))
    impl.commit(cache, 3)
    got_last = model.lm_head(model.forward_cached(last, cache))
    for b in range(2):
        seq = torch.cat([prompt[b], block[b, :keep[b]], nxt[b]])
        err = (got[b] - model(seq[None])[0][0, -3:]).abs().max().item()
        assert err < TOL, f"row {b} (kept {int(keep[b])} of 6): the next block's logits differ by {err:.2e}"
        seq = torch.cat([seq, last[b]])
        err = (got_last[b] - model(seq[None])[0][0, -2:]).abs().max().item()
        assert err < TOL, f"row {b}: the block after that differs by {err:.2e}"


def test_no_host_sync(impl):
    """No host sync. Hint: scatter_ (or index_copy_) with the positions as a tensor; no int(), no .item()."""
    model = harness.tiny_target()
    cache = model.new_cache(2, 32)
    k = torch.randn(2, 2, 3, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2], [4, 5, 6]])
    n = torch.tensor([1, 2])
    with harness.HostSyncs() as syncs:
        impl.write(cache, 1, k, k, pos)
        impl.commit(cache, n)
    assert not syncs.seen, f"host syncs: {', '.join(sorted(set(syncs.seen)))}"


def test_decodes_exactly_greedy(impl):
    """Decodes exactly greedy. Through decode.generate with your cache: the output is plain greedy
    decoding's, with drafts right, sometimes wrong and mostly wrong, rows of one batch advancing
    by their own tau. Hint: a row that accepts less than another must not inherit its length."""
    model = harness.tiny_target()
    prompts = tokens((3, 8), 5)
    m = 40
    ref = harness.plain_greedy(model, prompts, m + 10)
    for k, wrong in ((4, lambda t, j: t % 5 == 2 and j == t % 3), (6, lambda t, j: t % 2 == 0 and j == 1)):
        out, _ = decode.generate(model, prompts, m, drafter=harness.GreedyOracle(model, ref, k, wrong), k=k)
        assert torch.equal(out, ref[:, :8 + m]), f"k={k}: the output differs from plain greedy decoding"
    out, _ = decode.generate(model, prompts, m, drafter=harness.peaky(BlockHeads(model.config, 4), 0.5, 4), k=4)
    assert torch.equal(out, ref[:, :8 + m]), "random heads: the output differs from plain greedy decoding"


def try_it(impl, tryout):
    """BPD heads at k = 8, greedy, on train.py's target: yours next to the project's."""
    heads = tryout.drafter('heads.pt')
    tryout.table([tryout.row('project', False, drafter=heads, k=8), tryout.row('yours', True, drafter=heads, k=8)])
