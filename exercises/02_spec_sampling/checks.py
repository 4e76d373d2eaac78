"""Exercise 2's checks: lossless speculative sampling (README.md)."""
import itertools
import math

import torch
import torch.nn.functional as F

from cli import BadInput, first_line
from exercises import harness
from heads import BlockHeads
from model import sample

NAMES = ('verify_sampled',)
SEAMS = {'verification.verify_sampled': 'verify_sampled'}
REFERENCE = {'verify_sampled': 'verification.verify_sampled'}   # in a handout: a call of student.py
# the rest of the answer, left out of a handout (exercises/handout.py), and what the student may use
STUBS = {'verification.accept_sampled': "speculative sampling's test, min(1, P/Q): verify_sampled's own work",
         'verification.residual': "the bonus after a rejection, norm(max(0, P - Q)): verify_sampled's own work"}
MAY_USE = ('model.sample', 'model.tempered')
V, N = 6, 200_000


def as_the_step_gives(*tensors):
    """The inputs laid out as decode.merged_step gives them: the logits made anew at every step and Q
    the loop's own buffer (decode.Decoding.Q), each contiguous and neither read again after the call
    (the drafts, which it does read again, are the block's slice). Built here by .expand (stride 0,
    one element for a whole batch), they would refuse a right answer that views them (.view) or
    writes into them, which the step never does. None stays None."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def one_position(impl, Q, drafts, temperature, seed=0):
    """N rows of one block with a single draft (k = 2), target logits L (2, V) for every row:
    (emitted token after the bonus, accepted (N,), bonus (N,)) and p = softmax(L / T) (2, V)."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5
    accepted, n_acc, bonus = impl.verify_sampled(*as_the_step_gives(L.expand(N, 2, V), Q), drafts, temperature, g)
    emitted = torch.where(n_acc == 1, drafts[:, 0], bonus)
    return emitted, accepted[:, 0], bonus, F.softmax(L / temperature, -1)


def assert_follows(tokens, p, what, hint=''):
    if len(tokens) == 0:
        raise harness.Fail(f"{what}: there is no sample to test, want some", hint)
    stat, crit = harness.chi_square(torch.bincount(tokens, minlength=V).double(), p)
    if not stat < crit:
        raise harness.Fail(f"{what}: chi-square {stat:.0f}, want below {crit:.0f} (p < {harness.ALPHA:g}) over "
                           f"{len(tokens)} samples", hint)


ACCEPT_HINT = ("the drafts accepted are off (how many, or which tokens), against min(1, P(d) / Q(d)) with P at "
               "the temperature given. What fits: the ratio upside down, P at another temperature than T, the coin "
               "compared otherwise than u * Q(d) < P(d), or P or Q read at another token or position than the "
               "draft's")
RESIDUAL_HINT = ("the drafts are accepted as they should be, but the bonus after a rejection is not a sample of "
                 "norm(max(0, P - Q)) at the rejected position. What fits: the bonus drawn from P (Q not "
                 "subtracted), at another temperature than the test's, from another position than the rejected "
                 "one, or, for a point mass, a residual that keeps the draft's mass")


def off(tokens, probs):
    """Do tokens fail to follow probs (chi-square at ALPHA)? False where there is nothing to test
    (no tokens, or one possible token)."""
    if len(tokens) == 0 or (probs > 0).sum() < 2:
        return False
    stat, crit = harness.chi_square(torch.bincount(tokens, minlength=V).double(), probs / probs.sum())
    return stat > crit


def why_not_p(emitted, accepted, drafts, p, Q):
    """Which half of the rule is wrong, once the emitted token is known not to follow p: the
    accepted drafts (their rate and their tokens, min(P, Q)) or the bonus after a rejection (the
    residual). A hint, not a verdict: it runs only after the check has failed."""
    Q = F.one_hot(drafts[0, 0], V).double() if Q is None else Q[0, 0]
    both = torch.minimum(p, Q)
    n, rate = len(emitted), float(both.sum())
    z = (int(accepted.sum()) - n * rate) / max(n * rate * (1 - rate), 1e-12) ** 0.5
    if abs(z) > 4.4 or off(drafts[accepted, 0], both):        # 4.4 standard errors: p < 1e-5 as well
        return ACCEPT_HINT
    return RESIDUAL_HINT if off(emitted[~accepted], (p - Q).clamp(min=0)) else ''


