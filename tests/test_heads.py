"""
heads.py: Blockwise Parallel Decoding's k-offset heads (MATH.md §3).

Fresh heads (c_proj zero) all start as lm_head(ln(h)); `draft` returns argmax drafts (q None) or,
with sample_drafts under sampling, drafts sampled from q = softmax(logits / T) together with that
q; `mixture_logits` is the one-branch mixture view; the random-offset loss's expectation (and its
gradient's) is the full loss; over the logits budget the loss, summed over checkpointed chunks,
equals the one-chunk loss, eager, compiled and under bf16 autocast. Tiny seeded models in float64.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import heads as heads_module
from conftest import randomise, tiny_model
from heads import BlockHeads
from model import GPT, GPTConfig

V = 32           # vocabulary of the tiny targets


def target_and_heads(k, seed, randomised=True):
    """A float64 tiny target far from uniform, heads for block size k (randomised: c_fc and
    c_proj redrawn, so the heads differ from each other), and h (N, C) at the last position of N
    random prompts."""
    model = tiny_model(seed=seed, vocab_size=V, std=0.3)
    torch.manual_seed(seed)
    heads = BlockHeads(model.config, k).double().eval()
    if randomised:
        randomise(heads, seed, std=0.5)
    idx = torch.randint(V, (4, 10), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        h = model.hidden(idx)[:, -1]
    return model, heads, h


# ----------------------------------------------------------------------------- 1. initialisation

@torch.no_grad()
def test_fresh_heads_all_start_as_lm_head_of_ln_h():
    """c_proj starts at zero, so z_i = h and every head's logits are lm_head(ln(h)) for the
    heads' own LayerNorm: all heads start identical."""
    k = 5
    model, heads, _ = target_and_heads(k, seed=1, randomised=False)
    assert heads.c_proj.weight.abs().max() == 0 and heads.c_proj.bias.abs().max() == 0
    assert heads.c_fc.weight.abs().max() > 0          # the shared layer is live: c_proj zeroes it
    idx = torch.randint(V, (3, 10), generator=torch.Generator().manual_seed(2))
    h = model.hidden(idx)                                              # (3, 10, C)
    logits = heads(h, model.lm_head)                                   # (3, 10, k-1, V)
    assert logits.shape == (3, 10, k - 1, V) and logits.dtype == torch.float64
    want = model.lm_head(heads.ln(h))
    for i in range(k - 1):
        torch.testing.assert_close(logits[..., i, :], logits[..., 0, :], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(logits[..., i, :], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(heads.head_logits(h, model.lm_head, i), want, rtol=1e-12,
                                   atol=1e-12)
    # the heads' LayerNorm re-normalises h (already through ln_f): close to the target's own
    # next-token logits, but not a copy
    assert (want - model.lm_head(h)).abs().max() > 1e-6
    # the comparison can fail: a nonzero bias in head 1's rows of c_proj moves head 1 only
    C = model.config.n_embd
    heads.c_proj.bias[C] = 0.5
    moved = heads(h, model.lm_head)
    assert (moved[..., 1, :] - want).abs().max() > 1e-3
    torch.testing.assert_close(moved[..., 0, :], want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- 2. draft

@torch.no_grad()
def test_draft_argmax_or_sampled_with_its_q():
    k, T = 6, 0.8
    model, heads, h = target_and_heads(k, seed=3)
    N = h.size(0)
    bonus = model.lm_head(h).argmax(-1)
    logits = heads(h, model.lm_head, k - 1)                            # (N, k-1, V)
    argmax = logits.argmax(-1)
    assert len(set(argmax.flatten().tolist())) > 1    # the heads do not all draft one token

    # sample_drafts=False under sampling: argmax drafts, a point mass (q None)
    heads.sample_drafts = False
    d, q = heads.draft(h, bonus, model, k, T, torch.Generator().manual_seed(0))
    assert q is None
    assert torch.equal(d, argmax)

    # sample_drafts=True under sampling: each drafted position's q is softmax(logits / T)
    heads.sample_drafts = True
    d, q = heads.draft(h, bonus, model, k, T, torch.Generator().manual_seed(0))
    assert d.shape == (N, k - 1) and d.dtype == torch.long
    assert ((d >= 0) & (d < V)).all()
    assert q.shape == (N, k - 1, V) and q.dtype == torch.float64
    torch.testing.assert_close(q, F.softmax(logits / T, dim=-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q.sum(-1), torch.ones(N, k - 1, dtype=torch.float64), rtol=0,
                               atol=1e-12)
    assert (q.gather(-1, d[..., None]) > 0).all()     # every draft has proposal mass
    assert not torch.equal(d, argmax)                 # sampled, not the argmax
    d2, _ = heads.draft(h, bonus, model, k, T, torch.Generator().manual_seed(0))
    assert torch.equal(d, d2)                         # the generator decides the draws

    # temperature 0: argmax drafts whatever sample_drafts says
    for flag in (True, False):
        heads.sample_drafts = flag
        d, q = heads.draft(h, bonus, model, k, 0.0, torch.Generator().manual_seed(0))
        assert q is None
        assert torch.equal(d, argmax)


# ----------------------------------------------------------------------------- 3. mixture_logits

@torch.no_grad()
def test_mixture_logits_is_the_one_branch_view():
    """log pi is (N, 1) zeros (one branch, probability 1) and, for a block of `block` tokens, the
    branch's logits (N, 1, block-1, V) are the heads' own for the first block-1 heads (the same k
    as draft takes); the bonus is not an input."""
    k = 6
    model, heads, h = target_and_heads(k, seed=5)
    N = h.size(0)
    bonus = model.lm_head(h).argmax(-1)
    for block in (2, 4, k):
        log_pi, logits = heads.mixture_logits(h, bonus, model, block)
        assert log_pi.shape == (N, 1) and log_pi.dtype == torch.float64
        assert torch.equal(log_pi, torch.zeros(N, 1, dtype=torch.float64))
        assert logits.shape == (N, 1, block - 1, V)
        assert torch.equal(logits[:, 0], heads(h, model.lm_head, block - 1))
        _, other = heads.mixture_logits(h, (bonus + 1) % V, model, block)
        assert torch.equal(other, logits)


# ----------------------------------------------------------------------------- 4. random-offset loss

def test_random_offset_loss_expectation_equals_full_loss():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=V, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg).double().eval()
    k, B, T = 5, 3, 20
    heads = randomise(BlockHeads(cfg, k, d_hidden=24).double(), seed=5, std=0.5)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, V, (B, T + k), generator=g)
    idx[0, 3:9] = -1               # positions without a target (as the distillation prompts)
    idx[2, -4:] = -1
    with torch.no_grad():
        h = model.hidden(idx[:, :T].clamp(min=0))
    params = list(heads.parameters())

    full = heads.loss(h, model.lm_head, idx)
    g_full = torch.autograd.grad(full, params)
    per = [heads.loss(h, model.lm_head, idx, offset=i) for i in range(k - 1)]
    g_per = [torch.autograd.grad(l, params) for l in per]

    # the offsets really differ, and the gradients are non-trivial
    vals = torch.stack([l.detach() for l in per])
    assert vals.std() > 1e-3
    assert all(gr.abs().max() > 1e-6 for gr in g_full)
    # expectation over a uniform offset == full loss, and the same for every gradient (float64
    # end to end: the loss must not be computed in float32)
    assert full.dtype == torch.float64
    torch.testing.assert_close(vals.mean(), full.detach(), rtol=1e-12, atol=1e-12)
    for j, p in enumerate(params):
        avg = torch.stack([gp[j] for gp in g_per]).mean(0)
        torch.testing.assert_close(avg, g_full[j], rtol=1e-10, atol=1e-13)
    # head i's loss touches only head i's slice of the output layer
    C = cfg.n_embd
    for i in range(k - 1):
        gw = g_per[i][[j for j, p in enumerate(params) if p is heads.c_proj.weight][0]]
        assert gw[i * C:(i + 1) * C].abs().max() > 0
        mask = torch.ones(gw.size(0), dtype=torch.bool)
        mask[i * C:(i + 1) * C] = False
        assert gw[mask].abs().max() == 0
    # a head's loss is its own cross-entropy, targets `offset + 2` positions ahead
    i = 1
    logits = heads(h, model.lm_head)[:, :, i]                      # (B, T, V)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, i + 2:i + 2 + T].flatten(),
                                           ignore_index=-1)
    torch.testing.assert_close(per[i].detach(), ce.detach(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- 5. memory-bounded loss

def loss_setup(k=5, B=3, T=20, dtype=torch.float64):
    """A tiny target, randomised heads, labels with -1 holes, and h (B, T, C) that wants a grad
    (the joint fine-tuning case)."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=V, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg).to(dtype).eval()
    heads = randomise(BlockHeads(cfg, k, d_hidden=24).double(), seed=5, std=0.5).to(dtype)
    idx = torch.randint(0, V, (B, T + k), generator=torch.Generator().manual_seed(2))
    idx[0, T // 4:T // 2] = -1
    idx[-1, -3:] = -1
    with torch.no_grad():
        h = model.hidden(idx[:, :T].clamp(min=0))
    return model, heads, idx, h.requires_grad_()


def loss_and_grads(model, heads, idx, h, offset):
    """The loss and its gradients for h, the heads' parameters and the tied unembedding."""
    loss = heads.loss(h, model.lm_head, idx, offset)
    return [loss, *torch.autograd.grad(loss, [h, model.lm_head.weight, *heads.parameters()])]


def counting_checkpoint(monkeypatch):
    """Count the chunks run under activation checkpointing."""
    calls = []

    def counted(*args, **kw):
        calls.append(1)
        return checkpoint(*args, **kw)
    monkeypatch.setattr(heads_module, 'checkpoint', counted)
    return calls


@pytest.mark.parametrize('offset', [None, 2])
def test_chunked_loss_equals_the_one_chunk_loss(monkeypatch, offset):
    """Over the budget, each head's loss is summed over checkpointed chunks of rows (the last one
    short) and divided by the head's labelled positions (not a mean of the chunks' means): loss and
    every gradient equal the plain one-chunk path's, -1 labels included."""
    model, heads, idx, h = loss_setup()
    calls = counting_checkpoint(monkeypatch)
    plain = loss_and_grads(model, heads, idx, h, offset)       # the default budget: one chunk
    assert not calls                                           # and no checkpoint overhead
    n_heads, N = (heads.k - 1 if offset is None else 1), h.size(0) * h.size(1)
    monkeypatch.setattr(heads_module, 'LOGITS_BUDGET', 7 * V)  # 7 rows a chunk: 60 = 8 * 7 + 4
    chunked = loss_and_grads(model, heads, idx, h, offset)
    assert len(calls) == n_heads * math.ceil(N / 7)
    assert all(g.abs().max() > 1e-6 for g in plain[1:])
    torch.testing.assert_close(chunked, plain, rtol=1e-12, atol=1e-14)
    # the budget counts every head's logits: one head's fit, all k-1 do not, so each is checkpointed
    if offset is None:
        calls.clear()
        monkeypatch.setattr(heads_module, 'LOGITS_BUDGET', N * V)
        torch.testing.assert_close(loss_and_grads(model, heads, idx, h, offset), plain, rtol=1e-12, atol=1e-14)
        assert len(calls) == n_heads


@pytest.mark.second_process   # a compile: on the other core (conftest.py)
def test_chunked_loss_compiles_without_graph_breaks(monkeypatch):
    """The training step can be compiled: the checkpointed chunks trace with fullgraph=True
    (aot_eager: autograd traced, no code generation) and give the eager loss and gradients. One
    head in two chunks, the smallest case that has them: each checkpointed chunk costs tracing time
    (the first compile in a process also pays dynamo's warm-up)."""
    torch._dynamo.reset()
    model, heads, idx, h = loss_setup(k=2, B=2, T=4)
    want = loss_and_grads(model, heads, idx, h, None)
    monkeypatch.setattr(heads_module, 'LOGITS_BUDGET', 4 * V)   # 4 rows: 2 chunks
    step = torch.compile(lambda h: heads.loss(h, model.lm_head, idx), backend='aot_eager', fullgraph=True)
    loss = step(h)
    got = [loss, *torch.autograd.grad(loss, [h, model.lm_head.weight, *heads.parameters()])]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_chunked_loss_under_bf16_autocast(monkeypatch):
    """Under CPU bf16 autocast the logits are bf16 and the cross-entropy float32, chunked or not;
    the chunks recompute under the same autocast in backward."""
    model, heads, idx, h = loss_setup(dtype=torch.float32)
    made, real = [], BlockHeads.head_logits
    monkeypatch.setattr(BlockHeads, 'head_logits', lambda self, *a: made.append(real(self, *a)) or made[-1])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        plain = loss_and_grads(model, heads, idx, h, None)
        monkeypatch.setattr(heads_module, 'LOGITS_BUDGET', 7 * V)
        chunked = loss_and_grads(model, heads, idx, h, None)
    assert made and all(logits.dtype == torch.bfloat16 for logits in made)
    assert plain[0].dtype == chunked[0].dtype == torch.float32
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-6, atol=0)
    # a weight's gradient is a bf16 matmul over the rows: chunked, a sum of per-chunk bf16 results,
    # so each chunk rounds on its own (bf16 keeps 8 bits: about 0.4%)
    for c, p in zip(chunked[1:], plain[1:]):
        assert c.dtype == torch.float32 and (c - p).abs().max() <= 2e-2 * p.abs().max()


# ----------------------------------------------------------------------------- MATH.md's equations, written out

def test_bpd_heads_are_math_md_s3_equation_with_live_weights():
    """§3: o = W2 relu(W1 h) (+ biases) split into o_1..o_{k-1}, logits_i = lm_head(LN(h + o_i)), with
    W2 non-zero (the existing test has W2 = 0, where neither the relu nor the split shows)."""
    model, k = tiny_model(seed=1, vocab_size=32, std=0.3), 5
    heads = randomise(BlockHeads(model.config, k, d_hidden=24).double(), 3, std=0.5)
    h = torch.randn(6, model.config.n_embd, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        o = F.relu(h @ heads.c_fc.weight.T + heads.c_fc.bias) @ heads.c_proj.weight.T + heads.c_proj.bias
        o = o.view(6, k - 1, model.config.n_embd)                            # group i-1 is head i's
        want = model.lm_head(heads.ln(h[:, None] + o))
        torch.testing.assert_close(heads(h, model.lm_head), want, rtol=0, atol=1e-12)
        for i in range(k - 1):
            torch.testing.assert_close(heads.head_logits(h, model.lm_head, i), want[:, i], rtol=0, atol=1e-12)
            # the first i + 1 heads alone (decoding at a smaller k): the same groups of W2
            torch.testing.assert_close(heads(h, model.lm_head, i + 1), want[:, :i + 1], rtol=0, atol=1e-12)
