"""Lossless speculative sampling: for every proposal, the output follows the target's exact
distribution (chi-square over every 3-token continuation, at k = 4 and at k = 2, where a fully
accepted block's bonus is among the counted tokens), and the test catches broken verifiers.

The reference distribution is enumerated exactly in float64; decoding runs in float32, as it does
for real (a statistical test needs no float64: rounding moves p by 1e-7, far below what 30,000
samples resolve), which makes each case four times faster."""
import copy
import functools
import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F

import dblast
import runner
import verification
from conftest import V8, V8_PROMPT, peaky
from dblast import DBlastDrafter
from decode import generate
from heads import BlockHeads
from model import GPT, sample, tempered

V, CFG, PROMPT = V8.vocab_size, V8, V8_PROMPT   # the enumerable world (conftest)


@pytest.fixture(scope='module', autouse=True)
def two_threads():
    """Each case decodes 20,000 rows at once: big enough for a second thread to pay (the rest of
    the suite runs tiny ops on one, conftest)."""
    n = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope='module')
def target(v8_target):
    return copy.deepcopy(v8_target).float()


def make_drafter(spec, seed=1):
    """'heads-argmax' | 'heads-sampled' | 'K{K}-{greedy|sampled}-{mixture|branch}-zt{Z_T}', in float32."""
    return make_drafter64(spec, seed).float()


def make_drafter64(spec, seed):
    if spec.startswith('heads'):
        return peaky(BlockHeads(CFG, 4, sample_drafts=spec == 'heads-sampled'), 0.3, seed)
    K, branches, verify, zt = spec.split('-')
    d = peaky(DBlastDrafter(CFG, 4, int(K[1:]), sample_drafts=branches == 'sampled', verify=verify,
                            zt=float(zt[2:])), 0.3, seed)
    with torch.no_grad():    # sharper branches: the drafts say much about z, so a verifier that
        d.block.ln.weight.mul_(4.0)   # gets the posterior wrong is far from lossless
    return d


@functools.lru_cache
def continuation_probs(temperature, n=3):
    """Exact p_T(x_1..x_n | PROMPT) of the module's target for all V**n continuations. (V**n,)"""
    model = peaky(GPT(CFG), 0.3, 0)
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))
    full = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logp = F.log_softmax(model(full)[0] / temperature, dim=-1)
    T0 = PROMPT.size(1)
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


def spec_counts(model, drafter, temperature, n_rows, seed, m=3, compile=False, k=4):
    g = torch.Generator().manual_seed(seed)
    out, stats = generate(model, PROMPT.expand(n_rows, -1), m, drafter=drafter, k=k,
                          temperature=temperature, generator=g, compile=compile)
    codes = (out[:, PROMPT.size(1):] * torch.tensor([V ** (m - 1 - i) for i in range(m)])).sum(-1)
    return torch.bincount(codes, minlength=V ** m).double(), stats


N_ROWS = 20000   # the controls below show the test's power at this size


def chi2_of(model, drafter, temperature, n_rows=N_ROWS, seed=0, compile=False, k=4):
    counts, stats = spec_counts(model, drafter, temperature, n_rows, seed, compile=compile, k=k)
    return chi_square(counts, continuation_probs(temperature), n_rows) + (stats,)


# every kind of proposal, each at one of two temperatures: BPD heads drafting by argmax or by
# sampling; K = 1 (mixture and branch verification are the same there); K = 4 with greedy or
# sampled branches, verified against the mixture at Z_T below, at and above 1, or against the
# drawn branch alone
DRAFTERS = [('heads-argmax', 0.7), ('heads-sampled', 1.5), ('K1-greedy-mixture-zt1', 1.5),
            ('K1-sampled-branch-zt1', 0.7)]
DRAFTERS += [(f'K4-{b}-mixture-zt{zt}', T) for b in ('greedy', 'sampled') for zt, T in ((0.5, 0.7), (1, 1.5), (2, 0.7))]
DRAFTERS += [('K4-greedy-branch-zt1', 0.7), ('K4-sampled-branch-zt0.5', 1.5)]
# the quick tier keeps one drafter of each kind: argmax heads, sampled heads, the K = 4 mixture
QUICK = {('heads-argmax', 0.7), ('heads-sampled', 1.5), ('K4-sampled-mixture-zt1', 1.5)}
DRAFTERS = [c if c in QUICK else pytest.param(*c, marks=pytest.mark.slow) for c in DRAFTERS]


