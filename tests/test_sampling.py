"""Lossless speculative sampling and the DBlast drafter (DESIGN §2 sampling, §4)."""
import itertools
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import decode  # noqa: E402
from dblast import DBlastDrafter  # noqa: E402
from decode import generate  # noqa: E402
from heads import BlockHeads  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

V = 8                     # small vocabulary: continuations can be enumerated
CFG = GPTConfig(block_size=32, vocab_size=V, n_layer=2, n_head=2, n_embd=16)
PROMPT = torch.tensor([[1, 5, 2, 7]])


def peaky(module, std, seed):
    """Random weights large enough that p and q are far from uniform (and far from each other)."""
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module.double().eval()


@pytest.fixture(scope='module')
def target():
    return peaky(GPT(CFG), 0.3, 0)


def make_drafter(kind, seed=1):
    if kind == 'heads':
        return peaky(BlockHeads(CFG, 4), 0.3, seed)
    d = peaky(DBlastDrafter(CFG, 4, K=1 if kind == 'dblast1' else 4), 0.3, seed)
    d.sample_drafts = kind == 'dblast-sampled'
    return d


def continuation_probs(model, prompt, n, temperature):
    """Exact p_T(x_1..x_n | prompt) for all V**n continuations, by enumeration. (V**n,)"""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logp = F.log_softmax(model(full)[0] / temperature, dim=-1)
    T0 = prompt.size(1)
    lp = logp[:, T0 - 1:-1].gather(-1, seqs.unsqueeze(-1)).squeeze(-1).sum(-1)
    return lp.exp()


def chi_square(counts, probs, n):
    """Pearson statistic (cells with expected < 5 pooled) and the 0.1% critical value
    (Wilson-Hilferty approximation of the chi-square quantile)."""
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    df = int(keep.sum()) - 1
    z = 3.09  # one-sided 0.1%
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def spec_counts(model, drafter, temperature, n_rows, seed, m=3):
    g = torch.Generator().manual_seed(seed)
    out, stats = generate(model, PROMPT.expand(n_rows, -1), m, drafter=drafter, k=4,
                          temperature=temperature, generator=g)
    codes = (out[:, PROMPT.size(1):] * torch.tensor([V ** (m - 1 - i) for i in range(m)])).sum(-1)
    return torch.bincount(codes, minlength=V ** m).double(), stats


N_ROWS = 30000


@pytest.mark.parametrize('temperature', [0.7, 1.5])
@pytest.mark.parametrize('kind', ['heads', 'dblast', 'dblast-sampled'])
def test_speculative_sampling_is_lossless(target, kind, temperature):
    """3-token continuations from speculative sampling follow the target's exact distribution."""
    probs = continuation_probs(target, PROMPT, 3, temperature)
    counts, stats = spec_counts(target, make_drafter(kind), temperature, N_ROWS, seed=0)
    stat, crit = chi_square(counts, probs, N_ROWS)
    assert stat < crit, f"{kind} T={temperature}: chi2 {stat:.1f} >= {crit:.1f}"
    # and the drafts were really exercised: some accepted, some rejected
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 4).any()


@pytest.mark.parametrize('kind', ['heads', 'dblast-sampled'])
def test_chi_square_catches_a_broken_verifier(target, kind, monkeypatch):
    """The same test rejects a verifier that draws the bonus from p instead of the residual."""
    probs = continuation_probs(target, PROMPT, 3, 1.5)
    monkeypatch.setattr(decode, 'residual', lambda p, q, drafts: p)
    counts, _ = spec_counts(target, make_drafter(kind), 1.5, N_ROWS, seed=0)
    stat, crit = chi_square(counts, probs, N_ROWS)
    assert stat > crit, f"broken verifier passed: chi2 {stat:.1f} < {crit:.1f}"


