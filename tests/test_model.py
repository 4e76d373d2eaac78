"""The target GPT: cached forward vs full forward, committing part of a block, greedy through the cache, nanoGPT
checkpoints against an independent GPT-2 forward, seeded sampling."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from cli import BadInput
from data import load_target, save_checkpoint
from decode import generate
from model import GPT, GPTConfig, KVCache, cached_attention, manual_attention, sample, tempered

TOL = 1e-10


def full_logits(model, seq):
    """Logits of the full causal forward of one row's own sequence (1-D LongTensor)."""
    return model(seq[None])[0][0]


# --------------------------------------------------------------------------- KV cache

def test_cached_block_matches_full_forward_rows_of_different_lengths():
    model = tiny_model(seed=1, vocab_size=64, std=0.2)
    g = torch.Generator().manual_seed(0)
    B, T0, L = 2, 12, 5
    prefix = torch.randint(64, (B, T0), generator=g)
    block = torch.randint(64, (B, L), generator=g)

    cache = model.new_cache(B, 40)
    assert isinstance(cache, KVCache)
    assert cache.k.dtype == torch.float64
    with torch.no_grad():
        h = model.forward_cached(prefix, cache)
        assert cache.lengths.tolist() == [0, 0]          # forward_cached does not advance
        # the prefill itself already matches the full forward
        ref = model(prefix)[0]
        assert (model.lm_head(h) - ref).abs().max().item() < TOL

        # row 0 keeps its 12 tokens, row 1 only 7: its last 5 stay in the buffer, masked
        keep = torch.tensor([T0, 7])
        cache.commit(keep)
        assert cache.lengths.tolist() == [T0, 7]
        got = model.lm_head(model.forward_cached(block, cache))    # (B, L, V)

        for b in range(B):
            seq = torch.cat([prefix[b, :keep[b]], block[b]])
            want = full_logits(model, seq)[-L:]
            err = (got[b] - want).abs().max().item()
            assert err < TOL, f"row {b}: cached vs full max abs diff {err}"
        # different rows really were at different positions: row 1's result is not what it
        # would be at row 0's offset (guards against a mask/position bug that ignores lengths)
        wrong = full_logits(model, torch.cat([prefix[1], block[1]]))[-L:]
        assert (got[1] - wrong).abs().max().item() > 1e-3


