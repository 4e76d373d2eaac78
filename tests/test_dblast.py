"""dblast.py: the mixture proposal, its conditionals and posterior, the losses, the exact
expected-acceptance evaluator, and the paper's point on a multimodal toy task.

Losslessness of every proposal under verification is tested by chi-square in test_sampling.py."""
import copy
import itertools
import math
import types

import pytest
import torch
import torch.nn.functional as F

import dblast
import train
from conftest import V8, V8_PROMPT, peaky
from dblast import (DBlastDrafter, TargetSamples, al_surrogate, contexts, expected_accepted, log_conditionals, posterior,
                    prefix_log_accept, prior)
from data import PROMPT_LEN
from decode import generate
from exercises import harness
from heads import BlockHeads
from model import GPT, GPTConfig, tempered

V, CFG, PROMPT = V8.vocab_size, V8, V8_PROMPT   # the enumerable world (conftest)


@pytest.fixture(scope='module')
def target(v8_target):
    return v8_target


def drafter_of(K, branches='sampled', verify='mixture', seed=2, k=4, zt=1.0):
    """branches: 'sampled' or 'greedy' (sample_drafts True or False)."""
    return peaky(DBlastDrafter(CFG, k, K, sample_drafts=branches == 'sampled', verify=verify, zt=zt), 0.3, seed)