def test_shapes_and_the_prefix(impl):
    """Shapes, and nothing past the first rejection. accepted is (B, k-1) bool and a prefix (no True
    after a False), n_acc its count, the bonus a token. Hint: the accepted prefix is exercise 1's
    (the drafts before the first refusal); only the test and the bonus change."""
    g = torch.Generator().manual_seed(1)
    B, k = 500, 5
    logits = torch.randn(B, k, V, generator=g, dtype=torch.float64)
    Q = F.softmax(torch.randn(B, k - 1, V, generator=g, dtype=torch.float64), -1)
    drafts = sample(Q, g)
    for rows in (1, B):   # one row: a single prompt
        accepted, n_acc, bonus = impl.verify_sampled(logits[:rows], Q[:rows], drafts[:rows], 1.0, g)
        assert accepted.shape == (rows, k - 1) and accepted.dtype == torch.bool, \
            f"accepted is {tuple(accepted.shape)} {accepted.dtype}, want (B, k-1) = {(rows, k - 1)} torch.bool"
        if not (n_acc.shape == (rows,) and bonus.shape == (rows,)):
            raise harness.Fail(f"n_acc is {tuple(n_acc.shape)}, bonus {tuple(bonus.shape)}, want (B,) = ({rows},) "
                               f"each", harness.ONE_ROW_HINT if rows == 1 else '')
    prefix = accepted.long().cumprod(-1).bool()
    bad = (accepted != prefix).any(-1).long().argmax()
    assert torch.equal(accepted, prefix), \
        f"row {int(bad)}: accepted {accepted[bad].tolist()}, want nothing after the first False: {prefix[bad].tolist()}"
    bad = (n_acc != accepted.sum(-1)).long().argmax()
    assert torch.equal(n_acc, accepted.sum(-1)), \
        f"row {int(bad)}: n_acc {int(n_acc[bad])}, want the number of accepted drafts {int(accepted[bad].sum())}"
    mean = n_acc.double().mean().item()
    if not 0 < mean < k - 1:
        raise harness.Fail(f"n_acc averaged {mean:.2f} over {B} rows, want between 0 and {k - 1} (some drafts "
                           f"accepted, some refused)", ACCEPT_HINT)
    assert ((bonus >= 0) & (bonus < V)).all(), f"the bonus is not a token: got {bonus[:8].tolist()}..., want 0..{V - 1}"


