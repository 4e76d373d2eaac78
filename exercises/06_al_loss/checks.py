"""Exercise 6's checks: the acceptance-length surrogate (README.md)."""
import itertools
import math

import torch
import torch.nn.functional as F

from dblast import DBlastDrafter, contexts, expected_accepted, expected_tau
from exercises import harness

NAMES = ('prefix_log_accept', 'al_surrogate')
SEAMS = {'dblast.prefix_log_accept': 'prefix_log_accept', 'dblast.al_surrogate': 'al_surrogate'}
# the project's own functions, in a handout calls of student.py
REFERENCE = {'prefix_log_accept': 'dblast.prefix_log_accept', 'al_surrogate': 'dblast.al_surrogate'}
# the rest of the answer, left out of a handout (exercises/handout.py), and what the student may use
STUBS = {'dblast.log_conditionals': "log Q_i(x_i), the mixture's conditional at the block: most of "
                                    "prefix_log_accept's own work"}
MAY_USE = ('dblast.posterior', 'dblast.DBlastDrafter.nll', 'dblast.expected_accepted', 'dblast.branch_log_q')
TRY_PAIRED = False     # try_it prints its own table: the evaluator's rows, then decoding's (harness.try_out)


def fmt(t):
    """A short tensor for a message: [1.409, 4.084]."""
    return '[' + ', '.join(f"{x:.4g}" for x in t.detach().reshape(-1).tolist()) + ']'


def tails(a):
    """λ_j = log sum_{j' >= j} exp(a_j') for every position j of a (..., n), position by position."""
    return torch.stack([torch.logsumexp(a[..., j:], -1) for j in range(a.size(-1))], -1)


def shaped(what, got, want, named, hint):
    """got, a tensor of shape `want`; else a Fail saying what `what` returned."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != want:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise harness.Fail(f"{what} returned {shape}, want {named} = {want}", hint)
    return got


def handed(t):
    """t as training hands it over: a tensor a check made (a leaf) as a copy of its own, a function's output (the
    prior's log_softmax, your a, which autograd may need) as it is. DBlastDrafter.loss hands over none that requires
    grad as a leaf, and reads none of them again: an in-place op on an input is right there, except on one that
    autograd needs."""
    return t.clone() if t.is_leaf else t


def prefix(impl, log_prior, log_qx, log_px):
    """impl.prefix_log_accept, its shape checked: a (N, n)."""
    return shaped('prefix_log_accept', impl.prefix_log_accept(handed(log_prior), handed(log_qx), handed(log_px),
                                                              'mixture'),
                  tuple(log_px.shape), 'a of (N, n)', harness.ONE_ROW_HINT if len(log_px) == 1 else '')


def surrogate(impl, a, nll, tau_threshold):
    """impl.al_surrogate, its shape checked: L per row (N,)."""
    return shaped('al_surrogate', impl.al_surrogate(handed(a), handed(nll), tau_threshold), tuple(nll.shape),
                  'the loss of each row, (N,)',
                  harness.ONE_ROW_HINT if len(nll) == 1 else "one loss per row: no mean over the rows")


def directly(log_prior, log_qx, log_px):
    """log prod_{i<=j} min(1, Q_i(x_i) / p_i(x_i)) (N, n), Q_i the mixture's conditional, computed in
    probability space from sampled branches' q~ (none 0)."""
    joint = (log_prior.exp()[..., None] * log_qx.exp().cumprod(-1)).sum(1)          # Q(x_1..x_i)
    Q = joint / torch.cat([torch.ones_like(joint[:, :1]), joint[:, :-1]], 1)        # Q_i(x_i)
    return torch.minimum(torch.ones_like(Q), Q / log_px.exp()).cumprod(-1).log()


AUTOCAST = ("autocast runs a matmul of float32 tensors (einsum, @, bmm, a triangular matrix summing) in bfloat16, "
            "3 significant digits, and the drafter then trains on a GPU on a loss and a gradient that far off: sum "
            "with cumsum or sum and multiply elementwise (autocast switched off around the matmul leaves it to "
            "TF32, which train.py's steps turn on for float32 matmuls on CUDA: 10 bits)")


def random_block(N=8, K=3, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    log_prior = F.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), -1)
    log_qx = -torch.rand(N, K, n, generator=g, dtype=torch.float64) * 3
    log_px = -torch.rand(N, n, generator=g, dtype=torch.float64) * 3
    return log_prior, log_qx, log_px