@torch.no_grad()
def enumerate_blocks(model, n, temperature):
    """Every (bonus, x_1..x_n) after PROMPT: the target's log p of each token (N, n+1), its hidden
    state at the bonus's position h (N, C), the bonus (N,) and x (N, n). exp(lp.sum(-1)) sums to 1."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n + 1)))
    full = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    T0 = PROMPT.size(1)
    h = model.hidden(full)
    logp = F.log_softmax(model.lm_head(h) / temperature, dim=-1)
    lp = logp[:, T0 - 1:-1].gather(-1, seqs.unsqueeze(-1)).squeeze(-1)
    return lp, h[:, T0 - 1], seqs[:, 0], seqs[:, 1:]


def first_step_accepted(model, drafter, temperature, n, seed=0):
    """Accepted drafts of every row's first decoding step (mean, standard error), decoded in float32
    as for real: a Monte Carlo estimate needs no float64 (what it is compared with is exact)."""
    model, drafter = copy.deepcopy(model).float(), copy.deepcopy(drafter).float()
    _, stats = generate(model, PROMPT.expand(n, -1), 4, drafter=drafter, temperature=temperature,
                        generator=torch.Generator().manual_seed(seed))
    first = torch.tensor(stats['accept_lengths'][:n], dtype=torch.float64) - 1  # step 1 of each row
    return first.mean().item(), first.std().item() / math.sqrt(n)


# --------------------------------------------------------------------------- the AL identity

@pytest.mark.slow
@pytest.mark.parametrize('K,branches,verify,zt', [(1, 'sampled', 'mixture', 1.0), (4, 'sampled', 'mixture', 1.0),
                                                  (4, 'sampled', 'branch', 1.0), (4, 'greedy', 'mixture', 0.5),
                                                  (4, 'greedy', 'branch', 0.5), (4, 'sampled', 'mixture', 0.0)])
def test_expected_accepted_matches_decoding(target, K, branches, verify, zt):
    """E_{x~p}[sum_j exp(a_j)], computed exactly over every block, equals the accepted drafts the
    decoder measures (MATH.md §7: for sampled or greedy branches, mixture or branch verification,
    and any Z_T). For sampled branches at Z_T = 1 a_j is the AL loss's own (log_q, mixture or branch
    form); otherwise it is the evaluator's (one-hot q~ for greedy branches). At Z_T != 1 the
    evaluator must weigh the branches by pi', as drafting does; at Z_T = 0 by the argmax branch
    alone (an evaluator that took Z_T = 1 or 0.5 there would be 12 and 9 standard errors off)."""
    T = 1.0
    d = drafter_of(K, branches, verify, zt=zt)
    lp, h, bonus, x = enumerate_blocks(target, 3, T)
    per_block = expected_accepted(d, h, bonus, target, x, lp[:, 1:], T, branches == 'sampled', verify, zt)
    if branches == 'sampled' and zt == 1.0:   # the loss's view (Z_T = 1) gives the same numbers
        log_pi, log_qx = d.log_q(h, bonus, target, x, T)
        a = prefix_log_accept(log_pi, log_qx, lp[:, 1:], verify)
        assert torch.allclose(a.exp().sum(-1), per_block, atol=1e-12)
    expected = (lp.sum(-1).exp() * per_block).sum().item()
    mean, se = first_step_accepted(target, d, T, 20000)
    assert abs(mean - expected) < 4 * se, (mean, expected, se)
    assert 0.1 < expected < 2.8   # non-trivial: neither all rejected nor all accepted


def test_expected_accepted_for_bpd_heads_matches_decoding(target):
    """The evaluator takes BPD heads as a one-branch mixture (sampled drafts)."""
    heads = peaky(BlockHeads(CFG, 4), 0.3, 1)
    lp, h, bonus, x = enumerate_blocks(target, 3, 1.0)
    expected = (lp.sum(-1).exp() * expected_accepted(heads, h, bonus, target, x, lp[:, 1:], 1.0,
                                                     True, 'mixture')).sum().item()
    mean, se = first_step_accepted(target, heads, 1.0, 20000)
    assert abs(mean - expected) < 4 * se, (mean, expected, se)


@pytest.mark.parametrize('branches', ['greedy', 'sampled'])
@pytest.mark.parametrize('seed', range(4))
def test_mixture_accepts_the_first_draft_at_least_as_often_as_branch(target, branches, seed):
    """At the first draft, E_z min(p, q_z) <= min(p, E_z q_z): mixture verification is never worse
    than branch-conditional, context by context (exact, over every bonus and draft). Both are checked
    against the direct formulas, and the mixture is strictly better somewhere. At T = 1.5: the
    evaluator scores q at the temperature, as drafting draws it."""
    T, zt = 1.5, 1.5
    d = drafter_of(4, branches, seed=seed, zt=zt)
    lp, h, bonus, x = enumerate_blocks(target, 1, T)         # (V*V) rows: bonus, x_1
    p_x = lp[:, 1].exp()
    acc = {v: p_x * expected_accepted(d, h, bonus, target, x, lp[:, 1:], T, branches == 'sampled', v, zt)
           for v in ('mixture', 'branch')}
    acc = {v: a.view(V, V).sum(-1) for v, a in acc.items()}  # per bonus: P(first draft accepted)
    # direct: p (V, V) and each branch's q~_1 (V, K, V) at each bonus
    with torch.no_grad():
        log_pi, logits = d.mixture_logits(h.view(V, V, -1)[:, 0], bonus.view(V, V)[:, 0], target, 2)
    q = F.softmax(logits[:, :, 0] / T, -1) if branches == 'sampled' else \
        F.one_hot(logits[:, :, 0].argmax(-1), V).double()
    w = prior(log_pi, zt).exp()                               # (V, K)
    p = p_x.view(V, V)
    mix = torch.minimum(p, (w[:, :, None] * q).sum(1)).sum(-1)
    br = (w * torch.minimum(p[:, None], q).sum(-1)).sum(-1)
    assert torch.allclose(acc['mixture'], mix, atol=1e-12) and torch.allclose(acc['branch'], br, atol=1e-12)
    assert (mix >= br - 1e-12).all() and (mix > br + 1e-3).any()


# --------------------------------------------------------------------------- the proposal

@pytest.mark.parametrize('branches', ['greedy', 'sampled'])
def test_proposal_conditionals_are_distributions_that_cover_the_drafts(target, branches):
    torch.manual_seed(0)
    d = drafter_of(4, branches, zt=0.7)
    h = torch.randn(50, CFG.n_embd, dtype=torch.float64)
    drafts, Q = d.draft(h, torch.randint(V, (50,)), target, 4, 1.3, torch.Generator().manual_seed(1))
    assert Q.shape == (50, 3, V)
    assert torch.allclose(Q.sum(-1), torch.ones(50, 3, dtype=Q.dtype), atol=1e-12)
    assert (Q.gather(-1, drafts.unsqueeze(-1)) > 0).all()      # the drafts came from Q


def test_greedy_branches_with_one_branch_or_zt_zero_are_point_masses(target):
    """K = 1, or Z_T = 0 (the argmax branch), or a branch verified alone: the proposal is one
    deterministic path, and the contract says so one way, Q = None. K = 4 greedy branches verified
    against the mixture are not: Q is their mixture, dense."""
    torch.manual_seed(0)
    h, b = torch.randn(20, CFG.n_embd, dtype=torch.float64), torch.randint(V, (20,))
    for d in (drafter_of(1, 'greedy'), drafter_of(4, 'greedy', zt=0.0), drafter_of(4, 'greedy', verify='branch')):
        drafts, Q = d.draft(h, b, target, 4, 1.0)
        assert Q is None and drafts.shape == (20, 3)
    drafts, Q = drafter_of(4, 'greedy').draft(h, b, target, 4, 1.0)
    assert Q.shape == (20, 3, V) and torch.allclose(Q.sum(-1), torch.ones(20, 3, dtype=torch.float64))


def test_conditionals_keep_float32_under_autocast_and_call_no_matrix_product():
    """Q is what verification tests the drafts against, so it keeps float32's precision whatever the
    settings: under bf16 autocast (float32 log q~, as generate's --dtype bfloat16 passes them) it
    matches float64 within 1e-6, and it is a product and a sum over the branches, no matrix product,
    which autocast would run in bf16 and CUDA's TF32 (--tf32) with 10-bit factors."""
    torch.manual_seed(0)
    B, K, n = 3, 4, 5
    log_q = F.log_softmax(torch.randn(B, K, n, 64) * 3, -1)
    log_prior, drafts = F.log_softmax(torch.randn(B, K), -1), torch.randint(64, (B, n))
    ref = dblast.conditionals(log_prior.double(), log_q.double(), drafts)
    with torch.autocast('cpu', dtype=torch.bfloat16), harness.OpCount() as seen:
        Q = dblast.conditionals(log_prior, log_q, drafts)
    assert Q.dtype == torch.float32 and (Q.double() - ref).abs().max() < 1e-6
    products = {'mm', 'bmm', 'addmm', 'baddbmm', 'matmul', 'mv', 'dot', 'linear'}
    assert seen.ops and not products & set(seen.ops), sorted(products & set(seen.ops))


def test_posterior_is_computed_in_log_space():
    """Over a long block the branches' draft probabilities underflow as products (float32 at
    e^-104), not as sums of logs: the posterior stays finite and exact."""
    n = 400
    log_qd = torch.stack([torch.full((n,), -5.0), torch.full((n,), -5.05)])[None]   # (1, K=2, n)
    w = posterior(torch.zeros(1, 2), log_qd).exp()                                   # (1, n, 2)
    assert torch.isfinite(w).all() and torch.allclose(w.sum(-1), torch.ones(1, n))
    i = torch.arange(n, dtype=torch.float32)
    assert torch.allclose(w[0, :, 1] / w[0, :, 0], torch.exp(-0.05 * i), rtol=1e-4)   # prefix l < i only


def test_log_conditionals_of_an_impossible_prefix_are_minus_inf_not_nan():
    """Greedy branches give a target sample off every path probability 0: -inf from there on."""
    log_qx = torch.tensor([[[0.0, -math.inf, 0.0], [-math.inf, 0.0, 0.0]]])   # (1, K=2, n=3)
    lq = log_conditionals(torch.log(torch.tensor([[0.5, 0.5]])), log_qx)
    assert lq[0, 0] == pytest.approx(math.log(0.5)) and (lq[0, 1:] == -math.inf).all()
    a = prefix_log_accept(torch.zeros(1, 2).log_softmax(-1), log_qx, torch.full((1, 3), -1.0))
    assert a[0, 0] == 0.0 and (a[0, 1:] == -math.inf).all()   # Q_1 = 0.5 > p_1 = e^-1: accepted


# --------------------------------------------------------------------------- the losses

def test_mixture_nll_k1_is_sum_of_cross_entropies(target):
    drafter = peaky(DBlastDrafter(CFG, 4, 1), 0.3, 3)
    torch.manual_seed(0)
    h = torch.randn(5, CFG.n_embd, dtype=torch.float64)
    bonus, x = torch.randint(V, (5,)), torch.randint(V, (5, 3))
    log_pi, log_qx = drafter.log_q(h, bonus, target, x, temperature=0.7)
    _, logits = drafter.mixture_logits(h, bonus, target, 4)
    ce = F.cross_entropy(logits[:, 0].flatten(0, 1) / 0.7, x.flatten(), reduction='none').view(5, 3).sum(-1)
    assert torch.allclose(DBlastDrafter.nll(log_pi, log_qx), ce, atol=1e-12)


@pytest.mark.parametrize('kind,verify', [('al', 'mixture'), ('al-branch', 'branch')])
def test_al_loss_threshold_and_fallback(target, kind, verify):
    """The AL loss keeps only prefixes with a_j >= log eta (eta = tau_threshold); with none kept it is the NLL; 'al' is
    built on the mixture's conditionals, 'al-branch' on branch-conditional acceptance."""
    drafter = peaky(DBlastDrafter(CFG, 4, 4), 0.3, 4)
    torch.manual_seed(1)
    h = torch.randn(6, CFG.n_embd, dtype=torch.float64)
    bonus, x = torch.randint(V, (6,)), torch.randint(V, (6, 3))
    log_px = torch.empty(6, 3, dtype=torch.float64).uniform_(0.01, 0.9).log()   # some q above p
    args = (h, bonus, target, x, log_px, 1.0)
    nll = drafter.loss(*args, kind='nll')
    assert torch.allclose(drafter.loss(*args, kind=kind, tau_threshold=1.0 + 1e-9), nll)
    log_pi, log_qx = drafter.log_q(h, bonus, target, x, 1.0)
    a = prefix_log_accept(log_pi, log_qx, log_px, verify)
    t = torch.logcumsumexp(a.flip(-1), -1).flip(-1)
    assert torch.allclose(drafter.loss(*args, kind=kind, tau_threshold=0.0), -t.mean(-1).mean())
    assert torch.allclose(drafter.loss(*args, kind=kind, tau_threshold=0.0, nll_weight=0.5),
                          -t.mean(-1).mean() + 0.5 * nll)
    # a threshold between the prefixes' weights: every row keeps its first prefix (a_j falls with j),
    # some keep more, some not all; each row's loss is minus the mean of its kept tails
    log_eta = a.detach()[:, 0].min() - 1e-9
    keep = a >= log_eta
    assert keep.sum() > len(keep) and not keep.all()
    want = (-(t * keep).sum(-1) / keep.sum(-1)).mean()
    assert torch.allclose(drafter.loss(*args, kind=kind, tau_threshold=float(log_eta.exp())), want)
    other = prefix_log_accept(log_pi, log_qx, log_px, 'branch' if verify == 'mixture' else 'mixture')
    assert not torch.allclose(a, other)     # the two forms really differ for K > 1


def test_al_surrogate_gradient_reaches_past_R_but_not_past_the_clamp():
    """R = {1}, yet the tail lambda_1 = logsumexp_{j >= 1} a_j sums over every later prefix: log q at the
    positions after R gets gradient through it (MATH.md §6 says so); where q_i(x_i) >= p_i(x_i) the
    clamp in a_j stops it. Exercise 6's check, run on the project's own functions (it stays here
    for a handout without exercises/solutions/)."""
    project = types.SimpleNamespace(prefix_log_accept=prefix_log_accept, al_surrogate=al_surrogate)
    harness.checks_of(6).test_gradient_reaches_past_R(project)


def test_al_gradient_at_a_clamped_position_with_two_branches():
    """K = 2, the first position clamped (Q_1(x_1) >= p_1(x_1)): its own term min(0, .) has no
    gradient, but every later log Q_i weighs the branches by their posterior given x_1, so the
    branches' log q_1(x_1 | z) still get gradient there, through the later, unclamped positions.
    The gradient over the branches sums to zero (adding a constant to every branch's log q_1 moves
    no posterior). With K = 1 the posterior is constant: no gradient at a clamped position at all."""
    log_px = torch.log(torch.tensor([[0.05, 0.6, 0.6]], dtype=torch.float64))      # position 1: p tiny
    for K, log_prior in ((2, torch.log(torch.tensor([[0.3, 0.7]], dtype=torch.float64))),
                         (1, torch.zeros(1, 1, dtype=torch.float64))):
        log_qx = torch.log(torch.tensor([[[0.5, 0.2, 0.5], [0.3, 0.4, 0.1]][:K]], dtype=torch.float64))
        log_qx.requires_grad_(True)
        a = prefix_log_accept(log_prior, log_qx, log_px, 'mixture')
        assert (log_conditionals(log_prior, log_qx)[:, 0] >= log_px[:, 0]).all()      # clamped at position 1
        assert (log_conditionals(log_prior, log_qx)[:, 1:] < log_px[:, 1:]).all()     # not after it
        al_surrogate(a, torch.zeros(1, dtype=torch.float64), 0.0).sum().backward()
        at_first = log_qx.grad[0, :, 0]
        if K == 2:
            assert (at_first.abs() > 1e-3).all() and abs(float(at_first.sum())) < 1e-12, at_first
        else:
            assert float(at_first.abs().max()) == 0.0, at_first


def test_the_later_terms_gradient_moves_the_clamped_positions_own_Q():
    """MATH.md §6's example, K = 2: the gradient of log Q_2(x_2) with respect to the branches'
    log q_1(x_1 | z) is w_3 - w_2, which sums to zero over the branches, and it still moves
    log Q_1(x_1) itself (whose gradient is w_2): along it, at the rate w_2 . (w_3 - w_2) = -0.295."""
    log_prior = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    log_qx = torch.log(torch.tensor([[[0.8, 0.1], [0.2, 0.9]]], dtype=torch.float64)).requires_grad_(True)
    log_Q = log_conditionals(log_prior, log_qx)                                     # (1, 2)
    g2 = torch.autograd.grad(log_Q[0, 1], log_qx, retain_graph=True)[0][0, :, 0]   # d log Q_2 / d log q_1(x_1|z)
    g1 = torch.autograd.grad(log_Q[0, 0], log_qx)[0][0, :, 0]                      # d log Q_1 / d log q_1(x_1|z)
    w2 = torch.tensor([0.8, 0.2], dtype=torch.float64)
    w3 = torch.tensor([0.08, 0.18], dtype=torch.float64) / 0.26
    torch.testing.assert_close(g1, w2)
    torch.testing.assert_close(g2, w3 - w2)
    assert abs(float(g2.sum())) < 1e-12
    assert abs(float(g1 @ g2) - (-0.2954)) < 5e-4, float(g1 @ g2)


def test_evaluator_and_decoding_part_where_acceptance_varies_along_the_text():
    """MATH.md §7's caveat, worked out (a claim about counting: this pins MATH.md's arithmetic, and no
    project code runs): tau k in half the contexts and 1 in the other half. The
    evaluator weighs every context: (k+1)/2. A decode starts its blocks where the last one ended:
    in runs much longer than k it reports about 2k/(k+1); interleaved finely (every other
    position), where its blocks land decides, here k for an even k."""
    k, L = 4, 100_000

    def decoded_tau(good):
        t = steps = 0
        while t < L:
            t += k if good(t) else 1
            steps += 1
        return L / steps

    for good in (lambda t: (t // 1000) % 2 == 0, lambda t: t % 2 == 0):
        assert abs(sum(k if good(t) else 1 for t in range(L)) / L - (k + 1) / 2) < 1e-9
    assert abs(decoded_tau(lambda t: (t // 1000) % 2 == 0) - 2 * k / (k + 1)) < 0.01
    assert decoded_tau(lambda t: t % 2 == 0) == k


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


@pytest.mark.slow
def test_dependent_drafter_splits_the_modes_of_a_multimodal_block():
    """After a marker the target picks one of four phrases. Trained by train.py's default DBlast
    loss on the target's own samples, the K = 4 drafter gives each branch one phrase, and with
    mixture verification it beats K = 1 trained the same way, greedy and sampled branches (tau of
    the step that drafts the phrase, T = 1). Ideal, greedy: 4.0 for K = 4, 1.75 for K = 1 (one phrase).
    With GPT-2's 0.02 init of the expander the K = 4 branches settle on fewer than four phrases."""
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
    args = train.parse_args(['--device', 'cpu', '--temperature', '1.0'])   # the default loss and its settings
    rt = types.SimpleNamespace(device='cpu', kind='cpu', master=True)
    text = phrase_corpus(1, 20000, gen)[0].numpy().astype('uint8')
    data = train.dblast_data(rt, model, text, 256, args.temperature, 0, 'samples')
    k = 4
    lo, hi = data.positions(k)
    marker = phrase_corpus(1, 10, gen)[:, :3]                    # filler, filler, marker
    phrases = {(2, 3, 4), (5, 6, 7), (8, 9, 10), (11, 12, 13)}
    taus = {}
    for K in (1, 4):
        torch.manual_seed(1)
        drafter = DBlastDrafter(cfg, k, K)
        objective = train.DBlastObjective(model, drafter, args, args.dblast_loss)
        opt = torch.optim.AdamW(drafter.parameters(), lr=args.dblast_lr)
        for _ in range(300):
            rows = torch.randint(len(data.seqs), (128,), generator=gen)
            pos = torch.randint(lo, hi, (128,), generator=gen)
            loss = objective(*contexts(data, k, rows, pos))
            opt.zero_grad()
            loss.backward()
            opt.step()
        drafter.eval()
        if K == 4:   # the branches at the marker, bonus = the phrases' shared first token
            h = model.hidden(marker)[:, -1]
            _, logits = drafter.mixture_logits(h, torch.tensor([1]), model, k)
            assert {tuple(p) for p in logits[0].argmax(-1).tolist()} == phrases
        for branches in ('greedy', 'sampled'):
            drafter.sample_drafts = branches == 'sampled'
            _, stats = generate(model, marker.expand(2000, -1), k, drafter=drafter, temperature=1.0,
                                generator=torch.Generator().manual_seed(0))
            taus[K, branches] = sum(stats['accept_lengths'][:2000]) / 2000
    assert taus[4, 'greedy'] > taus[1, 'greedy'] + 1.5, taus
    assert taus[4, 'sampled'] > taus[1, 'sampled'] + 0.3, taus


# --------------------------------------------------------------------------- the target's samples

class Entered:
    """A reusable context manager (as torch.autocast is) that counts its entries."""
    n = 0

    def __enter__(self):
        self.n += 1

    def __exit__(self, *exc):
        return False


def test_target_samples_chunked_within_the_budget(monkeypatch):
    """TargetSamples.of with chunk=None takes as many rows as the logits budget allows (1 or 2 here)
    and equals one chunk; LP is the tempered log-softmax read at the sampled token (computed as the
    logit minus the logsumexp: no second (rows, S, V) tensor) and H the target's final hidden
    states, both float32; the target runs under `precision`, entered once per chunk."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=1, n_head=2, n_embd=16)).double().eval()
    n, S, T = 5, 32, 0.7
    seqs = torch.randint(50, (n, S), generator=torch.Generator().manual_seed(1))
    one = TargetSamples.of(model, seqs, T, chunk=n)
    with torch.no_grad():
        h = model.hidden(seqs)
        logp = F.log_softmax(tempered(model.lm_head(h).float(), T), -1)   # (n, S, V) at once
    assert one.H.dtype == one.LP.dtype == torch.float32
    assert one.H.shape == (n, S, 16) and one.LP.shape == (n, S - 1)
    torch.testing.assert_close(one.H, h.float(), rtol=0, atol=0)
    torch.testing.assert_close(one.LP, logp[:, :-1].gather(-1, seqs[:, 1:, None]).squeeze(-1))
    for rows in (1, 2):
        monkeypatch.setattr(dblast, 'LOGITS_BUDGET', (rows + 1) * S * 50 - 1)   # just under rows + 1
        precision = Entered()
        chunked = TargetSamples.of(model, seqs, T, precision)
        assert precision.n == math.ceil(n / rows)
        torch.testing.assert_close(chunked, one)


# ----------------------------------------------------------------------------- MATH.md's equations, written out

def test_dblast_anchor_expander_and_branches_are_math_md_s5_equations():
    """§5: u = LN(W_u [h; e(b)]), log pi = log_softmax(W_pi u), u_z = u + g_z(u) with
    g(u) = W_g2 relu(W_g1 u) reshaped into K offsets, q_i(.|z) = softmax(BlockHeads(u_z)_i / T)."""
    target = peaky(GPT(V8), 0.3, 0)
    d = peaky(dblast.DBlastDrafter(V8, 4, 3), 0.3, 1)
    g = torch.Generator().manual_seed(0)
    h, b = torch.randn(5, V8.n_embd, generator=g, dtype=torch.float64), torch.randint(8, (5,), generator=g)
    with torch.no_grad():
        u = d.ln_u(torch.cat([h, target.transformer.wte(b)], -1) @ d.w_u.weight.T + d.w_u.bias)
        log_pi = F.log_softmax(u @ d.w_pi.weight.T + d.w_pi.bias, -1)
        g_u = F.relu(u @ d.g_fc.weight.T + d.g_fc.bias) @ d.g_proj.weight.T + d.g_proj.bias
        u_z = u[:, None] + g_u.view(5, 3, V8.n_embd)
        got_pi, got_uz = d.anchor(h, b, target)
        torch.testing.assert_close(got_pi, log_pi, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_uz, u_z, rtol=0, atol=1e-12)
        _, logits = d.mixture_logits(h, b, target, 4)                        # (5, K, 3, V)
        torch.testing.assert_close(logits, d.block(u_z, target.lm_head, 3), rtol=0, atol=1e-12)
        T = 0.7
        x = torch.randint(8, (5, 3), generator=g)
        want = F.log_softmax(logits / T, -1).gather(-1, x[:, None, :, None].expand(5, 3, 3, 1)).squeeze(-1)
        torch.testing.assert_close(dblast.branch_log_q(logits, x, T, True), want, rtol=0, atol=1e-12)


def test_math_md_s5_example_branch_half_mixture_one():
    """§5's example: greedy branches, pi' = (1/2, 1/2), first tokens a != b, p(a) = p(b) = 1/2:
    branch-conditional verification accepts the first draft w.p. 1/2, the mixture w.p. 1 (exact, by
    the identity E_{x~p} exp(a_1), and directly by sum_v min(p, Q_1) with Q_1 from dblast.conditionals)."""
    V, a, b = 4, 1, 3
    log_prior = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logits = torch.zeros(1, 2, 1, V, dtype=torch.float64)
    logits[0, 0, 0, a] = logits[0, 1, 0, b] = 5.0                            # branch 0 drafts a, branch 1 b
    log_q = dblast.branch_log_probs(logits, 1.0, False)                       # one-hot q~ (greedy branches)
    p = torch.zeros(V, dtype=torch.float64)
    p[a] = p[b] = 0.5
    acc = {}
    for verify in ('mixture', 'branch'):
        tot = 0.0
        for x in (a, b):                                                     # x ~ p
            log_qx = log_q[..., x]                                           # (1, K, 1)
            A = dblast.prefix_log_accept(log_prior, log_qx, torch.full((1, 1), math.log(0.5), dtype=torch.float64),
                                         verify)
            tot += 0.5 * float(A.exp())
        acc[verify] = tot
    assert abs(acc['branch'] - 0.5) < 1e-12 and abs(acc['mixture'] - 1.0) < 1e-12, acc
    Q1 = dblast.conditionals(log_prior, log_q, torch.tensor([[a]]))[0, 0]
    assert abs(float(torch.minimum(p, Q1).sum()) - 1.0) < 1e-12


def test_the_mixtures_conditional_follows_the_drafts_before_it():
    """Q_2 is the mixture given d_1, not the prior's mix: two greedy branches with disjoint paths
    (0 then 2, 1 then 3) at pi' = (1/2, 1/2); after the draft 0 only branch 0 is left, so Q_2 is
    one-hot on 2 (the prior's mix would give 2 and 3 half each)."""
    logits = torch.zeros(1, 2, 2, 4, dtype=torch.float64)
    logits[0, 0, 0, 0] = logits[0, 0, 1, 2] = logits[0, 1, 0, 1] = logits[0, 1, 1, 3] = 50.0
    log_q = dblast.branch_log_probs(logits, 1.0, False)                      # one-hot q~ (greedy branches)
    Q = dblast.conditionals(torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)), log_q, torch.tensor([[0, 2]]))
    assert Q[0].tolist() == [[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


@pytest.mark.parametrize('zt', [0.5, 2.0])
def test_branches_are_drawn_from_the_prior_at_its_temperature(target, zt):
    """Drafting draws z from pi' = softmax(log pi / Z_T), the prior verification's Q weighs by: with
    greedy branches whose paths differ, each row's drafts name its branch, and over 20,000 rows each
    branch's share is pi'(z) within 5 standard errors (pi itself is several away at these Z_T)."""
    d = drafter_of(4, 'greedy', zt=zt, seed=2)
    h = torch.randn(1, CFG.n_embd, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    bonus = torch.tensor([1])
    with torch.no_grad():
        log_pi, logits = d.mixture_logits(h, bonus, target, 4)
        paths = logits[0].argmax(-1)                                           # (K, 3) each branch's path
        assert len({tuple(p) for p in paths.tolist()}) == 4
        n = 20000
        drafts, _ = d.draft(h.expand(n, -1), bonus.expand(n), target, 4, 0.0, torch.Generator().manual_seed(1))
    z = (drafts[:, None, :] == paths[None]).all(-1).long().argmax(-1)          # (n,) the branch drawn
    share = torch.bincount(z, minlength=4).double() / n
    want = dblast.prior(log_pi, zt).exp()[0]
    se = (want * (1 - want) / n).sqrt()
    assert ((share - want).abs() < 5 * se).all(), (share, want)
    assert ((share - log_pi.exp()[0]).abs() > 5 * se).any()


def test_branch_form_is_the_prior_mix_of_each_branch_alone_and_the_mixture_form_at_k1():
    """§5/§6: branch-conditional acceptance is linear in the prior, exp(a_j^branch) =
    sum_z pi'_z exp(a_j of branch z alone) at every j (so AL_branch = sum_z pi'_z AL(z) <= max_z AL(z));
    and with K = 1 the two forms of a_j coincide."""
    g = torch.Generator().manual_seed(0)
    N, K, n = 16, 3, 5
    log_prior = F.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), -1)
    log_qx = -torch.rand(N, K, n, generator=g, dtype=torch.float64) * 3
    log_px = -torch.rand(N, n, generator=g, dtype=torch.float64) * 3
    a = dblast.prefix_log_accept(log_prior, log_qx, log_px, 'branch')
    one = torch.zeros(N, 1, dtype=torch.float64)
    alone = torch.stack([dblast.prefix_log_accept(one, log_qx[:, z:z + 1], log_px, 'mixture') for z in range(K)], 1)
    torch.testing.assert_close(a.exp(), (log_prior.exp()[..., None] * alone.exp()).sum(1), rtol=1e-12, atol=1e-14)
    AL = alone.exp().sum(-1)                                                 # (N, K) AL(z)
    assert (a.exp().sum(-1) <= AL.max(-1).values + 1e-12).all()
    torch.testing.assert_close(dblast.prefix_log_accept(one, log_qx[:, :1], log_px, 'branch'),
                               dblast.prefix_log_accept(one, log_qx[:, :1], log_px, 'mixture'), rtol=0, atol=1e-12)
    assert (a[:, 1:] <= a[:, :-1]).all()                                     # a_j never increases (R is a prefix)


def test_mixture_nll_is_minus_log_of_the_joint_for_several_branches():
    """§6: L_nll = -log sum_z pi_z prod_i q_i(x_i | z), K = 3 (the existing test has K = 1, where a
    logsumexp over one branch is the identity): against probability space, and exp(-L_nll) summed
    over every block is 1."""
    target = peaky(GPT(V8), 0.3, 0)
    d = peaky(dblast.DBlastDrafter(V8, 4, 3), 0.3, 2)
    xs = torch.tensor(list(itertools.product(range(8), repeat=3)))         # every block (512, 3)
    h = torch.randn(1, V8.n_embd, generator=torch.Generator().manual_seed(0), dtype=torch.float64).expand(512, -1)
    bonus = torch.full((512,), 3)
    with torch.no_grad():
        log_pi, log_qx = d.log_q(h, bonus, target, xs, 0.8)
        nll = dblast.DBlastDrafter.nll(log_pi, log_qx)
    joint = (log_pi.exp() * log_qx.exp().prod(-1)).sum(-1)
    torch.testing.assert_close(nll, -joint.log(), rtol=0, atol=1e-12)
    assert abs(float((-nll).exp().sum()) - 1.0) < 1e-12


def test_contexts_are_math_md_s6_positions():
    """§6: the context at t has h = H_t, b = y_{t+1}, x = y_{t+2..t+k} and
    log p_i(x_i) = log p_T(y_{t+1+i} | y_{<=t+i}), read against a full forward (float64)."""
    cfg = GPTConfig(block_size=48, vocab_size=8, n_layer=1, n_head=2, n_embd=16)
    model = peaky(GPT(cfg), 0.3, 0)
    seqs = torch.randint(8, (3, 44), generator=torch.Generator().manual_seed(1))
    T, k = 0.8, 4
    samples = dblast.TargetSamples.of(model, seqs, T, chunk=3)
    samples = dblast.TargetSamples(samples.seqs, samples.H.double(), samples.LP.double())
    rows, pos = torch.tensor([0, 1, 2, 2]), torch.tensor([31, 35, 39, 33])
    h, b, x, lp = dblast.contexts(samples, k, rows, pos)
    with torch.no_grad():
        H = model.hidden(seqs)
        logp = F.log_softmax(model.lm_head(H) / T, -1)                       # logp[r, s] = p(. | y_<=s)
    for m, (r, t) in enumerate(zip(rows.tolist(), pos.tolist())):
        torch.testing.assert_close(h[m], H[r, t], rtol=0, atol=1e-6)
        assert int(b[m]) == int(seqs[r, t + 1])
        assert x[m].tolist() == seqs[r, t + 2:t + k + 1].tolist()
        want = torch.stack([logp[r, t + i, seqs[r, t + 1 + i]] for i in range(1, k)])
        torch.testing.assert_close(lp[m], want, rtol=0, atol=1e-5)       # LP is kept in float32


def test_expected_tau_is_one_plus_the_mean_over_every_context():
    """§7: expected tau = 1 + (1/#contexts) sum_contexts sum_j exp(a_j), over every context
    PROMPT_LEN - 1 <= t < S - k of every row (the bonus sampled, the k-1 tokens after it inside the
    text), whatever the chunk the contexts are read in."""
    cfg = GPTConfig(block_size=48, vocab_size=8, n_layer=1, n_head=2, n_embd=16)
    model = peaky(GPT(cfg), 0.3, 0)
    d = peaky(dblast.DBlastDrafter(cfg, 4, 2), 0.3, 1)
    seqs = torch.randint(8, (3, 44), generator=torch.Generator().manual_seed(1))
    T, k = 1.0, 4
    s = dblast.TargetSamples.of(model, seqs, T, chunk=3)
    samples = dblast.TargetSamples(s.seqs, s.H.double(), s.LP.double())
    per = []
    for r in range(3):
        for t in range(PROMPT_LEN - 1, 44 - k):
            h, b, x, lp = dblast.contexts(samples, k, torch.tensor([r]), torch.tensor([t]))
            per.append(float(dblast.expected_accepted(d, h, b, model, x, lp, T, True, 'mixture')))
    want = 1 + sum(per) / len(per)
    for chunk in (7, 2048):
        got = dblast.expected_tau(d, model, samples, k, T, True, 'mixture', chunk=chunk)
        assert abs(got - want) < 1e-12, (chunk, got, want)


def test_expander_offsets_start_at_about_a_third_of_the_anchor_scale():
    """§8: with W_g1 ~ N(0, C^-1) and W_g2 ~ N(0, C^-1/4), each entry of a branch's offset starts with a
    standard deviation of (C * C^-1/4 * 1/2)^(1/2) = 8^-1/2 ~ 0.35, on an anchor of entries of scale 1."""
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=256)
    target, d = GPT(cfg).eval(), dblast.DBlastDrafter(cfg, 4, 4).eval()
    h, b = torch.randn(1000, 256), torch.randint(32, (1000,))
    with torch.no_grad():
        u = d.ln_u(d.w_u(torch.cat([h, target.transformer.wte(b)], -1)))
        _, u_z = d.anchor(h, b, target)
    assert abs(float(u.std()) - 1) < 0.02
    assert abs(float((u_z - u[:, None]).std()) - 8 ** -0.5) < 0.02