def test_the_first_token_follows_p(impl):
    """The first emitted token follows p. One draft per row, 200,000 rows: the token after the
    bonus (the draft if accepted, else the bonus) has exactly the target's distribution at T,
    for a proposal Q far from p (T = 0.7 and 1.3) and for a point-mass draft (Q None); a ratio of
    1e-4 accepted as rarely as it should, a draft of Q(d) = 1e-10 at its own ratio (no eps, no
    floor), and under bfloat16 autocast (float32 inputs, as
    generate.py --dtype bfloat16 gives) a ratio of 0.9985 refused as rarely as it should.
    Hint: P(emit x) = Q(x) min(1, P(x)/Q(x)) + P(reject) norm(max(0, P - Q))(x) = P(x): both
    halves, the test and the residual, at the same P."""
    g = torch.Generator().manual_seed(2)
    Q = F.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1).expand(N, 1, V)
    cases = [(Q, sample(Q, g), T, 3, f"T={T}, sampled drafts") for T in (0.7, 1.3)]
    cases.append((None, torch.full((N, 1), 2), 1.3, 4, "a point-mass draft (always token 2, Q(2) = 1)"))
    for qq, drafts, T, seed, what in cases:
        emitted, accepted, _, p = one_position(impl, qq, drafts, T, seed=seed)
        stat, crit = harness.chi_square(torch.bincount(emitted, minlength=V).double(), p[0])
        if not stat < crit:
            raise harness.Fail(f"{what}: the first token is not the target's: chi-square {stat:.0f}, want below "
                               f"{crit:.0f} (p < {harness.ALPHA:g}) over {N} samples",
                               why_not_p(emitted, accepted, drafts, p[0], qq))
    # a rare acceptance, P(d) / Q(d) = 1e-4 in 10^6 rows: 100 expected, 59 to 147 allowed. A coin on a
    # coarse grid accepts whatever falls below its first step: float16's uniforms (2^-11 apart) accept
    # about 3.4 times too often here, bfloat16's (2^-8) about 20 times; at a ratio of 0.002 float16 is
    # only 1.1 times off, lost in the noise. Two tokens (V = 2) keep the million rows cheap
    n, ratio = 1_000_000, 1e-4
    L = torch.zeros(2, 2, dtype=torch.float64)
    L[0, 0] = math.log(0.5 * ratio / (1 - 0.5 * ratio))                  # P(0) = ratio / 2 at T = 1
    P0 = float(F.softmax(L[0], -1)[0])
    Q = torch.tensor([P0 / ratio, 1 - P0 / ratio], dtype=torch.float64)  # Q(0) = 0.5
    accepted, _, _ = impl.verify_sampled(*as_the_step_gives(L.expand(n, 2, 2), Q.expand(n, 1, 2)),
                                         torch.zeros(n, 1, dtype=torch.long),
                                         1.0, torch.Generator().manual_seed(5))
    count, (lo, hi) = int(accepted.sum()), binomial_range(n, ratio)
    if not lo <= count <= hi:
        raise harness.Fail(f"a draft with P(d) / Q(d) = {ratio:g}, drafted in {n} rows: accepted {count} times, want "
                           f"about {n * ratio:.0f} ({lo} to {hi})", "the test accepts with probability min(1, "
                           "P(d) / Q(d)) exactly. What fits: a coin too coarse for a small ratio (drawn in float16 or "
                           "bfloat16: every u below its grid's first step accepts), or the ratio taken otherwise than "
                           "P(d) / Q(d)")
    # a draft of small Q: Q(d) = 1e-10, P(d) = 5e-11 (a ratio of 0.5), in 20,000 rows: 10,000 accepted expected,
    # 9,688 to 10,312 allowed. An eps added to Q(d) (P(d) / (Q(d) + eps), or log(P + eps) - log(Q + eps)) or a floor
    # under it moves the ratio: eps = 1e-11 accepts 9% too rarely, 1e-8 (a common habit) 100 times too rarely;
    # torch.finfo's tiny, or an eps of 1e-13 or less, moves it by 0.1% or less
    n, q, half = 20_000, 1e-10, 0.5
    L = torch.zeros(2, 2, dtype=torch.float64)
    L[0, 0] = math.log(half * q / (1 - half * q))                         # P(0) = q / 2 at T = 1
    Q = torch.tensor([q, 1 - q], dtype=torch.float64)                    # Q(0) = 1e-10
    accepted, _, _ = impl.verify_sampled(*as_the_step_gives(L.expand(n, 2, 2), Q.expand(n, 1, 2)),
                                         torch.zeros(n, 1, dtype=torch.long), 1.0, torch.Generator().manual_seed(12))
    count, (lo, hi) = int(accepted.sum()), binomial_range(n, float(F.softmax(L[0], -1)[0]) / q)
    if not lo <= count <= hi:
        raise harness.Fail(f"a draft with Q(d) = {q:g} and P(d) / Q(d) = {half:g}, drafted in {n} rows: accepted "
                           f"{count} times, want about {n * half:.0f} ({lo} to {hi})", "the test accepts with "
                           "probability min(1, P(d) / Q(d)) exactly, for a Q(d) as small as a float can hold: u * Q(d) "
                           "< P(d) divides by nothing, and a drafted token has Q(d) > 0. What fits: an eps added to "
                           "Q(d) (P(d) / (Q(d) + eps), or log(P + eps) - log(Q + eps)), or Q(d) clamped to a floor: a "
                           "draft of small Q is then accepted at another ratio, and the output is not the target's. "
                           "torch.finfo(dtype).tiny as a floor changes nothing")
    # under bfloat16 autocast (float32 logits and Q), a ratio P(d) / Q(d) = 1 - 0.0015: 300 refusals expected
    # in 200,000 rows, 227 to 379 allowed. A P(d) or Q(d) that comes out of a matrix product lands on
    # bfloat16's grid (0.3 is 0.3008 there, 0.2996 is 0.2988, 0.9985 is 1) and the ratio with it: none
    # refused, or 2.6 to 5 times as many; so does a P normalised by a product (e @ ones)
    eps = 0.0015
    q = torch.tensor([0.3] + [0.14] * (V - 1), dtype=torch.float64)
    p = torch.cat([q[:1] * (1 - eps), q[1:] + q[0] * eps / (V - 1)])     # P(d) / Q(d) = 1 - eps at d = 0
    point = torch.tensor([1 - eps] + [eps / (V - 1)] * (V - 1), dtype=torch.float64)
    lo, hi = binomial_range(N, eps)
    for first, Q, what in ((p, q, 'sampled drafts, Q(d) = 0.3'), (point, None, 'a point-mass draft, Q(d) = 1')):
        accepted, _, _ = under_autocast(impl, torch.stack([first, p]).log(), Q, seed=11)
        count = N - int(accepted.sum())
        if not lo <= count <= hi:
            raise harness.Fail(f"under bfloat16 autocast (generate.py --dtype bfloat16), float32 logits, {what}: a "
                               f"draft with P(d) / Q(d) = {1 - eps:g}, drafted in {N} rows, was refused {count} "
                               f"times, want about {N * eps:.0f} ({lo} to {hi})", AUTOCAST)


AUTOCAST = ("autocast runs a matrix product of float32 tensors (einsum, @, bmm, matmul, linalg.vecdot) in bfloat16, "
            "3 significant digits: P(d) or Q(d) read through one (a product with a one-hot), or P normalised by one "
            "(e @ ones), is up to 0.4% off, and so is the chance of accepting. What fits: such a product, or autocast "
            "switched off on another device than the logits' (torch.autocast('cuda', ...) on a CPU); read with "
            "gather (or multiply elementwise and sum), or switch autocast off on the logits' device "
            "(torch.autocast(logits.device.type, enabled=False))")