def test_the_prefix_weights_by_enumeration(impl):
    """The prefix weights, directly. a_j = log prod_{i<=j} min(1, Q_i(x_i) / p_i(x_i)) with Q_i
    the mixture's conditional, computed in probability space, and its gradient in log q~ (K = 3:
    a clamped term's q~ still reaches the later Q_i through the posterior, MATH.md §6); both under
    bfloat16 autocast (float32 inputs, as train.py trains on a GPU) to float32's precision; a draft
    the drafter gives almost nothing (log q~ = -300); one branch and one draft, three rows. Hint:
    a_j takes the acceptance ratios of drafts 1..j, each clamped at 1 (each term at 0 in log
    space), with Q_i the mixture's conditional given the block's tokens before i."""
    prior_logits, log_qx, log_px = random_block()
    prior_logits.requires_grad_(), log_qx.requires_grad_()
    log_prior = F.log_softmax(prior_logits, -1)             # the drafter's prior, trained through a too
    a = prefix(impl, log_prior, log_qx, log_px)
    want = directly(log_prior, log_qx, log_px)
    err = (a - want).abs().max().item()
    assert err < 1e-12, f"a differs from log prod min(1, Q_i / p_i) by {err:.1e}, want below 1e-12"
    weights = torch.rand(a.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    if not a.requires_grad:
        raise harness.Fail("a has no gradient in log q~, want one: the AL loss trains the drafter through it",
                           "what fits: a .detach() (or torch.no_grad) on the way from log q~ to a")
    got, got_prior = torch.autograd.grad((a * weights).sum(), (log_qx, prior_logits), allow_unused=True,
                                           retain_graph=True)   # log_prior's graph serves want's too
    expected, expected_prior = torch.autograd.grad((want * weights).sum(), (log_qx, prior_logits))
    if got_prior is None or not (got_prior - expected_prior).abs().max() < 1e-9:
        raise harness.Fail(f"the gradient of a in the prior's logits is "
                           f"{'none' if got_prior is None else fmt(got_prior[0])} (row 0), want "
                           f"{fmt(expected_prior[0])}, that of log prod min(1, Q_i / p_i)",
                           "the prior weighs the branches of every Q_i (the posterior, MATH.md §6), and the AL loss "
                           "trains it through a: what fits is log_prior detached on its way to a")
    err = (got - expected).abs().max().item()
    if not err < 1e-9:
        b, z, i = (int(x) for x in ((got - expected).abs() == err).nonzero()[0])
        raise harness.Fail(f"the gradient of a in log q~ differs from that of log prod min(1, Q_i / p_i) by {err:.1e} "
                           f"(row {b}, branch {z}, position {i}: {got[b, z, i].item():.4g}, want "
                           f"{expected[b, z, i].item():.4g}), want below 1e-9",
                           "a clamped term (Q_i above p_i) gives no gradient of its own, but its q~ still weighs the "
                           "branches of every later Q_i (the posterior): what fits is a .detach() of log q~ where a "
                           "term is clamped, in place of a clamp of the term alone")
    # under bfloat16 autocast, float32 inputs (train.py --dtype bfloat16, its default on a GPU), against float64's
    # of the same float32 numbers: right answers in float32 come within 3e-7 of exp(a) and of the gradient (ten
    # formulations written), a matmul left to autocast (an einsum, @, a triangular matrix summing) 2e-3 off
    logits32, log_qx32 = (t.detach().float().requires_grad_() for t in (prior_logits, log_qx))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        a32 = prefix(impl, F.log_softmax(logits32, -1), log_qx32, log_px.float())
    logits64, log_qx64 = (t.detach().double().requires_grad_() for t in (logits32, log_qx32))
    want = directly(F.log_softmax(logits64, -1), log_qx64, log_px.float().double())
    err = (a32.double().exp() - want.exp()).abs().max().item()
    if not err < 1e-5:
        raise harness.Fail(f"under bfloat16 autocast (train.py --dtype bfloat16), float32 inputs: exp(a) "
                           f"({str(a32.dtype)[6:]}) differs from prod min(1, Q_i / p_i) by {err:.1e}, want below "
                           f"1e-5, float32's own", AUTOCAST)
    got = torch.autograd.grad((a32.double() * weights).sum(), (log_qx32, logits32))
    expected = torch.autograd.grad((want * weights).sum(), (log_qx64, logits64))
    err = max((g.double() - e).abs().max().item() for g, e in zip(got, expected))
    if not err < 1e-5:
        raise harness.Fail(f"under bfloat16 autocast (train.py --dtype bfloat16), float32 inputs: the gradient of a "
                           f"in log q~ and the prior's logits differs from that of log prod min(1, Q_i / p_i) by "
                           f"{err:.1e}, want below 1e-5, float32's own", AUTOCAST)
    deep = prefix(impl, torch.zeros(1, 1, dtype=torch.float64),
                  torch.tensor([[[-1.0, -300.0, -1.0, -1.0]]], dtype=torch.float64),
                  torch.full((1, 4), -1.0, dtype=torch.float64)).detach()
    want = torch.tensor([[0.0, -299.0, -299.0, -299.0]], dtype=torch.float64)     # one branch: Q_i = q~_i
    if not torch.allclose(deep, want, rtol=0, atol=1e-9):
        raise harness.Fail(f"one branch, log q~ = [-1, -300, -1, -1], log p = -1 at every position: a = {fmt(deep)}, "
                           f"want {fmt(want)}", "a draft the drafter gives almost nothing weighs as little as it "
                           "is given: what fits is a guard of modest size (a clamp of log q~, an epsilon added to a "
                           "probability) where only log 0 needed one")
    # one branch, one draft a block (k = 2), three rows: a_0 = min(0, log q~ - log p) row by row
    log_qx, log_px = torch.tensor([[[-1.0]], [[-2.0]], [[-0.1]]], dtype=torch.float64), \
        torch.tensor([[-1.5], [-1.0], [-0.5]], dtype=torch.float64)
    one = prefix(impl, torch.zeros(3, 1, dtype=torch.float64), log_qx, log_px).detach()
    if not torch.allclose(one, (log_qx[:, 0] - log_px).clamp(max=0.0), rtol=0, atol=1e-12):
        raise harness.Fail(f"one branch, one draft a block (k = 2), three rows: a = {fmt(one)}, want "
                           f"{fmt((log_qx[:, 0] - log_px).clamp(max=0.0))}", "what fits: a squeeze() of every "
                           "dimension of size 1 (K = 1 and n = 1 together), which leaves rows and branches mixed")


def test_a_block_off_every_branch(impl):
    """A block off every branch's path. With greedy branches (log q~ is 0 on a branch's path and
    -inf off it) a block that leaves every branch's path has Q_i(x_i) = 0 from there on: a_j is
    -inf (below -230 at least: exp(a_j) under 1e-100), never NaN, and exact before it; so is a block
    along a branch the prior rules out (log pi' = -inf, as Z_T = 0 gives)."""
    inf = math.inf
    log_prior = torch.log(torch.tensor([[0.6, 0.4]] * 3 + [[1.0, 0.0]], dtype=torch.float64))
    log_qx = torch.tensor([[[0, 0, 0, 0], [0, -inf, -inf, -inf]],           # row 0: branch 0's whole path
                           [[0, -inf, 0, 0], [0, -inf, -inf, 0]],           # row 1: off both from position 1
                           [[-inf, 0, 0, -inf], [-inf, -inf, 0, 0]],        # row 2: off both from position 0
                           [[-inf, 0, 0, 0], [0, 0, 0, 0]]],                # row 3: on branch 1's, which the
                          dtype=torch.float64)                              # prior rules out (Z_T = 0)
    log_px = -torch.tensor([[0.5, 1.0, 0.2, 2.0]] * 4, dtype=torch.float64)
    a = prefix(impl, log_prior, log_qx, log_px)
    joint = (log_prior.exp()[..., None] * log_qx.exp().cumprod(-1)).sum(1)          # Q(x_1..x_i), 0 off the paths
    before = torch.cat([torch.ones_like(joint[:, :1]), joint[:, :-1]], 1)
    Q = torch.where(before > 0, joint / before.clamp(min=1e-300), 0.0)
    want = torch.minimum(torch.ones_like(Q), Q / log_px.exp()).cumprod(-1)          # exp(a_j)
    if torch.isnan(a).any():
        b, j = (int(i) for i in torch.isnan(a).nonzero()[0])
        raise harness.Fail(f"a is NaN at row {b}, position {j} (a = {fmt(a[b])}), where the block has left every "
                           f"branch's path: want -inf there (exp(a_j) = 0)", "what fits: a difference of two "
                           "logsumexps that are both -inf (-inf - (-inf) is NaN), 0 * -inf, or 0 / 0 in probability "
                           "space")
    err = (a.exp() - want).abs().max().item()
    left = (want == 0) & (a > -230.0)                       # exp(a) above 1e-100 where it is 0
    if left.any():
        b, j = (int(i) for i in left.nonzero()[0])
        raise harness.Fail(f"a = {fmt(a[b])} at row {b}: position {j} is {a[b, j].item():.4g}, where the block has "
                           f"left every branch's path, want -inf (exp(a_j) = 0)",
                           "what fits: a guard that turns log 0 into a finite number (an epsilon added to a "
                           "probability, a clamp of log q~); -inf stays -inf through logsumexp, min and cumsum")
    if not err < 1e-12:
        off = (a.exp() - want).abs().amax(-1).argmax().item()
        raise harness.Fail(f"exp(a) differs from prod min(1, Q_i / p_i) by {err:.1e} (row {off}: exp(a) = "
                           f"{fmt(a[off].exp())}, want {fmt(want[off])}), want below 1e-12",
                           "where the block leaves every branch's path Q_i(x_i) is 0, and so is every exp(a_j) from "
                           "there: what fits a positive value there is a guard that turns log 0 into a finite "
                           "number of modest size (a clamp of log q~, an epsilon added to a probability)")


def test_the_threshold_and_the_fallback(impl):
    """The threshold and the fallback. Every prefix kept at tau_threshold 0 (L = -mean_j λ_j); only
    a_j >= log tau_threshold kept in between, each row averaging over its own R (rows keeping 2 and
    1); the row's NLL where nothing is kept, and its gradient; the loss and its gradient under
    bfloat16 autocast (float32 a, as train.py trains on a GPU) to float32's precision. Hint:
    λ_j = logsumexp over j' >= j: a flipped logcumsumexp; tau_threshold 0 keeps everything
    (log 0 = -inf)."""
    a = torch.tensor([[-0.1, -0.5, -2.0, -4.0], [-3.0, -3.5, -5.0, -6.0], [-0.5, -2.0, -3.0, -4.0]],
                     dtype=torch.float64)
    nll = torch.tensor([7.0, 9.0, 11.0], dtype=torch.float64)
    t = tails(a)
    got = surrogate(impl, a, nll, 0.0)
    if not torch.allclose(got, -t.mean(-1)):
        hint = ("tau_threshold 0 keeps every prefix (log 0 = -inf, below any a_j): take it as -inf, not as a "
                "math error" if not torch.isfinite(got).all() else '')
        raise harness.Fail(f"tau_threshold 0: {fmt(got)}, want -mean_j λ_j {fmt(-t.mean(-1))} (off by "
                           f"{(got - -t.mean(-1)).abs().max().item():.1e})", hint)
    got = surrogate(impl, a, nll, math.exp(-1.0))   # keeps a[0, 0] and a[0, 1], nothing of row 1, a[2, 0]
    want = torch.stack([-(t[0, 0] + t[0, 1]) / 2, nll[1], -t[2, 0]])
    if not torch.allclose(got, want):
        hint = ("row 1 keeps no prefix (every a_j below log tau_threshold): its loss is its NLL, nll[1]"
                if torch.isclose(got[0], want[0]) and torch.isclose(got[2], want[2]) else
                "each row averages over its own R: row 0 over 2 prefixes, row 2 over 1 (what fits: a count taken "
                "over the batch, its largest |R| or their mean)" if torch.isclose(got[1], want[1]) else
                "row 0 keeps a[0, 0] and a[0, 1] (a >= log tau_threshold = -1): the loss averages t[0, 0] and t[0, 1] "
                "over those two, each t[0, j] the logsumexp of a[0, j:]")
        raise harness.Fail(f"tau_threshold e^-1: {fmt(got)}, want {fmt(want)} (row 0 keeps positions 0 and 1, "
                           f"row 1 nothing, row 2 position 0)", hint)
    a_, nll_ = a.clone().requires_grad_(), nll.clone().requires_grad_()
    surrogate(impl, a_, nll_, math.exp(-1.0)).sum().backward()
    if nll_.grad is None:
        raise harness.Fail("tau_threshold e^-1, backward: nll gets no gradient, want (0, 1, 0) (row 1's loss is its "
                           "NLL)",
                           "what fits: the fallback's nll detached, where training needs its gradient (the rows that "
                           "keep no prefix learn from it alone)")
    if not (torch.isfinite(a_.grad).all() and (a_.grad[1] == 0).all() and nll_.grad.tolist() == [0.0, 1.0, 0.0]):
        raise harness.Fail(f"tau_threshold e^-1, backward: a gets gradient {fmt(a_.grad)}, nll {fmt(nll_.grad)}; want "
                           f"row 1's loss, its NLL, to give a none and nll (0, 1, 0)",
                           "row 1 keeps no prefix: its loss is its NLL, and so is its gradient. What fits: a division "
                           "by |R| = 0 in that row, which torch.where hides in the forward pass but not in the "
                           "backward (0/0 there is NaN, and NaN times 0 is NaN)")
    # the whole gradient in a, against autograd through the tails themselves; then the loss and its gradient
    # under bfloat16 autocast, float32 a and nll (train.py --dtype bfloat16, its default on a GPU), against
    # float64's of the same float32 numbers: right answers within 3e-7 (twelve formulations written), an einsum or
    # @ left to autocast (the mean over R, the tails as a product with a triangular matrix) 6e-4 off
    weights = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)
    for tau_threshold, kept in ((0.0, [[0, 1, 2, 3]] * 3), (math.exp(-1.0), [[0, 1], [], [0]])):
        for dtype in (torch.float64, torch.float32):
            a_ = a.to(dtype, copy=True).requires_grad_()
            with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.float32):
                loss = surrogate(impl, a_, nll.to(dtype), tau_threshold)
            got, = torch.autograd.grad((loss * weights).sum(), a_)
            a64 = a_.detach().double().requires_grad_()
            want = torch.stack([-tails(a64)[r, js].mean() if js else nll[r] for r, js in enumerate(kept)])
            err = (loss.double() - want).abs().max().item()
            want, = torch.autograd.grad((want * weights).sum(), a64, allow_unused=True)
            grad_err = (got.double() - want).abs().max().item()
            if dtype == torch.float32 and not max(err, grad_err) < 1e-5:
                raise harness.Fail(f"under bfloat16 autocast (train.py --dtype bfloat16), float32 a, tau_threshold "
                                   f"{tau_threshold:.3g}: the loss ({str(loss.dtype)[6:]}) differs from -mean over R "
                                   f"of λ_j by {err:.1e}, its gradient in a by {grad_err:.1e}, want both below 1e-5, "
                                   f"float32's own", AUTOCAST)
            # in float64 to the bound the loss's values are held to (torch.allclose's 1e-5): a mean over R taken
            # as sum / (|R| + 1e-6), off by 1e-6 / |R|, trains the same; a part of λ_j detached is off by 1e-2 and up
            if dtype == torch.float64 and not torch.allclose(got, want, rtol=1e-5, atol=1e-8):
                raise harness.Fail(f"tau_threshold {tau_threshold:.3g}: the loss's gradient in a is {fmt(got[0])} "
                                   f"(row 0), want {fmt(want[0])}, that of -mean over R of λ_j (off by "
                                   f"{grad_err:.1e})",
                                   "the values are right and the gradient is not: what fits is a part of λ_j detached "
                                   "(the max a logsumexp is shifted by, say), which leaves the value as it was")