def test_manual_attention_is_the_fused_kernels_attention():
    """The attention a compiled step runs (manual_attention) equals torch's fused kernel, the one an
    eager step runs, over the same mask (float64): queries that see only themselves, the whole
    cache, or a ragged prefix per row."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)            # 4 queries, 10 keys
    K, V = (torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    keys = torch.arange(10)
    mask = (keys[None, None, :] <= torch.tensor([[3, 4, 5, 6], [0, 1, 8, 9]])[:, :, None])[:, None]   # (2, 1, 4, 10)
    fused = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    assert torch.allclose(manual_attention(q, K, V, mask), fused, atol=1e-12, rtol=0)
    assert torch.equal(cached_attention(q, K, V, mask), fused)       # op by op: the fused kernel


def test_a_compiled_step_attends_without_the_fused_kernel():
    """Compiled, the cached forward traces the manual attention (no scaled_dot_product_attention in
    its graph: that kernel took three quarters of a compiled step on one H200); op by op it runs the
    fused one."""
    model = tiny_model(seed=0, std=0.1, dtype=torch.float64)
    cache = model.new_cache(1, 16)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == 'call_function')
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model.forward_cached, backend=backend, fullgraph=True)(torch.zeros(1, 3, dtype=torch.long), cache)
    assert ops and not any('scaled_dot_product' in op for op in ops) and any('softmax' in op for op in ops)


def test_cached_token_by_token_matches_full_forward():
    """Decoding one token at a time through the cache (L = 1) is the full forward, at every step,
    up to the last position of the context (block_size)."""
    model = tiny_model(seed=2, vocab_size=48, block_size=24, std=0.2)
    seq = torch.randint(48, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = model(seq)[0]
    cache = model.new_cache(2, 24)
    with torch.no_grad():
        outs = []
        for t in range(24):
            outs.append(model.lm_head(model.forward_cached(seq[:, t:t + 1], cache)))
            cache.commit(1)
    got = torch.cat(outs, dim=1)
    assert (got - ref).abs().max().item() < TOL


def test_rejected_entries_are_overwritten_as_if_never_written():
    """A block written and only partly committed (what verification does): the next block
    overwrites the rejected entries, and everything equals a fresh run over the kept tokens."""
    model = tiny_model(seed=4, vocab_size=64, std=0.2)
    g = torch.Generator().manual_seed(5)
    B = 2
    a = torch.randint(64, (B, 14), generator=g)       # a block, of which only a prefix is kept
    b = torch.randint(64, (B, 6), generator=g)        # what follows the kept prefix
    c = torch.randint(64, (B, 3), generator=g)        # one more block on top
    keep = torch.tensor([4, 9])

    with torch.no_grad():
        used = model.new_cache(B, 32)
        model.forward_cached(a, used)
        used.commit(keep)
        h_b = model.forward_cached(b, used)
        used.commit(b.size(1))
        h_c = model.forward_cached(c, used)

        for r in range(B):
            fresh = model.new_cache(1, 32)
            pre = a[r:r + 1, :keep[r]]
            model.forward_cached(pre, fresh)
            fresh.commit(pre.size(1))
            f_b = model.forward_cached(b[r:r + 1], fresh)
            fresh.commit(b.size(1))
            f_c = model.forward_cached(c[r:r + 1], fresh)
            assert (h_b[r] - f_b[0]).abs().max().item() < TOL
            assert (h_c[r] - f_c[0]).abs().max().item() < TOL
            # the committed part of the cache is the same as the fresh one's
            n = int(keep[r]) + b.size(1)
            assert used.lengths[r].item() == n
            assert (used.k[:, r, :, :n] - fresh.k[:, 0, :, :n]).abs().max().item() < TOL
            assert (used.v[:, r, :, :n] - fresh.v[:, 0, :, :n]).abs().max().item() < TOL
            # and both agree with the full forward of the row's committed sequence
            seq = torch.cat([a[r, :keep[r]], b[r], c[r]])
            want = model.hidden(seq[None])[0, -c.size(1):]
            assert (h_c[r] - want).abs().max().item() < TOL


# --------------------------------------------------------------------------- greedy decoding

def greedy_by_recomputation(model, prompt, n):
    idx = prompt.clone()
    for _ in range(n):
        logits = model(idx)[0][:, -1]
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


@torch.no_grad()
def test_greedy_generate_equals_full_recomputation():
    model = tiny_model(seed=6, vocab_size=64, std=0.3)
    prompt = torch.randint(64, (4, 5), generator=torch.Generator().manual_seed(7))
    n = 30
    out, stats = generate(model, prompt, n, temperature=0.0)
    ref = greedy_by_recomputation(model, prompt, n)
    assert out.shape == (4, 5 + n)
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, ref), (out, ref)
    # rows behave differently (the test would be weak if every row produced the same tokens)
    assert len({tuple(r) for r in out[:, 5:].tolist()}) > 1
    # plain decoding: one target call per generated token, the prefill's included
    assert stats['calls'] == n


def test_a_tiny_temperature_is_the_greedy_limit_in_every_dtype():
    """tempered at a T far below float32's smallest number (1e-300 is 0 there, and 0 / 0 NaN): the
    one-hot of the argmax, as at 1e-30; sampling at it decodes what greedy decoding does."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5]])
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for T in (1e-30, 1e-300, 5e-324):
            p = F.softmax(tempered(logits.to(dtype), T), -1)
            assert torch.equal(p, F.one_hot(torch.tensor([1]), 4).to(dtype)), (dtype, T, p)
    model = tiny_model(seed=6, vocab_size=64, std=0.3)
    prompt = torch.randint(64, (2, 5), generator=torch.Generator().manual_seed(7))
    greedy, _ = generate(model, prompt, 12)
    sampled, _ = generate(model, prompt, 12, temperature=1e-300, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sampled, greedy)


@torch.no_grad()
def test_greedy_generate_to_the_end_of_the_context():
    """prompt + max_new_tokens == block_size is allowed and still exact."""
    model = tiny_model(seed=8, vocab_size=40, block_size=20, std=0.3)
    prompt = torch.randint(40, (2, 3), generator=torch.Generator().manual_seed(9))
    out, _ = generate(model, prompt, 17, temperature=0.0)
    assert torch.equal(out, greedy_by_recomputation(model, prompt, 17))