def under_autocast(impl, L, Q, seed):
    """verify_sampled over N rows of one draft (token 0) under bfloat16 autocast, with float32 logits L
    (2, V) and Q (V,) or None, at T = 1: as generate.py --dtype bfloat16 calls it (decode upcasts the
    target's logits to float32, the drafters give Q in float32, and the whole step runs in autocast)."""
    L, Q = as_the_step_gives(L.float().expand(N, 2, V), None if Q is None else Q.float().expand(N, 1, V))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        return impl.verify_sampled(L, Q, torch.zeros(N, 1, dtype=torch.long), 1.0, torch.Generator().manual_seed(seed))


def binomial_range(n, r, alpha=harness.ALPHA):
    """The counts (lo, hi) between which a Binomial(n, r) count falls but with probability alpha (at
    most alpha / 2 a side), from its exact law: a rare event's count is skewed, and 4.4 standard
    errors about a mean of 100 would fail a right answer once in 45,000 runs, not 100,000."""
    top = int(n * r + 20 * (n * r * (1 - r)) ** 0.5 + 50)
    log_pmf = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(r)
               + (n - k) * math.log1p(-r) for k in range(top + 1))
    cdf = list(itertools.accumulate(math.exp(x) for x in log_pmf))
    return (next(k for k, c in enumerate(cdf) if c > alpha / 2),
            next(k for k, c in enumerate(cdf) if 1 - c <= alpha / 2))


def test_after_an_accepted_block_the_bonus_follows_p(impl):
    """The bonus after a full block follows p. When every draft is accepted, the bonus is a sample
    of the target's distribution after the last position, at T; under bfloat16 autocast (float32
    logits) too. Hint: after a full block the bonus follows another law than P_{k-1} at T: what
    fits is a draw at another temperature (1, or T twice), from another position's logits, or from
    a residual rather than from P."""
    g = torch.Generator().manual_seed(5)
    Q = F.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1).expand(N, 1, V)
    drafts = sample(Q, g)
    _, accepted, bonus, p = one_position(impl, Q, drafts, 0.7, seed=6)
    rate = accepted.float().mean().item()
    if not rate > 0.2:
        raise harness.Fail(f"your code accepted {rate:.1%} of the drafts, want about "
                           f"{float(torch.minimum(p[0], Q[0, 0]).sum()):.0%}", ACCEPT_HINT)
    assert_follows(bonus[accepted], p[1], "after an accepted draft the bonus is not the target's sample")
    # under bfloat16 autocast (float32 logits), Q = P at the draft (every draft accepted) and after it 0.0019
    # of mass beside 0.56: a cumulative sum taken by a matrix product (w @ a triangular matrix of ones) lands
    # on bfloat16's grid, 0.0039 apart there, and the small token is never drawn; weights normalised by a
    # product (w @ ones: 0.996 here) leave an inverse CDF of u in [0, 1) 0.4% of mass short or over
    last = torch.tensor([0.56, 0.0019, 0.1898, 0.1448, 0.0835, 0.02], dtype=torch.float64)
    L = torch.stack([torch.randn(V, generator=g, dtype=torch.float64), last.log()])
    accepted, _, bonus = under_autocast(impl, L, F.softmax(L[0].float(), -1), seed=13)
    assert_follows(bonus[accepted[:, 0]], last, "under bfloat16 autocast (generate.py --dtype bfloat16), float32 "
                   "logits: after an accepted draft the bonus is not the target's sample",
                   "autocast runs a matrix product of float32 tensors (@, einsum, bmm, matmul) in bfloat16, 3 "
                   "significant digits: a cumulative sum taken by one (a triangular matrix of ones) rounds a "
                   "token of 0.0019 after 0.56 of mass away, and weights normalised by one (w @ ones) sum to "
                   "1 +- 0.4%. What fits: an inverse CDF built so; model.sample, or cumsum and the row's own "
                   "total, are exact (or switch autocast off on the logits' device)")