@pytest.mark.parametrize('spec,temperature', DRAFTERS)
def test_speculative_sampling_is_lossless(target, spec, temperature):
    """3-token continuations from speculative sampling follow the target's exact distribution, for
    every proposal: BPD heads (argmax or sampled drafts), DBlast K = 1 and K = 4 with greedy or
    sampled branches, verified against the mixture's conditionals or the drawn branch, any Z_T."""
    stat, crit, stats = chi2_of(target, make_drafter(spec), temperature)
    assert stat < crit, f"{spec} T={temperature}: chi2 {stat:.1f} >= {crit:.1f}"
    # and the drafts were really exercised: some accepted, some rejected
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 4).any()


# k = 2: three tokens over up to two steps, so the bonus after a fully accepted block (a sample of p
# after the last draft) is among the counted tokens; at k = 4 three tokens never reach it
K2 = [('K4-sampled-mixture-zt1', 0.7), ('heads-argmax', 0.7), ('K4-greedy-mixture-zt1', 0.7), ('heads-sampled', 1.5)]
K2 = [c if c == K2[0] else pytest.param(*c, marks=pytest.mark.slow) for c in K2]


@pytest.mark.parametrize('spec,temperature', K2)
def test_speculative_sampling_is_lossless_at_k2(target, spec, temperature):
    """3-token continuations at k = 2 follow the target's exact distribution, fully accepted blocks'
    bonuses included."""
    stat, crit, stats = chi2_of(target, make_drafter(spec), temperature, k=2)
    assert stat < crit, f"{spec} T={temperature} k=2: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus == 2).any() and (taus == 1).any()      # blocks fully accepted (their bonus counted), and not


def bonus_after_a_full_block_from_the_last_drafts_p(logits, Q, drafts, temperature, generator=None):
    """verification.verify_sampled with an off-by-one: after a fully accepted block the bonus is drawn from
    P_{k-2}, the distribution the last draft was tested against, instead of P_{k-1}."""
    p = F.softmax(tempered(logits, temperature), dim=-1)
    ok = verification.accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([verification.residual(p[:, :-1], Q, drafts), p[:, -2:-1]], dim=1)
    return verification.accept_prefix(ok, sample(weights, generator))


def test_chi_square_at_k2_catches_a_full_blocks_bonus_drawn_from_the_wrong_p(target, monkeypatch):
    """The bonus after a fully accepted block drawn from the wrong position's p: at k = 4 the three
    counted tokens never include it (the same seed gives the same tokens with and without the bug),
    at k = 2 the test catches it. It measures 872 to 1023 over six seeds against a critical value
    of 524 (the lossless run: 412 to 462)."""
    d = make_drafter('K4-sampled-mixture-zt1')
    runs = [generate(target, PROMPT.expand(500, -1), 3, drafter=d, k=4, temperature=0.7,
                     generator=torch.Generator().manual_seed(1))[0]]
    monkeypatch.setattr(verification, 'verify_sampled', bonus_after_a_full_block_from_the_last_drafts_p)
    runs.append(generate(target, PROMPT.expand(500, -1), 3, drafter=d, k=4, temperature=0.7,
                         generator=torch.Generator().manual_seed(1))[0])
    assert torch.equal(*runs)
    stat, crit, _ = chi2_of(target, d, 0.7, k=2)
    assert stat > crit, f"full block's bonus from the wrong p passed at k=2: chi2 {stat:.1f} < {crit:.1f}"


@pytest.fixture
def units_as_python(monkeypatch):
    """generate(compile=True) through runner.py's units of steps, its static buffers and its global
    RNG seeded from the generator, with the units run as Python (no tracing, no compile)."""
    monkeypatch.setattr(runner, 'compiled', lambda fn, *how, **options: fn)


@pytest.mark.parametrize('spec,temperature', [('heads-sampled', 1.5), ('K4-sampled-mixture-zt1', 1.5)])
def test_units_of_several_steps_are_lossless(target, spec, temperature, units_as_python):
    """The compiled loop's units (4 steps a host call on a CPU: for 3 tokens at k = 4 every unit
    runs past the last step a row needs) give the target's exact distribution, and the same broken
    verifier as below is caught through them."""
    stat, crit, stats = chi2_of(target, make_drafter(spec), temperature, compile=True)
    assert stat < crit, f"{spec} T={temperature} in units: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 4).any()