@torch.no_grad()
def test_gpt_generate_is_nanogpts_loop():
    """GPT.generate, the reference the cached decoders are tested against (conftest.naive_greedy):
    greedy is the hand-written recompute loop; past the context it crops to the last block_size
    tokens as nanoGPT does; top_k=1 is greedy at any temperature; every sampled token is among the
    top_k of the logits recomputed over its prefix."""
    model = tiny_model(seed=6, vocab_size=64, block_size=16, std=0.3)
    prompt = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(7))
    greedy = model.generate(prompt, 11, temperature=0)
    assert torch.equal(greedy, greedy_by_recomputation(model, prompt, 11))
    longer = model.generate(greedy, 3, temperature=0)                       # 16 -> 19 tokens
    for t in range(16, 19):
        assert torch.equal(longer[:, t], model(longer[:, t - 16:t])[0][:, -1].argmax(-1))
    assert torch.equal(model.generate(prompt, 11, 1.5, top_k=1, generator=torch.Generator().manual_seed(1)), greedy)
    out = model.generate(prompt, 11, 2.0, top_k=3, generator=torch.Generator().manual_seed(2))
    for t in range(5, 16):
        top3 = model(out[:, :t])[0][:, -1].topk(3).indices
        assert (top3 == out[:, t:t + 1]).any(-1).all()
    assert not torch.equal(out, greedy)                                     # it did sample


@torch.no_grad()
def test_cached_plain_sampling_draws_what_gpt_generate_draws():
    """decode.generate without a drafter, sampling, gives GPT.generate's tokens from the same seed
    (float64: the cached and the recomputed logits agree far below where a draw could flip)."""
    model = tiny_model(seed=3, vocab_size=64, std=0.3)
    prompt = torch.randint(64, (4, 6), generator=torch.Generator().manual_seed(4))
    for T in (0.7, 1.3):
        out, _ = generate(model, prompt, 20, temperature=T, generator=torch.Generator().manual_seed(5))
        assert torch.equal(out, model.generate(prompt, 20, T, generator=torch.Generator().manual_seed(5)))


# --------------------------------------------------------------------------- nanoGPT checkpoints

def nanogpt_state_dict(cfg, seed):
    """A random state dict laid out exactly as nanoGPT saves a torch.compile'd model trained on
    its non-flash path: '_orig_mod.' prefixes, causal-mask buffers, wte and lm_head both present."""
    g = torch.Generator().manual_seed(seed)
    C, V = cfg.n_embd, cfg.vocab_size

    def r(*shape, s=0.2):
        return torch.randn(*shape, generator=g) * s

    sd = {}
    wte = r(V, C, s=0.5)
    sd['transformer.wte.weight'] = wte
    sd['transformer.wpe.weight'] = r(cfg.block_size, C, s=0.5)
    for i in range(cfg.n_layer):
        p = f'transformer.h.{i}.'
        sd[p + 'ln_1.weight'] = 1 + r(C)
        sd[p + 'attn.c_attn.weight'] = r(3 * C, C)
        sd[p + 'attn.c_proj.weight'] = r(C, C)
        sd[p + 'attn.bias'] = torch.tril(torch.ones(cfg.block_size, cfg.block_size)).view(
            1, 1, cfg.block_size, cfg.block_size)
        sd[p + 'ln_2.weight'] = 1 + r(C)
        sd[p + 'mlp.c_fc.weight'] = r(4 * C, C)
        sd[p + 'mlp.c_proj.weight'] = r(C, 4 * C)
        if cfg.bias:
            sd[p + 'ln_1.bias'] = r(C)
            sd[p + 'attn.c_attn.bias'] = r(3 * C)
            sd[p + 'attn.c_proj.bias'] = r(C)
            sd[p + 'ln_2.bias'] = r(C)
            sd[p + 'mlp.c_fc.bias'] = r(4 * C)
            sd[p + 'mlp.c_proj.bias'] = r(C)
    sd['transformer.ln_f.weight'] = 1 + r(C)
    if cfg.bias:
        sd['transformer.ln_f.bias'] = r(C)
    sd['lm_head.weight'] = wte  # tied: nanoGPT's state_dict holds both names
    return {'_orig_mod.' + k: v for k, v in sd.items()}