def test_p_equal_to_q(impl):
    """p equal to Q: no division by zero. The residual max(0, p - Q) is zero everywhere; the bonus
    must still be a valid token (a rejection never happens there, but a step may draw every
    position's candidate)."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 3, V, generator=g, dtype=torch.float64)
    Q = F.softmax(logits[:, :-1] / 0.9, -1)                              # exactly p at T = 0.9
    accepted, n_acc, bonus = impl.verify_sampled(logits, Q, sample(Q, g), 0.9, g)
    if not accepted.all():
        raise harness.Fail(f"Q is p at T = 0.9, yet {int((~accepted).sum())} of {accepted.numel()} drafts were "
                           f"refused, want none", "with Q = P the test u * Q(d) < P(d) always passes: if it does "
                           "not, P is not softmax(logits / T) at the temperature given (or the test compares "
                           "something else)")
    if not ((bonus >= 0) & (bonus < V)).all():
        raise harness.Fail(f"the bonus is not a token: got {bonus[:8].tolist()}..., want tokens in 0..{V - 1}",
                           "the residual max(0, P - Q) sums to 0 here, and the bonus drawn from it is no token. "
                           "What fits: a normalisation that divides 0 by 0 (NaN weights), with nothing where the "
                           "residual is zero; the statement says what the bonus is then")


def test_a_residual_rounded_to_zero_falls_back_to_p(impl):
    """A residual that rounding leaves all zero falls back to P, row by row, at T = 0.7. Blocks of
    two drafts: a batch mixes rows whose first Q is P (1 + 2^-8) at every token (a bf16 softmax's
    rows can sum to 1 + 2^-8: max(0, P - Q) is 0 everywhere, yet u Q(d) >= P(d) refuses a draft
    about once in 257) with rows of a Q far from P, and every row's second Q is far from P. After a
    refusal of the first draft the bonus is a sample of P in the first rows (about 780 refusals in
    200,000 rows), of norm(max(0, P - Q)) in the others (50,000 rows), and after the second draft's
    refusal, of its residual in every row. A residual small but not zero (0.01 of mass all on one
    token; 1e-7) is the residual still: after every refusal, that token."""
    g, T = torch.Generator().manual_seed(10), 0.7
    L = torch.randn(3, V, generator=g, dtype=torch.float64) * 1.5
    p = F.softmax(L / T, -1)
    far = F.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1)
    rows = N + N // 4
    rounded = torch.arange(rows) % 5 != 0                                # 4 rows in 5: P (1 + 2^-8)
    first = torch.where(rounded[:, None], p[0] * (1 + 2 ** -8), far)
    Q = torch.stack([first, far.expand(rows, V)], dim=1)                 # (rows, 2, V)
    drafts = torch.cat([torch.where(rounded[:, None], sample(p[:1].expand(rows, 1, V), g),
                                    sample(Q[:, :1], g)), sample(Q[:, 1:], g)], dim=1)
    _, n_acc, bonus = impl.verify_sampled(*as_the_step_gives(L.expand(rows, 3, V), Q), drafts, T, g)
    refused = n_acc == 0
    if (refused & rounded).any():   # (an answer that renormalises Q refuses nothing there: nothing to fall back from)
        assert_follows(bonus[refused & rounded], p[0], f"in the rows where max(0, P - Q) is 0 everywhere at the first "
                       f"draft, beside rows where it is not, the bonus after the {int((refused & rounded).sum())} "
                       f"refusals is not a sample of P at T={T}", "where the residual sums to 0 the bonus is a sample "
                       "of P (the statement); here it follows another law. What fits: no fallback at all (a draw from "
                       "an all-zero row gives its last index), a normalisation that divides 0 by 0, a fallback to P at "
                       "another temperature than T, or a fallback decided once for the whole batch, or for a row's "
                       "whole block (this batch mixes those rows with rows whose residual is not zero, and the second "
                       "position's residual is not zero in any row)")
    residual = (p[0] - far).clamp(min=0)
    assert_follows(bonus[refused & ~rounded], residual / residual.sum(), f"in the rows of a Q far from P, beside rows "
                   f"whose residual is 0, the bonus after the {int((refused & ~rounded).sum())} refusals is not a "
                   f"sample of norm(max(0, P - Q))", "these rows' residual is not zero, yet their bonus follows "
                   "another law. What fits: a fallback to P decided for the whole batch (one all-zero row then sends "
                   "every row to P), or decided by something else than the row's own residual")
    # the second position, whose residual is not zero in any row: after the first draft accepted and
    # the second refused, the bonus is that residual's sample, in the rows whose first residual is 0 too
    second = (p[1] - far).clamp(min=0)
    assert_follows(bonus[rounded & (n_acc == 1)], second / second.sum(), f"in the rows whose first residual is 0 "
                   f"and second is not, the bonus after the {int((rounded & (n_acc == 1)).sum())} refusals of the "
                   f"second draft is not a sample of norm(max(0, P - Q)) there", "the fallback to P is decided "
                   "position by position: a zero residual at the first position says nothing of the second's. What "
                   "fits: a fallback decided once for a row's whole block, when any of its positions' residuals is "
                   "zero, or when its first one is")
    # a small residual: Q takes 0.01 of P's mass from token `to` and gives it to `fro`, so that
    # max(0, P - Q) is 0.01 at `to` and 0 elsewhere; only a draft of `fro` can be refused
    fro, to = p[0].topk(2).indices.tolist()                              # P's two likeliest: 0.35 and 0.28
    small = (p[0] + 0.01 * (F.one_hot(torch.tensor(fro), V) - F.one_hot(torch.tensor(to), V))).expand(N, 1, V)
    the_residual_is_kept(impl, L[:2], small, sample(small, g), T, g, to, 0.01)
    # smaller still, and float32 resolves it: P(a) = 1e-9 drafted by Q(a) = P(a) + 1e-7, the 1e-7 taken
    # from token b (P(b) about 1e-3): 99% of the drafts refused, and the residual is all on b
    a, b, n = 0, 1, 2000
    probs = torch.tensor([1e-9, 1e-3] + [(1 - 1e-3 - 1e-9) / (V - 2)] * (V - 2), dtype=torch.float64)
    tiny = (probs + 1e-7 * (F.one_hot(torch.tensor(a), V) - F.one_hot(torch.tensor(b), V))).expand(n, 1, V)
    the_residual_is_kept(impl, probs.log().expand(2, V), tiny, torch.full((n, 1), a), 1.0, g, b, 1e-7)   # P: probs


def the_residual_is_kept(impl, L, Q, drafts, T, g, to, size):
    """One draft a row, a residual max(0, P - Q) of `size`, all on token `to`: after every refusal
    the bonus is `to` (a residual small but not zero is no reason to fall back to P)."""
    n = len(drafts)
    _, n_acc, bonus = impl.verify_sampled(*as_the_step_gives(L.expand(n, 2, V), Q), drafts, T, g)
    got = bonus[n_acc == 0]
    if len(got) == 0 or not (got == to).all():
        raise harness.Fail(f"a residual of {size:g}, all on token {to}: after {len(got)} refusals the bonus was "
                           f"{torch.bincount(got, minlength=V).tolist()} (counts per token), want token {to} every "
                           f"time", "a residual small but not zero is the residual still (the statement): what fits "
                           f"is a fallback to P decided by a tolerance (one of {size:g} or more) rather than by a "
                           f"residual of exactly 0" if len(got) else ACCEPT_HINT)


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device. For sampled drafts (Q given) and
    for point masses (Q None), given a generator or None: nothing makes the host wait for the
    device, as many ops for 6 rows or 8 positions as for 3 rows of 5, and no tensor is made off the logits' device (run on PyTorch's
    'meta' device, which refuses a mix of devices as CUDA does), nor, given generator=None, drawn
    from a generator of another device (torch.default_generator is the CPU's)."""
    g = torch.Generator().manual_seed(8)
    logits, Q, drafts = sized(8, 4, Q_given=True)
    point_mass = ("only the point-mass path syncs: something there reads a value on the host (F.one_hot without "
                  "its num_classes, for one, reads the largest draft there)")
    for qq, what, hint in ((Q, 'sampled drafts (Q given)', ''), (None, 'point-mass drafts (Q None)', point_mass)):
        for gen in (g, None):      # generator=None: what a compiled step always gets
            with harness.HostSyncs() as syncs, torch.random.fork_rng(devices=[]):
                impl.verify_sampled(logits, qq, drafts, 1.0, gen)
            if syncs.seen:
                raise harness.Fail(f"{what}{', given generator=None' * (gen is None)}: host syncs "
                                   f"{', '.join(sorted(set(syncs.seen)))}, want none", hint or (
                                       NONE_SYNC_HINT if gen is None else SYNC_HINT))
    for given, what in ((True, 'sampled drafts (Q given)'), (False, 'point-mass drafts (Q None)')):
        harness.assert_no_python_loop(what, [(f'B={B}, k={k}', lambda B=B, k=k: impl.verify_sampled(
            *sized(B, k, given), 1.0, torch.Generator().manual_seed(0))) for B, k in ((3, 5), (6, 5), (3, 8))])
    meta = [harness.on_meta(t) for t in (logits, Q, drafts)]
    for qq, what in ((meta[1], 'sampled drafts (Q given)'), (None, 'point-mass drafts (Q None)')):
        harness.assert_on_the_inputs_device(what, lambda: impl.verify_sampled(meta[0], qq, meta[2], 1.0, None))