def test_chi_square_catches_a_broken_verifier_in_units(target, units_as_python, monkeypatch):
    monkeypatch.setattr(verification, 'residual', lambda p, q, drafts: p)
    stat, crit, _ = chi2_of(target, make_drafter('heads-sampled'), 1.5, n_rows=N_ROWS // 4, compile=True)
    assert stat > crit, f"broken verifier passed in units: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.parametrize('spec', ['heads-sampled', pytest.param('K4-sampled-mixture-zt1', marks=pytest.mark.slow)])
def test_chi_square_catches_a_broken_verifier(target, spec, monkeypatch):
    """The same test rejects a verifier that draws the bonus from p instead of the residual. A bug
    this large needs a quarter of the rows: at 5000 it measures 899 (heads) and 779 (K = 4) against
    a critical value of 503, more than 5 standard deviations of its statistic (tests/test_paths.py
    has the calculation); the weaker controls below run at the full N_ROWS."""
    monkeypatch.setattr(verification, 'residual', lambda p, q, drafts: p)
    stat, crit, _ = chi2_of(target, make_drafter(spec), 1.5, n_rows=N_ROWS // 4)
    assert stat > crit, f"broken verifier passed: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.slow
@pytest.mark.parametrize('branches', ['greedy', 'sampled'])
def test_chi_square_catches_a_posterior_not_conditioned_on_the_drafts(target, branches, monkeypatch):
    """A mixture verifier that weighs the branches by the prior pi' at every position, instead of
    by their posterior given the drafts before it, is not lossless: the test catches it."""
    monkeypatch.setattr(dblast, 'posterior', lambda log_prior, log_qd: F.log_softmax(
        log_prior, -1).unsqueeze(1).expand(-1, log_qd.size(-1), -1))
    stat, crit, _ = chi2_of(target, make_drafter(f'K4-{branches}-mixture-zt1', seed=2), 0.7)
    assert stat > crit, f"unconditioned posterior passed: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.slow
@pytest.mark.parametrize('zt', [0.5, 2.0])
def test_chi_square_catches_q_built_from_pi_while_z_came_from_pi_prime(target, zt, monkeypatch):
    """z drawn from pi' = softmax(log pi / Z_T), but Q weighted by pi: with Z_T != 1 that is
    another proposal than the one the drafts came from, and the output is biased. (The posterior
    is invariant to a constant shift, so log pi' * Z_T weighs the branches exactly as pi does.)"""
    real = dblast.posterior
    monkeypatch.setattr(dblast, 'posterior', lambda log_prior, log_qd: real(log_prior * zt, log_qd))
    stat, crit, _ = chi2_of(target, make_drafter(f'K4-sampled-mixture-zt{zt}', seed=2), 0.7)
    assert stat > crit, f"Q from pi passed: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.slow
def test_q_must_be_the_drafts_own_distribution(target, monkeypatch):
    """Drafts sampled from q at T = 1.5 but verified with q at T = 1 (temperature applied to p and
    the sampling, not to the q handed to the verifier) bias the output: the test catches it."""
    drafter = make_drafter('heads-sampled')
    real_draft = drafter.draft

    def draft_with_q_at_t1(h, bonus, tgt, k, temperature, generator):
        d, q = real_draft(h, bonus, tgt, k, temperature, generator)
        return d, F.softmax(q.log() * temperature, dim=-1)     # q re-tempered to T = 1
    monkeypatch.setattr(drafter, 'draft', draft_with_q_at_t1)
    stat, crit, _ = chi2_of(target, drafter, 1.5)
    assert stat > crit


def test_residual_never_divides_by_zero():
    """p == q everywhere: the residual is all zero, so the bonus falls back to p (finite, valid)."""
    p = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]], dtype=torch.float64)
    r = verification.residual(p, p.clone(), torch.tensor([[0]]))
    assert torch.equal(r, p)
    point = verification.residual(torch.tensor([[[1.0, 0.0, 0.0, 0.0]]]), None, torch.tensor([[0]]))
    assert torch.isfinite(point).all() and point.sum() > 0
    idx = sample(torch.tensor([[0.0, 3.0, 1.0]]), torch.Generator().manual_seed(0))
    assert idx.item() in (1, 2)


def test_a_draw_of_zero_never_lands_on_a_token_without_weight(monkeypatch):
    """model.sample by inverse CDF: a uniform draw of exactly 0 (float32 draws one in 2^24) lands on
    the first token with weight, not on a leading token of none, such as the rejected draft at token
    0 in a point mass's residual."""
    monkeypatch.setattr(torch, 'rand', lambda shape, **kw: torch.zeros(shape, dtype=kw.get('dtype'),
                                                                       device=kw.get('device')))
    assert sample(torch.tensor([[0.0, 0.0, 3.0, 1.0]])).tolist() == [2]
    p = torch.tensor([[[0.5, 0.25, 0.25]]], dtype=torch.float64)
    assert sample(verification.residual(p, None, torch.tensor([[0]]))).tolist() == [[1]]


