"""Exercise 2's checks: lossless speculative sampling (README.md)."""
import torch
import torch.nn.functional as F

import decode
from exercises import harness
from heads import BlockHeads

NAMES = ('verify_sampled',)
SEAMS = {'decode.verify_sampled': 'verify_sampled'}
REFERENCE = {'verify_sampled': 'decode.verify_sampled'}
V, N = 6, 200_000


def one_position(impl, q, drafts, temperature, seed=0):
    """N rows of one block with a single draft (k = 2), target logits L (2, V) for every row:
    (emitted token after the bonus, accepted (N,), bonus (N,)) and p = softmax(L / T) (2, V)."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5
    accepted, n_acc, bonus = impl.verify_sampled(L.expand(N, 2, V), q, drafts, temperature, g)
    emitted = torch.where(n_acc == 1, drafts[:, 0], bonus)
    return emitted, accepted[:, 0], bonus, F.softmax(L / temperature, -1)


def assert_follows(tokens, p, what):
    stat, crit = harness.chi_square(torch.bincount(tokens, minlength=V).double(), p)
    assert stat < crit, f"{what}: chi-square {stat:.0f} > {crit:.0f} (p < {harness.ALPHA:g}) over {len(tokens)} samples"


def test_shapes_and_the_prefix(impl):
    """Shapes, and nothing past the first rejection. accepted is (B, k-1) bool and a prefix (no True
    after a False), n_acc its count, the bonus a token. Hint: the accepted prefix is the same as
    in exercise 1 (decode.accept_prefix); only the test and the bonus change."""
    g = torch.Generator().manual_seed(1)
    B, k = 500, 5
    logits = torch.randn(B, k, V, generator=g, dtype=torch.float64)
    q = F.softmax(torch.randn(B, k - 1, V, generator=g, dtype=torch.float64), -1)
    drafts = decode.sample(q, g)
    accepted, n_acc, bonus = impl.verify_sampled(logits, q, drafts, 1.0, g)
    assert accepted.shape == (B, k - 1) and accepted.dtype == torch.bool, "accepted should be (B, k-1) bool"
    assert n_acc.shape == (B,) and bonus.shape == (B,), "n_acc and bonus should be (B,)"
    assert torch.equal(accepted, accepted.long().cumprod(-1).bool()), "a draft after a rejection was accepted"
    assert torch.equal(n_acc, accepted.sum(-1)), "n_acc is not the number of accepted drafts"
    assert 0 < n_acc.float().mean() < k - 1, "every draft was accepted, or none: the test draws nothing"
    assert ((bonus >= 0) & (bonus < V)).all(), "the bonus is not a token"


def test_the_first_token_follows_p(impl):
    """The first emitted token follows p. One draft per row, 200,000 rows: the token after the
    bonus (the draft if accepted, else the bonus) has exactly the target's distribution at T,
    for a proposal q far from p (T = 0.7 and 1.3) and for a point-mass draft (q None).
    Hint: P(emit x) = Q(x) min(1, P(x)/Q(x)) + P(reject) norm(max(0, P - Q))(x) = P(x); the
    bonus after a rejection must come from the residual, tempered like P."""
    g = torch.Generator().manual_seed(2)
    q = F.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, -1).expand(N, 1, V)
    for T in (0.7, 1.3):
        drafts = decode.sample(q, g)
        emitted, _, _, p = one_position(impl, q, drafts, T, seed=3)
        assert_follows(emitted, p[0], f"T={T}, sampled drafts: the first token is not the target's")
    drafts = torch.full((N, 1), 2)                                       # always token 2, Q(2) = 1
    emitted, _, _, p = one_position(impl, None, drafts, 1.3, seed=4)
    assert_follows(emitted, p[0], "a point-mass draft: the first token is not the target's")


def test_after_an_accepted_block_the_bonus_follows_p(impl):
    """The bonus after a full block follows p. When every draft is accepted, the bonus is a sample
    of the target's distribution after the last position, at T. Hint: P_{k-1} = softmax(logits[:, -1] / T),
    the same temperature as everywhere else."""
    g = torch.Generator().manual_seed(5)
    q = F.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1).expand(N, 1, V)
    drafts = decode.sample(q, g)
    _, accepted, bonus, p = one_position(impl, q, drafts, 0.7, seed=6)
    assert accepted.float().mean() > 0.2, "almost nothing accepted: the test draws nothing"
    assert_follows(bonus[accepted], p[1], "after an accepted draft the bonus is not the target's sample")


def test_p_equal_to_q(impl):
    """p equal to q: no division by zero. The residual max(0, p - q) is zero everywhere; the bonus
    must still be a valid token (a rejection never happens there, but the step draws every
    position's candidate at once). Hint: fall back to p where the residual sums to zero."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 3, V, generator=g, dtype=torch.float64)
    q = F.softmax(logits[:, :-1] / 0.9, -1)                              # exactly p at T = 0.9
    accepted, n_acc, bonus = impl.verify_sampled(logits, q, decode.sample(q, g), 0.9, g)
    assert accepted.all(), "with q = p every draft must be accepted"
    assert ((bonus >= 0) & (bonus < V)).all(), f"the bonus is not a token: {bonus[:8].tolist()}"


def test_no_host_sync(impl):
    """No host sync. Hint: draw every candidate bonus at once and gather the one at n_acc."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 4, V, generator=g, dtype=torch.float64)
    q = F.softmax(torch.randn(8, 3, V, generator=g, dtype=torch.float64), -1)
    drafts = decode.sample(q, g)
    with harness.HostSyncs() as syncs:
        impl.verify_sampled(logits, q, drafts, 1.0, g)
    assert not syncs.seen, f"host syncs: {', '.join(sorted(set(syncs.seen)))}"


def test_lossless_through_generate(impl):
    """Lossless through decode.generate. Speculative sampling with BPD heads that sample their
    drafts, and with argmax drafts: every 3-token continuation of the enumerable world's prompt
    comes out with the target's exact probability (chi-square, 20,000 samples).
    Hint: if the checks above pass, look at what merged_step gives you: q is None for argmax drafts."""
    model = harness.target8()
    for sample_drafts, T in ((True, 1.3), (False, 0.8)):
        heads = harness.peaky(BlockHeads(model.config, 4, sample_drafts=sample_drafts), 0.3, 1)
        harness.assert_lossless(model, heads, T, what=f"{'sampled' if sample_drafts else 'argmax'} drafts, T={T}: ")


def try_it(impl, tryout):
    """DBlast K = 4 at T = 1.5 and BPD heads at T = 1 on train.py's target: yours next to the project's,
    and a chi-square p-value of the second token over many decodes of one prompt."""
    rows = []
    for name, T in (('dblast_K4.pt', 1.5), ('heads.pt', 1.0)):
        d = tryout.drafter(name)
        for label, yours in (('project', False), ('yours', True)):
            row = tryout.row(f"{label}, {name}", yours, T, drafter=d, k=4)
            row['p'] = f"{tryout.second_token_p(yours, d, T):.3f}"
            rows.append(row)
    tryout.table(rows, extra=[('p-value, 2nd token (4000 decodes)', 'p')])