def test_the_threshold_at_its_edges(impl):
    """The threshold at its edges. A prefix exactly at the threshold is kept (a_j >= log
    tau_threshold: at tau_threshold e^-30, a_j = -30 is in R); tau_threshold 0 keeps every prefix
    however small its weight (e^-31 .. e^-900 in float64, e^-90 .. e^-101 in float32), never the
    NLL; and the prefixes of a block off every greedy branch's path (a_j = -inf) stay out of R
    without a NaN."""
    a = torch.tensor([[-29.0, -30.0, -30.5, -31.0], [-31.0, -40.0, -80.0, -700.0]], dtype=torch.float64)
    nll = torch.tensor([7.0, 9.0], dtype=torch.float64)
    t = tails(a)
    got = surrogate(impl, a[:1], nll[:1], math.exp(-30.0))                   # R = {0, 1}: -30 >= -30
    want = -(t[0, 0] + t[0, 1]) / 2
    if not torch.allclose(got, want.reshape(1)):
        hint = ("a_j equal to log tau_threshold is in R: the test is a_j >= log tau_threshold, not a_j > "
                "log tau_threshold"
                if torch.allclose(got, -t[0, :1]) else
                "that is the row's NLL: R came out empty, though a_0 = -29 and a_1 = -30 are >= log e^-30; is "
                "tau_threshold replaced by a larger number somewhere (a guard such as max(tau_threshold, 1e-12))?"
                if torch.allclose(got, nll[:1]) else '')
        raise harness.Fail(f"tau_threshold e^-30, a = {fmt(a[0])}: {fmt(got)}, want {fmt(want)} (R = positions 0 "
                           f"and 1, a_1 = -30 being at the threshold)", hint)
    # tails far below the row's largest a_j too: a shift by the row's max leaves them 0, log 0 = -inf
    deeper = [(a[1:], nll[1:]), (torch.tensor([[-750.0, -760.0, -800.0, -900.0]], dtype=torch.float64), nll[1:]),
              (torch.tensor([[-1.0, -2.0, -800.0, -900.0]], dtype=torch.float64), nll[1:]),
              (torch.tensor([[-90.0, -95.0, -100.0, -101.0]]), nll[1:].float()),   # float32, as training upcasts
              (torch.tensor([[-1.0, -3.0, -110.0, -120.0]]), nll[1:].float())]
    for a_, nll_ in deeper:
        want = -tails(a_)[0].mean()
        got = surrogate(impl, a_, nll_, 0.0).to(want.dtype)             # a loss in float64 of float32's a: fine
        if not torch.allclose(got, want.reshape(1)):
            hint = ("tau_threshold 0 keeps every prefix: log 0 is -inf, below every a_j, whatever its size; a guard "
                    "such as log(max(tau_threshold, 1e-12)) turns 0 into a threshold of e^-27.6, and one of the "
                    "smallest positive number into e^-708 (float64) or e^-87 (float32), which drop these prefixes"
                    if torch.allclose(got, nll_) else
                    "the tails λ_j = log sum_{j' >= j} exp(a_j') overflow or vanish here: what fits is exp taken "
                    "before the log (log(cumsum(exp(a))), 0 below e^-745 in float64; after one shift by the row's "
                    "largest a_j, 0 for a tail that far below it), where logcumsumexp keeps the sum in log space"
                    if not torch.isfinite(got).all() else '')
            raise harness.Fail(f"tau_threshold 0, a = {fmt(a_[0])} ({a_.dtype}): {fmt(got)}, want -mean_j λ_j = "
                               f"{fmt(want)} (every prefix kept{', not the NLL' if torch.allclose(got, nll_) else ''})",
                               hint)
    # exactly at a threshold no float32 computes (float32's log 0.4 lies above float64's), and just below one
    edges = ((math.log(0.4), 0.4, 1, "a_0 = log 0.4 is kept"),
             (math.log(0.01) - 5e-7, 0.01, 0, "a_0, 5e-7 below log 0.01, is not kept: the NLL"))
    for a_0, tau_threshold, keep, why in edges:
        a_ = torch.tensor([[a_0, -6.0, -7.0, -8.0]], dtype=torch.float64)
        got = surrogate(impl, a_, nll[:1], tau_threshold)
        want = -tails(a_)[0, :keep].mean().reshape(1) if keep else nll[:1]
        if not torch.allclose(got, want):
            raise harness.Fail(f"tau_threshold {tau_threshold}, a = [{a_0:.17g}, -6, -7, -8] (float64): {fmt(got)}, "
                               f"want {fmt(want)} ({why})",
                               "compare a_j with log tau_threshold in a's own precision (math.log(tau_threshold), "
                               "float64 here), exactly: what fits is the threshold's log taken in float32 (a "
                               "torch.tensor(tau_threshold) is float32), or a tolerance added to it")
    # a block that leaves the greedy branches' paths has a_j = -inf from there: R leaves those out, and
    # the loss stays finite (no -inf times 0)
    a_ = torch.tensor([[-0.1, -0.5, -math.inf, -math.inf]], dtype=torch.float64)
    got = surrogate(impl, a_, nll[:1], 0.01)
    want = -tails(a_)[0, :2].mean()
    if not torch.allclose(got, want.reshape(1)):
        raise harness.Fail(f"tau_threshold 0.01, a = {fmt(a_[0])} (a block off every greedy branch from position 2): "
                           f"{fmt(got)}, want {fmt(want)}", "the prefixes of a = -inf are not in R, and their tails "
                           "λ_j are -inf: what fits a NaN is a mask applied by multiplying (-inf times 0 is NaN), "
                           "where torch.where picks")