def test_q_must_be_the_drafts_own_distribution(target, monkeypatch):
    """Drafts sampled from q at T = 1.5 but verified with q at T = 1 (temperature applied to p and
    the sampling, not to the q handed to the verifier) bias the output: the test catches it."""
    drafter = make_drafter('dblast-sampled')
    real_draft = drafter.draft

    def draft_with_q_at_t1(h, bonus, tgt, k, temperature, generator):
        d, q = real_draft(h, bonus, tgt, k, temperature, generator)
        return d, F.softmax(q.log() * temperature, dim=-1)     # q re-tempered to T = 1
    monkeypatch.setattr(drafter, 'draft', draft_with_q_at_t1)
    probs = continuation_probs(target, PROMPT, 3, 1.5)
    counts, _ = spec_counts(target, drafter, 1.5, N_ROWS, seed=0)
    stat, crit = chi_square(counts, probs, N_ROWS)
    assert stat > crit


def test_residual_never_divides_by_zero():
    """p == q everywhere: the residual is all zero, so the bonus falls back to p (finite, valid)."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]], dtype=torch.float64)
    r = decode.residual(p, p.clone(), torch.tensor([[0]]))
    assert torch.equal(r, p)
    point = decode.residual(torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]), None, torch.tensor([[0]]))
    assert torch.isfinite(point).all() and point.sum() > 0
    idx = decode.sample(torch.tensor([[0.0, 3.0, 1.0]]), torch.Generator().manual_seed(0))
    assert idx.item() in (1, 2)


def test_sampling_reproducible_with_generator(target):
    d = make_drafter('dblast-sampled')
    runs = [generate(target, PROMPT.expand(16, -1), 12, drafter=d, temperature=1.0,
                     generator=torch.Generator().manual_seed(s))[0] for s in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


# --------------------------------------------------------------------------- DBlast losses

def enumerate_blocks(model, drafter, temperature):
    """Every (bonus, x_1..x_{k-1}) after PROMPT with its exact target probability, and the
    drafter's log pi / log q / target log p on it."""
    k = drafter.k
    seqs = torch.tensor(list(itertools.product(range(V), repeat=k)))      # bonus + k-1 drafts
    full = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    T0 = PROMPT.size(1)
    with torch.no_grad():
        h = model.hidden(full)
        logp = F.log_softmax(model.lm_head(h) / temperature, dim=-1)
        lp = logp[:, T0 - 1:-1].gather(-1, seqs.unsqueeze(-1)).squeeze(-1)   # (N, k)
        log_pi, log_qx = drafter.log_q(h[:, T0 - 1], seqs[:, 0], model, seqs[:, 1:], temperature)
    return lp, log_pi, log_qx


@pytest.mark.parametrize('K', [1, 4])
def test_al_identity_matches_measured_acceptance(target, K):
    """DESIGN §4: E_{x~p}[sum_j exp(a_j)] (no threshold, z ~ pi) equals the accepted drafts the
    decoder measures with sampled drafts. The expectation is computed exactly by enumeration."""
    T = 1.0
    drafter = peaky(DBlastDrafter(CFG, 4, K), 0.3, 2)
    drafter.sample_drafts, drafter.zt = True, 1.0
    lp, log_pi, log_qx = enumerate_blocks(target, drafter, T)
    a = DBlastDrafter.prefix_log_accept(log_pi, log_qx, lp[:, 1:])
    expected = (lp.sum(-1).exp() * a.exp().sum(-1)).sum().item()
    n = 40000
    _, stats = generate(target, PROMPT.expand(n, -1), 4, drafter=drafter, temperature=T,
                        generator=torch.Generator().manual_seed(0))
    first = torch.tensor(stats['accept_lengths'][:n], dtype=torch.float64) - 1   # step 1 of each row
    se = first.std().item() / math.sqrt(n)
    assert abs(first.mean().item() - expected) < 4 * se, (first.mean().item(), expected, se)
    assert 0.2 < expected < 2.8   # non-trivial: neither all rejected nor all accepted