def reference_gpt2(sd, cfg, idx):
    """GPT-2 forward from a raw (prefix-free) state dict with plain torch ops, float64."""
    W = {k: v.double() for k, v in sd.items()}
    B, T = idx.shape
    C, H = cfg.n_embd, cfg.n_head
    hs = C // H

    def ln(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + 1e-5) * W[name + '.weight']
        return y + W[name + '.bias'] if name + '.bias' in W else y

    def lin(x, name):
        y = x @ W[name + '.weight'].T
        return y + W[name + '.bias'] if name + '.bias' in W else y

    def gelu(x):
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    x = W['transformer.wte.weight'][idx] + W['transformer.wpe.weight'][:T][None]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg.n_layer):
        p = f'transformer.h.{i}.'
        a = lin(ln(x, p + 'ln_1'), p + 'attn.c_attn')
        q, k, v = a[..., :C], a[..., C:2 * C], a[..., 2 * C:]
        q = q.reshape(B, T, H, hs).permute(0, 2, 1, 3)
        k = k.reshape(B, T, H, hs).permute(0, 2, 1, 3)
        v = v.reshape(B, T, H, hs).permute(0, 2, 1, 3)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = att.masked_fill(~causal, float('-inf'))
        att = torch.exp(att - att.amax(-1, keepdim=True))
        att = att / att.sum(-1, keepdim=True)
        y = (att @ v).permute(0, 2, 1, 3).reshape(B, T, C)
        x = x + lin(y, p + 'attn.c_proj')
        m = gelu(lin(ln(x, p + 'ln_2'), p + 'mlp.c_fc'))
        x = x + lin(m, p + 'mlp.c_proj')
    x = ln(x, 'transformer.ln_f')
    return x @ W['lm_head.weight'].T


@pytest.mark.parametrize('bias', [True, False])
def test_nanogpt_checkpoint_matches_independent_gpt2_forward(tmp_path, bias):
    cfg = GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=4, n_embd=32, bias=bias)
    sd = nanogpt_state_dict(cfg, seed=11)
    assert any(k.endswith('.attn.bias') for k in sd) and all(k.startswith('_orig_mod.') for k in sd)
    model_args = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, bias=bias, vocab_size=50,
                      dropout=0.0)
    ckpt = dict(model=sd, model_args=model_args, iter_num=123, best_val_loss=1.5,
                config={'dataset': 'shakespeare_char'})  # what nanoGPT writes besides
    idx = torch.randint(50, (3, 32), generator=torch.Generator().manual_seed(12))
    raw = {k.removeprefix('_orig_mod.'): v for k, v in sd.items()}
    want = reference_gpt2(raw, cfg, idx)

    m1 = GPT.from_checkpoint(ckpt).double().eval()
    path = tmp_path / 'nanogpt_ckpt.pt'
    torch.save(ckpt, path)
    m2 = load_target(str(path)).double()
    assert not m2.training
    for m in (m1, m2):
        assert m.config == cfg
        with torch.no_grad():
            got = m(idx)[0]
        err = (got - want).abs().max().item()
        assert err < 1e-10, f"max abs diff vs reference GPT-2: {err}"
        # the reference is not trivially close to anything: logits spread over several units
        assert want.std().item() > 0.5
        # and the cached path agrees with it too
        with torch.no_grad():
            cache = m.new_cache(3, 32)
            h = m.forward_cached(idx, cache)
        assert (m.lm_head(h) - want).abs().max().item() < 1e-10


def test_nanogpt_checkpoint_rejects_missing_weights():
    """Ignoring attn.bias must not mean ignoring real weights: a missing key is an error."""
    cfg = GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=8)
    sd = nanogpt_state_dict(cfg, seed=13)
    del sd['_orig_mod.transformer.h.0.mlp.c_fc.weight']
    with pytest.raises(RuntimeError):
        GPT.from_checkpoint(dict(model=sd, model_args=vars(cfg)))