def test_gradient_reaches_past_R(impl):
    """The gradient reaches past R, not past the clamp. With R = {0} (only a[:, 0] kept), λ_0
    still sums over the later prefixes, so log q at positions 1.. gets gradient (MATH.md §6);
    where q >= p it gets none. Hint: choose R on a.detach(), and keep λ_j whole."""
    log_qx = torch.tensor([[[-1.0, -1.0, -1.0, -3.0]]], dtype=torch.float64, requires_grad=True)   # K = 1, n = 4
    log_px = torch.tensor([[-0.5, -0.5, -2.0, -0.5]], dtype=torch.float64)        # position 2: q above p
    a = prefix(impl, torch.zeros(1, 1, dtype=torch.float64), log_qx, log_px)
    want = torch.tensor([[-0.5, -1.0, -1.0, -3.5]], dtype=torch.float64)
    if not torch.allclose(a.detach(), want):
        raise harness.Fail(f"a = {fmt(a)}, want {fmt(want)}", "a itself is off (the first check tests it alone): "
                           "a_j = sum_{i<=j} min(0, log Q_i(x_i) - log p_i(x_i)), clamped term by term")
    loss = surrogate(impl, a, torch.zeros(1, dtype=torch.float64), math.exp(-0.75))       # R = {0}
    want = -torch.logsumexp(a.detach()[0], 0).reshape(1)
    if not torch.allclose(loss, want):
        raise harness.Fail(f"with R = {{0}} the loss is {fmt(loss)}, want -λ_0 = {fmt(want)}",
                           "only a[0] >= log tau_threshold = -0.75, so R = {0} and the loss is -λ_0, the logsumexp "
                           "of the whole of a (the check above tests the threshold on hand-made values)")
    loss.sum().backward()
    grad = log_qx.grad[0, 0]
    if not grad[0] < 0:
        raise harness.Fail(f"position 0, in R, gets gradient {grad[0].item():.3g}, want below 0 (grad {fmt(grad)})",
                           "the loss must be a function of a (no .detach() on the λ_j you average, only on the "
                           "mask that chooses R)")
    if not (grad[1] < 0 and grad[3] < 0):
        raise harness.Fail(f"positions 1 and 3, after R, get gradient {grad[1].item():.3g} and {grad[3].item():.3g}, "
                           f"want below 0 (grad {fmt(grad)})",
                           "λ_0 = logsumexp of a[0], a[1], .. (the whole tail): the positions after R reach the loss "
                           "through it; a[0] alone in place of λ_0 cuts them off")
    # 0 up to rounding: a Q_i computed in probability space (a ratio of joint probabilities) leaves ~1e-18
    assert abs(grad[2]) <= 1e-12 * grad.abs().max(), f"position 2, clamped (q above p), gets gradient " \
                                                     f"{grad[2].item():.3g}, want 0 (grad {fmt(grad)})"