def test_a_point_mass_as_a_one_hot_row_is_q_none():
    """MATH.md §11: a path of point-mass drafts verified beside sampled ones carries its Q as one-hot
    rows, which must be the same test and the same residual as Q = None: the same coins accept the
    same drafts, and the residual is p without the draft's mass, bit for bit in float64."""
    g = torch.Generator().manual_seed(0)
    p = F.softmax(torch.randn(64, 3, V, generator=g, dtype=torch.float64) * 2, dim=-1)
    drafts = torch.randint(V, (64, 3), generator=g)
    one_hot = F.one_hot(drafts, V).double()
    ok = [verification.accept_sampled(p, Q, drafts, torch.Generator().manual_seed(1)) for Q in (one_hot, None)]
    assert torch.equal(*ok) and ok[0].any() and not ok[0].all()
    assert torch.equal(verification.residual(p, one_hot, drafts), verification.residual(p, None, drafts))


def test_sampling_reproducible_with_generator(target):
    d = make_drafter('K4-sampled-mixture-zt1')
    runs = [generate(target, PROMPT.expand(16, -1), 12, drafter=d, temperature=1.0,
                     generator=torch.Generator().manual_seed(s))[0] for s in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


# ----------------------------------------------------------------------------- at a reduced compute dtype
# Under bf16 autocast the target and drafters compute in bf16, but what sampling decides with must
# stay float32: p, every Q, the residual and the coins. An einsum of the mixture's conditionals
# came back in bf16 (rows summing to 1 +- 0.004), so acceptance used a Q the drafts never came from.

RAND = torch.rand   # the real one, for the test that watches every draw
BF16_DRAFTERS = ['heads-sampled', 'K1-sampled-mixture-zt1', 'K4-sampled-mixture-zt1', 'K4-sampled-branch-zt1',
                 'K4-greedy-mixture-zt1']


@pytest.mark.parametrize('spec', BF16_DRAFTERS)
def test_sampling_decides_in_float32_under_bf16_autocast(target, spec, monkeypatch):
    """Every Q a drafter returns (one path or several) is float32 with rows summing to 1, and the
    verifier's p, Q, residual and coins are float32, while the networks run in bf16."""
    d = make_drafter(spec)
    h, bonus = torch.randn(64, V8.n_embd), torch.randint(V, (64,))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        for _, Q in (d.draft(h, bonus, target, 4, 1.3), d.draft_paths(h, bonus, target, 4, 3, 1.3)):
            assert Q.dtype == torch.float32 and (Q.sum(-1) - 1).abs().max() < 1e-5, (Q.dtype, Q.sum(-1))
        seen = []
        real_accept, real_residual = verification.accept_sampled, verification.residual
        monkeypatch.setattr(verification, 'accept_sampled', lambda p, q, *a: seen.append((p.dtype, q.dtype)) or
                            real_accept(p, q, *a))
        monkeypatch.setattr(verification, 'residual', lambda *a: seen.append((real_residual(*a).dtype,)) or
                            real_residual(*a))
        monkeypatch.setattr(torch, 'rand', lambda *a, **kw: seen.append((kw.get('dtype'),)) or RAND(*a, **kw))
        for paths in (1, 3):
            generate(target, PROMPT.expand(4, -1), 6, drafter=d, k=4, temperature=1.3, paths=paths)
    assert seen and all(t == torch.float32 for s in seen for t in s), set(seen)


@pytest.mark.slow
@pytest.mark.parametrize('spec', BF16_DRAFTERS[:4])
def test_speculative_sampling_is_lossless_with_bf16_drafters(target, spec):
    """Drafters under bf16 autocast (the target in float32, so that the reference is exact): the
    output is still the target's distribution, for the heads, K = 1, and K = 4 with mixture or
    branch verification."""
    d = make_drafter(spec)
    real = d.draft

    def bf16_draft(*a, **kw):
        with torch.autocast('cpu', dtype=torch.bfloat16):
            return real(*a, **kw)
    d.draft = bf16_draft
    stat, crit, _ = chi2_of(target, d, 1.5)
    assert stat < crit, f"{spec} in bf16: chi2 {stat:.1f} >= {crit:.1f}"
