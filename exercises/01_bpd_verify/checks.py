"""Exercise 1's checks: BPD verification (README.md). Each check is a function of `impl`, the code
under test (student.py, or the reference with --solution)."""
import torch

import decode
from exercises import harness
from heads import BlockHeads

NAMES = ('verify_greedy',)                            # what student.py defines
SEAMS = {'decode.verify_greedy': 'verify_greedy'}     # where decode.merged_step calls it
REFERENCE = {'verify_greedy': 'decode.verify_greedy'}   # in a handout: a call of student.py
# the rest of the answer, left out of a handout (exercises/handout.py), and what the student may use
STUBS = {'decode.accept_prefix': "what a step keeps, the drafts before the first refusal and the bonus there: "
                                 "verify_greedy's own work"}
MAY_USE = ('decode.exact', 'decode.top_n', 'decode.min_block', 'decode.ACCEPT')
EXACT = (decode.exact, None)


def scripted(greedy, V, seed=0):
    """Logits (B, k, V) whose argmax at every position is greedy (B, k), the rest noise below it."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(greedy.shape + (V,), generator=g, dtype=torch.float64)
    return noise + 3.0 * torch.nn.functional.one_hot(greedy, V)


def planted(k=6, V=11):
    """Greedy tokens (B, k) and drafts (B, k-1) that agree with them except one wrong draft per row,
    planted at the first, a middle and the last draft (rows 0, 1, 2); row 3 has none."""
    greedy = torch.randint(V, (4, k), generator=torch.Generator().manual_seed(1))
    drafts = greedy[:, :-1].clone()
    wrong_at = [0, (k - 1) // 2, k - 2, None]
    for row, j in enumerate(wrong_at):
        if j is not None:
            drafts[row, j] = (drafts[row, j] + 1) % V
    return greedy, drafts, wrong_at


def an_index(t):
    """A tensor that can index: torch.long (the project's) or int32, the dtypes gather takes. Not
    bool, not floating point, not the narrower integers (decode.generate gathers with n_acc)."""
    return isinstance(t, torch.Tensor) and t.dtype in (torch.long, torch.int32)


def assert_outputs(accepted, n_acc, bonus, B, k):
    """What verify_greedy returns, shapes and dtypes, each with its own hint."""
    if not (isinstance(accepted, torch.Tensor) and accepted.shape == (B, k - 1) and accepted.dtype == torch.bool):
        got = f"{tuple(accepted.shape)} {accepted.dtype}" if isinstance(accepted, torch.Tensor) else \
            type(accepted).__name__
        raise harness.Fail(f"accepted: got {got}, want a (B, k-1) = {(B, k - 1)} torch.bool tensor",
                           "accepted is a mask over the drafts, one row per row of the batch: compare, or .bool()")
    for name, t in (('n_acc', n_acc), ('bonus', bonus)):
        if not (an_index(t) and t.shape == (B,)):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise harness.Fail(f"{name}: got {got}, want a (B,) = ({B},) torch.long (or int32) tensor",
                               f"{name} holds one whole number per row and indexes the block: a sum over the last "
                               f"dimension of the mask, or a gather along it, gives (B,) in torch.long; keep it so "
                               f"(.int() is fine, a float or a narrower integer is not)")


def test_every_draft_right(impl):
    """All drafts right. Every draft is the target's argmax: all are committed, and the bonus
    follows the last one. Hint: the bonus is the target's argmax after the last committed position, logits[:, n_acc]."""
    greedy = torch.randint(11, (3, 5), generator=torch.Generator().manual_seed(0))
    accepted, n_acc, bonus = impl.verify_greedy(scripted(greedy, 11), greedy[:, :-1], EXACT)
    assert_outputs(accepted, n_acc, bonus, 3, 5)
    assert accepted.all(), f"every draft is right: accepted {accepted.tolist()}, want all True"
    assert n_acc.tolist() == [4, 4, 4], f"n_acc {n_acc.tolist()}, want [4, 4, 4]"
    assert torch.equal(bonus.long(), greedy[:, -1]), \
        f"bonus {bonus.tolist()}, want the argmax after the last draft {greedy[:, -1].tolist()}"


def test_a_wrong_draft_first_middle_last(impl):
    """A wrong draft first, in the middle, last. The drafts before it are committed, it and all
    after it are not, and the bonus is the target's correction there. Hint: nothing counts past the first rejection, even drafts after it that happen to be right;
    a cumulative product over positions keeps exactly the prefix."""
    k = 6
    greedy, drafts, wrong_at = planted(k)
    accepted, n_acc, bonus = impl.verify_greedy(scripted(greedy, 11), drafts, EXACT)
    assert_outputs(accepted, n_acc, bonus, 4, k)
    for row, j in enumerate(wrong_at):
        want = k - 1 if j is None else j
        where = 'no wrong draft' if j is None else f"a wrong draft at drafts[:, {j}] (of 0..{k - 2})"
        assert int(n_acc[row]) == want, f"row with {where}: n_acc {int(n_acc[row])}, want {want}"
        assert accepted[row].tolist() == [True] * want + [False] * (k - 1 - want), \
            f"row with {where}: accepted {accepted[row].tolist()}, want {[True] * want + [False] * (k - 1 - want)}"
        assert int(bonus[row]) == int(greedy[row, want]), \
            f"row with {where}: bonus {int(bonus[row])}, want the target's token after it {int(greedy[row, want])}"


def test_the_rule_decides(impl):
    """The acceptance rule decides. Not a hard-coded argmax: with top-2 acceptance the second most
    likely tokens are all accepted, and with minblock:3 the first two drafts pass. Hint: ok = rule(logits, drafts, param) with (rule, param) = accept."""
    greedy = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(2))
    logits = scripted(greedy, 11)
    second = logits.topk(2, dim=-1).indices[..., 1]                     # runners-up (B, k)
    accepted, n_acc, bonus = impl.verify_greedy(logits, second[:, :-1], (decode.top_n, 2))
    assert n_acc.tolist() == [4, 4], f"top-2 acceptance of runner-up drafts: n_acc {n_acc.tolist()}, want [4, 4]"
    if not torch.equal(bonus.long(), greedy[:, -1]):
        raise harness.Fail(f"top-2 acceptance: bonus {bonus.tolist()}, want the target's argmax after the last draft "
                           f"{greedy[:, -1].tolist()}", "whatever the rule, the bonus is the target's own argmax "
                           "after the last committed position: logits.argmax(-1) at n_acc, not the draft there")
    _, n_acc, _ = impl.verify_greedy(logits, second[:, :-1], (decode.min_block, 3))
    assert n_acc.tolist() == [2, 2], f"minblock:3 with every draft wrong: n_acc {n_acc.tolist()}, want [2, 2]"