def test_the_loss_prefers_longer_acceptance(impl):
    """The loss prefers a drafter accepted longer. Of two proposals for the same target samples,
    the one closer to p has the larger expected acceptance and the lower AL loss."""
    g = torch.Generator().manual_seed(3)
    log_px = -torch.rand(500, 6, generator=g, dtype=torch.float64) * 2
    log_prior = torch.zeros(500, 1, dtype=torch.float64)
    losses, accepts = [], []
    for noise in (0.2, 1.5):
        log_qx = (log_px + noise * torch.randn(500, 6, generator=g, dtype=torch.float64)).clamp(max=0)[:, None]
        a = prefix(impl, log_prior, log_qx, log_px)
        accepts.append(float(a.exp().sum(-1).mean()))
        losses.append(float(surrogate(impl, a, -log_qx.sum((1, 2)), 0.01).mean()))
    assert accepts[0] > accepts[1], f"expected accepted drafts {accepts[0]:.3f} for the closer proposal, " \
                                    f"{accepts[1]:.3f} for the farther, want the closer one's larger (see a_j)"
    assert losses[0] < losses[1], f"AL loss {losses[0]:.3f} for the closer proposal, {losses[1]:.3f} for the " \
                                  f"farther, want the closer one's lower"


def test_no_tensor_on_another_device(impl):
    """No tensor on another device. Both functions make no tensor off the device of their inputs
    (run on PyTorch's 'meta' device, which refuses a mix of devices as CUDA does): train.py calls
    them on the GPU it trains on."""
    log_prior, log_qx, log_px = (harness.on_meta(t) for t in random_block(seed=4))
    # training code: a copy from the host (a .to(device)) costs a wait there, not a step's graph
    harness.assert_on_the_inputs_device('prefix_log_accept',
                                        lambda: impl.prefix_log_accept(log_prior, log_qx, log_px, 'mixture'),
                                        copies=False)
    a = harness.on_meta(-torch.rand(8, 4, dtype=torch.float64))
    nll = harness.on_meta(torch.ones(8, dtype=torch.float64))
    for tau_threshold in (0.0, 0.01):
        harness.assert_on_the_inputs_device(f'al_surrogate, tau_threshold {tau_threshold}',
                                            lambda: impl.al_surrogate(a, nll, tau_threshold), copies=False)