def test_real_sizes_and_nothing_kept(impl):
    """A GPT-2 vocabulary, and nothing kept between calls. At the project's sizes (V = 50,304, 16
    rows, k = 64; run on PyTorch's 'meta' device, which allocates nothing) no tensor holds more than
    a few times the logits' elements; and five calls keep no more of the tensors they make, nor
    more bytes, than one call (a list appended to at every call grows with the tokens decoded)."""
    B, k, big = 16, 64, 50304
    logits = torch.empty(B, k, big, device='meta')
    Q, drafts = torch.empty(B, k - 1, big, device='meta'), torch.zeros(B, k - 1, dtype=torch.long, device='meta')
    for qq, what in ((Q, 'sampled drafts (Q given)'), (None, 'point-mass drafts (Q None)')):
        most, op = harness.largest_on_meta(lambda: impl.verify_sampled(logits, qq, drafts, 1.0, None))
        if most > 4 * logits.numel():
            raise harness.Fail(
                f"{what}, V = {big}, B = {B}, k = {k}: {op} made a tensor of {most:,} elements, want none above 4 "
                f"times the logits' {logits.numel():,} (the reference's largest is the logits' size)",
                "a tensor of V x V elements (a triangular matrix of ones for a cumulative sum by a matrix product, "
                "an outer comparison of the vocabulary with itself) is 2.5e9 elements at a GPT-2 vocabulary, 10 GB "
                "in float32, and a product with it B k V^2 operations a step: cumsum (or model.sample) costs B k V")
    for Q_given, what in ((True, 'sampled drafts (Q given)'), (False, 'point-mass drafts (Q None)')):
        harness.assert_keeps_nothing(what, lambda i: impl.verify_sampled(*sized(3, 5, Q_given), 1.0,
                                                                         torch.Generator().manual_seed(i)))