def test_mixture_nll_k1_is_sum_of_cross_entropies(target):
    drafter = peaky(DBlastDrafter(CFG, 4, 1), 0.3, 3)
    torch.manual_seed(0)
    h = torch.randn(5, CFG.n_embd, dtype=torch.float64)
    bonus, x = torch.randint(V, (5,)), torch.randint(V, (5, 3))
    log_pi, log_qx = drafter.log_q(h, bonus, target, x, temperature=0.7)
    _, u_z = drafter.branches(h, bonus, target)
    logits = drafter.block(u_z[:, 0], target.lm_head) / 0.7                  # (5, 3, V)
    ce = F.cross_entropy(logits.flatten(0, 1), x.flatten(), reduction='none').view(5, 3).sum(-1)
    assert torch.allclose(DBlastDrafter.nll(log_pi, log_qx), ce, atol=1e-12)


def test_al_loss_threshold_and_fallback(target):
    """The AL loss keeps only prefixes with a_j >= log tau; with none kept it is the NLL."""
    drafter = peaky(DBlastDrafter(CFG, 4, 4), 0.3, 4)
    torch.manual_seed(1)
    h = torch.randn(6, CFG.n_embd, dtype=torch.float64)
    bonus, x = torch.randint(V, (6,)), torch.randint(V, (6, 3))
    log_px = torch.full((6, 3), math.log(0.9), dtype=torch.float64)
    args = (h, bonus, target, x, log_px, 1.0)
    nll = drafter.loss(*args, kind='nll')
    assert torch.allclose(drafter.loss(*args, kind='al', tau_threshold=1.0 + 1e-9), nll)
    log_pi, log_qx = drafter.log_q(h, bonus, target, x, 1.0)
    a = DBlastDrafter.prefix_log_accept(log_pi, log_qx, log_px)
    t = torch.logcumsumexp(a.flip(-1), -1).flip(-1)
    assert torch.allclose(drafter.loss(*args, kind='al', tau_threshold=0.0), -t.mean(-1).mean())


# --------------------------------------------------------------------------- the paper's point

def phrase_corpus(n_seq, length, gen):
    """Filler, a marker, then one of four phrases sharing their first token and diverging after
    it (tokens: 0 marker, 1 shared first token, 2..13 phrase tokens, 14..15 filler)."""
    phrases = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 7], [1, 8, 9, 10], [1, 11, 12, 13]])
    unit = 7   # 2 filler + marker + 4-token phrase
    reps = length // unit + 1
    filler = torch.randint(14, 16, (n_seq, reps, 2), generator=gen)
    choice = phrases[torch.randint(4, (n_seq, reps), generator=gen)]
    seq = torch.cat([filler, torch.zeros(n_seq, reps, 1, dtype=torch.long), choice], dim=-1)
    return seq.view(n_seq, -1)[:, :length]


def test_dependent_drafter_beats_independent_on_multimodal_blocks():
    """After a marker the target picks one of four phrases. Drafted greedily, a K = 1 block
    drafter's per-position argmaxes mix the phrases; a K = 4 mixture gives each branch one phrase.
    Same data, same short training, measured tau of the step that drafts the phrase, T = 1."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = GPTConfig(block_size=64, vocab_size=16, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        x = phrase_corpus(32, 57, gen)
        loss = model(x[:, :-1], x[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    data = phrase_corpus(256, 57, gen)
    with torch.no_grad():
        H = model.hidden(data)
    k = 4
    taus = {}
    for K in (1, 4):
        torch.manual_seed(1)
        drafter = DBlastDrafter(cfg, k, K)
        opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
        for _ in range(150):
            r = torch.randint(256, (128,), generator=gen)
            t = torch.randint(0, 57 - k, (128,), generator=gen)
            x = data[r[:, None], t[:, None] + 2 + torch.arange(k - 1)]
            loss = drafter.loss(H[r, t], data[r, t + 1], model, x, None, kind='nll')
            opt.zero_grad()
            loss.backward()
            opt.step()
        drafter.eval()
        prompts = phrase_corpus(2000, 10, gen)[:, :3]        # filler, filler, marker
        _, stats = generate(model, prompts, k, drafter=drafter, temperature=1.0,
                            generator=torch.Generator().manual_seed(0))
        taus[K] = sum(stats['accept_lengths'][:2000]) / 2000
    # K = 4: 1 + 3 * 1/4 = 1.75 when each branch is a phrase; K = 1 mixes modes (about 1.3)
    assert taus[4] > taus[1] + 0.25, taus