def test_no_host_sync(impl):
    """No host sync. No .item(), no boolean indexing, nothing that makes a GPU wait for the host.
    Hint: keep everything a tensor op over the whole batch: cumprod, sum, gather."""
    greedy, drafts, _ = planted()
    logits = scripted(greedy, 11)
    with harness.HostSyncs() as syncs:
        impl.verify_greedy(logits, drafts, EXACT)
    assert not syncs.seen, f"host syncs: {', '.join(sorted(set(syncs.seen)))}, want none"


def test_decodes_exactly_greedy(impl):
    """Decodes exactly greedy. Through decode.generate (your function in merged_step) the output is
    plain greedy decoding's, token for token, for drafts that are always right, sometimes wrong and
    mostly wrong, k = 2..6. Hint: the checks above use k = 5 and 6 on scripted logits; here every
    step's logits are the target's, and n_acc decides how far each row moves."""
    model = harness.tiny_target()
    prompts = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(3))
    m = 40
    ref = harness.plain_greedy(model, prompts, m + 10)
    for k in (2, 4, 6):
        hint = ("with k = 2 a block holds a single draft: check that nothing assumes more than one (drafts (B, 1), "
                "accepted (B, 1)) and that a cumulative product over one position still works") if k == 2 else ''
        # the oracle drafts the greedy future, always right, or with a wrong draft now and then
        for wrong, which in ((lambda t, j: False, 'drafts always right'),
                             (lambda t, j: t % 5 == 2 and j == t % 3, 'a wrong draft now and then')):
            oracle = harness.GreedyOracle(model, ref, k, wrong)
            out, stats = decode.generate(model, prompts, m, drafter=oracle, k=k)
            if not torch.equal(out, ref[:, :8 + m]):
                raise harness.Fail(f"k={k}, {which}: the output differs from plain greedy decoding at "
                                   f"{harness.first_difference(out, ref[:, :8 + m], 8)}", hint)
        heads = harness.peaky(BlockHeads(model.config, k), 0.5, k)     # mostly wrong drafts
        out, _ = decode.generate(model, prompts, m, drafter=heads, k=k)
        if not torch.equal(out, ref[:, :8 + m]):
            raise harness.Fail(f"k={k}, random heads: the output differs from plain greedy at "
                               f"{harness.first_difference(out, ref[:, :8 + m], 8)}", hint)
    taus = stats['accept_lengths']                                     # k = 6, sometimes wrong
    assert max(taus) == 6 and min(taus) < 6, \
        f"k=6, a wrong draft now and then: tau ranged {min(taus)}..{max(taus)}, want 6 at some steps and less at others"


def try_it(impl, tryout):
    """BPD heads at k = 8 on train.py's target, greedy: yours next to the reference."""
    tryout.table(tryout.pair('BPD heads, k = 8', drafter=tryout.drafter('heads.pt'), k=8))