@torch.no_grad()
def test_the_acceptance_length_identity(impl):
    """The acceptance-length identity. E_{x ~ p}[sum_j exp(a_j)], summed exactly over every block of
    the 8-token world, equals the accepted drafts speculative decoding measures (20,000 first steps
    of a K = 4 drafter). Hint: the identity sums exp(a_j) of your prefix_log_accept, which the
    first checks test alone; if they pass and this fails, what fits is something their blocks do
    not reach: the clamp at 0 applied to the sum rather than term by term, or Q_i conditioned on
    other tokens than the block's before i."""
    model = harness.target8()
    d = harness.peaky(DBlastDrafter(model.config, 4, 4), 0.3, 2)
    T, n = 1.0, 3
    seqs = torch.tensor(list(itertools.product(range(8), repeat=n + 1)))           # bonus, x_1..x_3
    full = torch.cat([harness.PROMPT8.expand(len(seqs), -1), seqs], 1)
    T0 = harness.PROMPT8.size(1)
    h = model.hidden(full)
    logp = F.log_softmax(model.lm_head(h) / T, -1)
    lp = logp[:, T0 - 1:-1].gather(-1, seqs.unsqueeze(-1)).squeeze(-1)             # (N, n+1)
    per_block = expected_accepted(d, h[:, T0 - 1], seqs[:, 0], model, seqs[:, 1:], lp[:, 1:].clone(), T, True,
                                  'mixture')                     # log p a copy of its own, as contexts gives it
    expected = float((lp.sum(-1).exp() * per_block).sum())
    rows = 20000
    _, stats = harness.generate(harness.float32(model), harness.PROMPT8.expand(rows, -1), 4,
                                drafter=harness.float32(d), temperature=T, generator=torch.Generator().manual_seed(0))
    first = torch.tensor(stats['accept_lengths'][:rows], dtype=torch.float64) - 1
    mean, se = first.mean().item(), first.std().item() / math.sqrt(rows)
    assert abs(mean - expected) < 4.5 * se, \
        f"the identity gives {expected:.3f} accepted drafts, decoding measures {mean:.3f} +- {se:.3f}, want them " \
        f"within 4.5 standard errors ({4.5 * se:.3f})"