def test_our_checkpoint_round_trip(tmp_path):
    model = tiny_model(seed=14, vocab_size=32, std=0.2, dtype=torch.float32)
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(dict(model=model.state_dict(), model_args=vars(model.config)), str(path))
    back = load_target(str(path))
    assert back.fingerprint() == model.fingerprint()
    idx = torch.randint(32, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(idx)[0], model(idx)[0])


def test_checkpoint_with_numpy_scalars_loads_and_code_does_not(tmp_path):
    """A training script may leave numpy scalars in a checkpoint (a learning rate computed with
    numpy in the optimizer's state, a loss): they load with weights_only. Anything that names other
    code is still refused, and does not run."""
    model = tiny_model(seed=15, vocab_size=32, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=float(np.float64(1e-3)))
    opt.param_groups[0]['lr'] = np.float64(1e-3) * np.cos(np.float64(0.5))
    path = tmp_path / 'ckpt.pt'
    torch.save(dict(model=model.state_dict(), model_args=vars(model.config), optimizer=opt.state_dict(),
                    best_val_loss=np.float32(1.5), iter_num=np.int64(3)), path)
    assert load_target(str(path)).fingerprint() == model.fingerprint()

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / 'ran'), 'w'))
    torch.save(dict(model=model.state_dict(), model_args=vars(model.config), extra=Payload()), tmp_path / 'evil.pt')
    with pytest.raises(BadInput, match='refused'):
        load_target(str(tmp_path / 'evil.pt'))
    assert not (tmp_path / 'ran').exists()


# --------------------------------------------------------------------------- sampling

@torch.no_grad()
def test_seeded_sampling_is_reproducible():
    model = tiny_model(seed=15, vocab_size=64, std=0.1)
    prompt = torch.randint(64, (2, 4), generator=torch.Generator().manual_seed(16))
    # the model's next-token distribution is far from a point mass, so sampling is random
    p = F.softmax(model(prompt)[0][:, -1], -1)
    assert p.max().item() < 0.5

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(model, prompt, 24, temperature=1.0, generator=g)[0]

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 4:], c[:, 4:])
    assert torch.equal(a[:, :4], prompt) and torch.equal(c[:, :4], prompt)
    # and sampling differs from greedy
    greedy = generate(model, prompt, 24, temperature=0.0)[0]
    assert not torch.equal(a, greedy)


@torch.no_grad()
def test_sampled_first_token_follows_softmax():
    """The first sampled token of many identical rows has the model's softmax(logits / T)
    distribution (a bias in the sampler, e.g. an off-by-one in the inverse CDF, shows here)."""
    V, N, temp = 8, 20000, 0.7
    model = tiny_model(seed=17, vocab_size=V, n_embd=16, std=0.5)
    prompt = torch.tensor([[1, 2, 3]]).repeat(N, 1)
    p = F.softmax(model(prompt[:1])[0][0, -1] / temp, -1)
    out, _ = generate(model, prompt, 1, temperature=temp, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out[:, 3], minlength=V).double() / N
    sd = torch.sqrt(p * (1 - p) / N)
    assert ((freq - p).abs() <= 5 * sd + 1e-4).all(), (freq, p)
    assert p.max().item() < 0.9   # a non-trivial distribution


def test_sample_keeps_its_index_in_the_vocabulary_for_a_subnormal_row():
    """MATH.md §4: for a row whose total is subnormal the uniform draw times the total can round up
    to the total itself, which searchsorted places past the vocabulary; the clamp keeps it there.
    For a normal total u < 1 keeps it below, and the draws follow the weights."""
    tiny = torch.finfo(torch.float32).tiny
    g = torch.Generator().manual_seed(0)
    weights = torch.tensor([[1.4e-45, 1.4e-45]]).expand(4000, 2)           # subnormal: two of the smallest
    u = torch.rand(4000, 1, generator=torch.Generator().manual_seed(0))
    cdf = weights.cumsum(-1)
    assert (torch.searchsorted(cdf, u * cdf[:, -1:], right=True) == 2).any()   # the case the clamp is for
    assert set(sample(weights, torch.Generator().manual_seed(0)).tolist()) <= {0, 1}
    normal = torch.tensor([[tiny, 3 * tiny]]).expand(40000, 2)
    freq = sample(normal, g).double().mean()                                # the share of index 1: 3/4
    assert abs(float(freq) - 0.75) < 5 * (0.75 * 0.25 / 40000) ** 0.5