def sized(B, k, Q_given):
    """Logits (B, k, V), Q (B, k-1, V) or None, and drafts (B, k-1) drawn from Q."""
    g = torch.Generator().manual_seed(B * 100 + k)
    logits = torch.randn(B, k, V, generator=g, dtype=torch.float64)
    Q = F.softmax(torch.randn(B, k - 1, V, generator=g, dtype=torch.float64), -1)
    return logits, Q if Q_given else None, sample(Q, g)


SYNC_HINT = ("the ops listed make the host wait for the device: a value read back (.item(), int() or bool() of a "
             "tensor, a Python if on one), a shape that depends on the data (boolean indexing, nonzero; x[mask] = a "
             "number is none: a GPU runs it as masked_fill_), or a draw that checks its input on the host "
             "(torch.multinomial does, on a GPU); which position a row's bonus comes from is known only on the device")


NONE_SYNC_HINT = ("only the generator=None path syncs, the one a compiled step always takes (generate.py --compile): "
                  "what fits is a generator of your own made there and seeded from a value read back (int() or "
                  ".item() of a draw); draw from the global RNG of the logits' device instead (torch.rand(..., "
                  "generator=None, device=...), model.sample(w, None))")


def differ(a, b):
    """How many rows of two (accepted, n_acc, bonus) differ anywhere."""
    return int(torch.stack([(x != y).reshape(len(x), -1).any(-1) for x, y in zip(a, b)]).any(0).sum())