def test_nothing_kept_from_step_to_step(impl):
    """Nothing kept from step to step. Five training steps (a, the loss and its backward, new
    values each) keep no more of the tensors they make, nor more bytes, than one: train.py calls
    both functions at every step, and a list of every a (or every loss) kept for a running
    statistic keeps each step's whole graph alive, the drafter's logits with it, until the GPU runs
    out of memory."""
    g = torch.Generator().manual_seed(7)

    def step(i):
        log_prior, log_qx, log_px = random_block(seed=int(torch.randint(1000, (1,), generator=g)))
        logits, q = (t.detach().clone().requires_grad_() for t in (log_prior, log_qx))
        a = prefix(impl, F.log_softmax(logits, -1), q * 1.0, log_px)        # log q~, a function's output
        surrogate(impl, a, -log_qx.sum((1, 2)), 0.01).sum().backward()
    harness.assert_keeps_nothing('a, the loss and its backward', step)


def test_torch_settings_left_as_they_were(impl):
    """torch's settings left as they were. A training step (a, the loss and its backward) and a
    call of prefix_log_accept under torch.no_grad (as the exact evaluator makes it) change none of
    torch's process-wide settings: the global RNG (torch.manual_seed), grad mode
    (torch.set_grad_enabled as a statement), the default dtype, anomaly detection, deterministic
    algorithms, TF32 and the float32 matmul precision. train.py calls both at every step: the rest of
    the step (dropout draws from the global RNG) and the steps after it must go on as without them. A
    student.py that changes one while it loads fails every check."""
    log_prior, log_qx, log_px = random_block(seed=11)

    def step():
        logits, q = (t.detach().clone().requires_grad_() for t in (log_prior, log_qx))
        a = prefix(impl, F.log_softmax(logits, -1), q * 1.0, log_px)
        surrogate(impl, a, -log_qx.sum((1, 2)), 0.01).sum().backward()
    harness.assert_leaves_torch_alone('a, the loss and its backward', step)
    with torch.no_grad():
        harness.assert_leaves_torch_alone('prefix_log_accept under torch.no_grad',
                                          lambda: prefix(impl, log_prior, log_qx, log_px))


@torch.no_grad()
def try_it(impl, tryout):
    """train.py's DBlast drafters on the held-out target samples its dblast stage made and cached in
    out/data, at its temperature: the exact evaluator's expected tau and the AL loss with your
    functions, next to the reference's (in a handout, which has none: yours alone); and the tau each
    drafter reaches decoding held-out prompts with the project's decoder, which the expected tau
    estimates (decoding calls neither of your functions)."""
    samples, T = tryout.target_samples('val')
    whose = [('reference', tryout.reference)] if tryout.reference is not None else []
    print("| drafter | whose | expected tau | AL loss |\n|---|---|---|---|")
    for name in ('dblast_K4.pt', 'dblast_K1.pt'):
        d = tryout.drafter(name)
        lo, hi = samples.positions(d.k)
        rows = torch.arange(len(samples.seqs)).repeat_interleave(hi - lo)
        pos = torch.arange(lo, hi).repeat(len(samples.seqs))
        for label, code in whose + [(tryout.mine, impl)]:
            with harness.plugged(tryout.checks, code):
                tau = expected_tau(d, tryout.model, samples, d.k, T, True, 'mixture')
                h, bonus, x, log_px = contexts(samples, d.k, rows[:4096].to(samples.seqs.device),
                                              pos[:4096].to(samples.seqs.device))
                loss = d.loss(h, bonus, tryout.model, x, log_px, T)
            print(f"| {name} | {label} | {tau:.3f} | {float(loss):.4f} |")
        _, taus, _, _ = tryout.decode(None, T, drafter=d, k=d.k)
        print(f"| {name} | decoded at T = {T}, {len(tryout.prompts)} prompts (what expected tau estimates) | "
              f"{sum(taus) / len(taus):.3f} | |")