def test_the_same_seed_gives_the_same_output(impl):
    """The same seed gives the same output. Generators seeded alike give identical accepted, n_acc
    and bonus whatever state the global RNG is in, and a generator seeded otherwise gives other
    ones, for sampled drafts and point masses, and a call given a generator leaves the global RNG
    as it was; with no generator (None) the draws come from the global RNG: seeded otherwise, other
    draws, seeded alike, the same, and a call right after another, other draws. Hint: the same
    generator gave other draws: some random number came from the global RNG (the coins, or the
    bonuses, drawn without `generator`), which makes the distribution right but the text
    unrepeatable."""
    g = torch.Generator().manual_seed(9)
    B = 400
    logits = torch.randn(B, 4, V, generator=g, dtype=torch.float64) * 1.5
    Q = F.softmax(torch.randn(B, 3, V, generator=g, dtype=torch.float64), -1)
    for qq, drafts, what in ((Q, sample(Q, g), 'sampled drafts'),
                             (None, logits[:, :-1].argmax(-1), 'point-mass drafts')):
        runs = []
        with torch.random.fork_rng(devices=[]):                           # the caller's global RNG untouched
            for global_seed, seed in ((1, 0), (2, 0), (1, 1)):
                torch.manual_seed(global_seed)
                runs.append(impl.verify_sampled(*as_the_step_gives(logits.clone(), None if qq is None else qq.clone()),
                                                drafts, 1.0, torch.Generator().manual_seed(seed)))   # each its own
        harness.assert_leaves_torch_alone(
            f"{what}, given a generator,", lambda: impl.verify_sampled(
                *as_the_step_gives(logits.clone(), None if qq is None else qq.clone()), drafts, 1.0,
                torch.Generator().manual_seed(0)),
            "given a generator, every random number comes from it, and the global RNG is the caller's: what fits is "
            "torch.manual_seed (say from generator.initial_seed()) or torch.seed() inside the call, which reseeds "
            "the caller's random stream at every step, or a draw without generator= that the output does not show")
        if differ(runs[0], runs[1]):
            raise harness.Fail(f"{what}: the same generator seed, the global RNG seeded otherwise: "
                               f"{differ(runs[0], runs[1])} of {B} rows differ, want 0")
        if not differ(runs[0], runs[2]):
            raise harness.Fail(f"{what}: generators seeded 0 and 1 gave identical outputs in all {B} rows, want "
                               f"other draws", "the draws ignore `generator` (a fixed seed, or no draw at all?): "
                               "the coins and the bonuses are random, drawn from it")
    # no generator (decode.generate's default): every draw from the global RNG, as torch's own draws do
    # given generator=None; it must run, and another global seed must give other draws
    none_hint = ("generator=None means the global RNG: torch.rand(..., generator=None) and model.sample(w, None) "
                 "draw from it. What fits: something read off the generator (its .device, a seed) that None has "
                 "not, or a generator of your own made when none is given (never seeded: the same draws each call; "
                 "seeded by torch.seed() or the clock: other draws for the same global seed), the global RNG "
                 "reseeded inside the call (torch.manual_seed: the same draws whatever the caller's seed), or the "
                 "draws wrapped in torch.random.fork_rng (the global RNG put back after each call: every call draws "
                 "the same numbers, and a decode's steps repeat their coins)")
    runs, drafts = [], sample(Q, g)
    with torch.random.fork_rng(devices=[]):
        for global_seed in (1, 2, 1, None):            # None: the call right after the last, not reseeded
            if global_seed is not None:
                torch.manual_seed(global_seed)
            try:
                runs.append(impl.verify_sampled(logits.clone(), Q.clone(), drafts, 1.0, None))
            except NotImplementedError:
                raise                                                     # not written yet, or an op torch lacks
            except Exception as e:
                raise harness.Fail(f"with generator=None: {type(e).__name__}: {first_line(e)}"
                                   f"{harness.where_in_student(e)}; want draws from the global RNG", none_hint)
    if not differ(runs[0], runs[1]):
        raise harness.Fail(f"with generator=None, the global RNG seeded 1 then 2: identical outputs in all {B} rows, "
                           f"want other draws", none_hint)
    if differ(runs[0], runs[2]):
        raise harness.Fail(f"with generator=None, the global RNG seeded 1 twice: {differ(runs[0], runs[2])} of {B} "
                           f"rows differ, want none (the same seed, the same text)", none_hint)
    if not differ(runs[2], runs[3]):
        raise harness.Fail(f"with generator=None, two calls in a row (the global RNG not reseeded between them): "
                           f"identical outputs in all {B} rows, want other draws (each call draws on from the "
                           f"global RNG, as torch's draws do)", none_hint)


def test_lossless_through_generate(impl):
    """Lossless through decode.generate. Speculative sampling with BPD heads that sample their
    drafts, and with argmax drafts: every 3-token continuation of the enumerable world's prompt
    comes out with the target's exact probability (chi-square, 20,000 samples).
    Hint: the checks above test one block at a time, and say which half of the rule is off; if they
    pass and this fails, what fits is something that holds for one draft per block only (they
    mostly use k = 2; here k = 4): the prefix, the position the bonus is taken at, or one uniform
    shared by several drafts or by a test and a draw (each needs a uniform of its own)."""
    model = harness.target8()
    for sample_drafts, T in ((True, 1.3), (False, 0.8)):
        heads = harness.peaky(BlockHeads(model.config, 4, sample_drafts=sample_drafts), 0.3, 1)
        hint = '' if sample_drafts else ("with argmax drafts (Q None, a point mass) the output is off. What fits: "
                                         "the point mass taken otherwise than Q(d) = 1 (in the test, or a residual "
                                         "that keeps the draft's mass), or P at another temperature than the T "
                                         "given (0.8 here)")
        harness.assert_lossless(model, heads, T, what=f"{'sampled' if sample_drafts else 'argmax'} drafts, T={T}: ",
                                hint=hint)


def try_it(impl, tryout):
    """DBlast K = 4 at T = 1.5 and BPD heads at T = 1 on train.py's target: yours next to the
    reference (in a handout, the target alone), and a chi-square p-value of the second token of
    4,000 decodes of one prompt against its exact distribution."""
    rows, missing = [], []
    for name, T in (('dblast_K4.pt', 1.5), ('heads.pt', 1.0)):
        try:
            drafter = tryout.drafter(name)
        except BadInput as e:   # in a handout, the DBlast drafter needs exercises 5 and 6 first
            missing.append(str(e))
            continue
        rows += tryout.pair(name, T, p_value=True, drafter=drafter, k=4)
    if not rows:
        raise BadInput(missing[0])
    tryout.table(rows, extra=[('p-value, 2nd token (4000 decodes)', 'p')])
    for why in missing:
        print(f"\n(left out: {why})")
