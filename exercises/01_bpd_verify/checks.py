"""Exercise 1's checks: BPD verification (README.md). Each check is a function of `impl`, the code
under test (student.py, or the reference with --solution)."""
import torch

import decode
import verification
from exercises import harness
from heads import BlockHeads

NAMES = ('verify_greedy',)                            # what student.py defines
SEAMS = {'verification.verify_greedy': 'verify_greedy'}     # where decode.merged_step calls it
REFERENCE = {'verify_greedy': 'verification.verify_greedy'}   # in a handout: a call of student.py
# the rest of the answer, left out of a handout (exercises/handout.py), and what the student may use
STUBS = {'verification.accept_prefix': "what a step keeps, the drafts before the first refusal and the bonus there: "
                                 "verify_greedy's own work"}
MAY_USE = ('verification.exact', 'verification.top_n', 'verification.min_block', 'verification.ACCEPT')
EXACT = (verification.exact, None)


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
                           "accepted says, draft by draft and row by row, whether it is committed: a mask of the "
                           "drafts' shape, in bool (decode.generate indexes with it)")
    for name, t in (('n_acc', n_acc), ('bonus', bonus)):
        if not (an_index(t) and t.shape == (B,)):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise harness.Fail(f"{name}: got {got}, want a (B,) = ({B},) torch.long (or int32) tensor",
                               f"{name} holds one whole number per row, and decode.generate indexes the block with "
                               f"it: a float, a bool or an integer narrower than int32 cannot index, and a shape "
                               f"other than (B,) broadcasts against the rows wrongly" + (
                                   f". {harness.ONE_ROW_HINT.capitalize()}"
                                   if isinstance(t, torch.Tensor) and t.dim() == 0 else ''))


def test_every_draft_right(impl):
    """All drafts right. Every draft is the target's argmax: all are committed, and the bonus
    follows the last one; with one row (a single prompt), the same shapes, B = 1. Hint: the bonus
    is the target's argmax after the last committed draft, here the last one: with every draft
    right, a bonus read elsewhere shows."""
    greedy = torch.randint(11, (3, 5), generator=torch.Generator().manual_seed(0))
    accepted, n_acc, bonus = impl.verify_greedy(scripted(greedy, 11), greedy[:, :-1], EXACT)
    assert_outputs(accepted, n_acc, bonus, 3, 5)
    assert_outputs(*impl.verify_greedy(scripted(greedy[:1], 11), greedy[:1, :-1], EXACT), 1, 5)
    assert accepted.all(), f"every draft is right: accepted {accepted.tolist()}, want all True"
    assert n_acc.tolist() == [4, 4, 4], f"n_acc {n_acc.tolist()}, want [4, 4, 4]"
    assert torch.equal(bonus.long(), greedy[:, -1]), \
        f"bonus {bonus.tolist()}, want the argmax after the last draft {greedy[:, -1].tolist()}"


def test_a_wrong_draft_first_middle_last(impl):
    """A wrong draft first, in the middle, last. The drafts before it are committed, it and all
    after it are not, and the bonus is the target's correction there; the call leaves its inputs,
    the global RNG and an earlier call's results as they were."""
    k = 6
    greedy, drafts, wrong_at = planted(k)
    logits = scripted(greedy, 11)
    accepted, n_acc, bonus = harness.assert_inputs_unchanged(
        'verify_greedy', lambda: harness.assert_leaves_torch_alone(
            'verify_greedy', lambda: impl.verify_greedy(logits, drafts, EXACT)),
        "the step reads the drafts again after the call (they are the tokens it commits), and the logits are the "
        "caller's: compute into tensors of your own, with no in-place op on them (a name ending in _, -= or &=, an "
        "indexed assignment)", logits=logits, drafts=drafts)
    assert_outputs(accepted, n_acc, bonus, 4, k)
    for row, j in enumerate(wrong_at):
        want = k - 1 if j is None else j
        where = 'no wrong draft' if j is None else f"a wrong draft at drafts[:, {j}] (of 0..{k - 2})"
        if int(n_acc[row]) != want:
            raise harness.Fail(f"row with {where}: n_acc {int(n_acc[row])}, want {want}", (
                "more than the drafts before the first wrong one were counted: nothing counts past the first "
                "refusal, even drafts after it that happen to be right" if int(n_acc[row]) > want else
                "fewer than the drafts before the first wrong one were counted. What fits: drafts compared with the "
                "logits at their own block position rather than the one before, or the count stopped early"))
        mask = [True] * want + [False] * (k - 1 - want)
        if accepted[row].tolist() != mask:
            raise harness.Fail(f"row with {where}: accepted {accepted[row].tolist()}, want {mask}",
                               "n_acc is right and the mask is not: accepted is True for the committed drafts only "
                               "(those before the first refusal), whatever the rule says about the drafts after it")
        if int(bonus[row]) != int(greedy[row, want]):
            late = want + 1 < k and int(bonus[row]) == int(greedy[row, want + 1])
            raise harness.Fail(f"row with {where}: bonus {int(bonus[row])}, want {int(greedy[row, want])}, the "
                               f"target's argmax after the last committed token",
                               "the bonus is the target's argmax at the block position of the last committed token "
                               "(the bonus itself when nothing was committed): " + (
                                   "yours is the one a position later" if late else
                                   "yours is neither that one nor the one a position later"))
    # each call's results are its own: a second call, other logits and drafts of the same shapes, leaves them
    first = [t.clone() for t in (accepted, n_acc, bonus)]
    impl.verify_greedy(*sized(4, k), EXACT)
    for name, got, was in zip(('accepted', 'n_acc', 'bonus'), (accepted, n_acc, bonus), first):
        if not torch.equal(got, was):
            raise harness.Fail(f"a second call (other logits and drafts, the same shapes) changed the first call's "
                               f"{name}, want each call's results its own",
                               "what fits: results written into tensors kept between calls (out=, copy_ into a "
                               "buffer made once): the next call overwrites what the caller still holds (a step's "
                               "verdicts compared or kept while the next block is verified). Make the outputs anew "
                               "at each call; a table kept and only read (an arange) is fine")


def test_ties_near_ties_long_blocks(impl):
    """Ties, near-ties and a long block. The bonus is torch.argmax's (the first of tied maxima, as
    plain greedy decoding takes it) in the logits' own dtype: row 0 ties two or three tokens at
    every position (vocabularies of 40 and 4000), row 1 puts token 3 1e-12 above token 1 in float64
    (equal in float32), row 2 token 3 1e-17 above the rest, all near 0 (equal after a softmax or a
    log-softmax); under bfloat16 autocast, float32 logits, tokens 0.03 apart at 10 (equal in
    bfloat16) and above 256; and a block of k = 40, every draft right in one row and the 35th
    refused in the other, also with the ties of sort and topk broken in the other order (theirs is
    unspecified: a GPU's may differ from a CPU's)."""
    for V, tied in ((40, [7, 30]), (4000, [7, 1900, 3000])):
        logits = torch.zeros(3, 3, V, dtype=torch.float64)
        logits[0, :, tied] = 1.0
        logits[1, :, 1], logits[1, :, 3] = 1.0, 1.0 + 1e-12
        logits[2, :, 3] = 1e-17
        drafts = logits[:, :-1].argmax(-1)                              # all right: 7 7, 3 3 and 3 3
        _, n_acc, bonus = impl.verify_greedy(logits, drafts, EXACT)
        if bonus.long().tolist() != [7, 3, 3]:
            raise harness.Fail(f"bonus {bonus.tolist()}, want [7, 3, 3]: row 0 ties tokens {tied} of {V} (argmax "
                               f"takes the first), row 1 has token 3 1e-12 above token 1 in float64, row 2 token 3 "
                               f"1e-17 above the rest (all near 0)",
                               "the bonus is logits.argmax(-1) at the last committed position, in the logits' dtype: "
                               + ("what fits is a tie broken the other way (topk, sort and max over a float cast do "
                                  "not promise the first of equals)" if bonus[0] != 7 else
                                  "what fits is a cast to float32 (or lower) first, which makes tokens 1 and 3 equal"
                                  if bonus[1] != 3 else
                                  "what fits is an argmax of probabilities (softmax, log_softmax) instead of the "
                                  "logits: near 0 they round logits 1e-17 apart to the same value"))
        if n_acc.tolist() != [2, 2, 2]:
            raise harness.Fail(f"every draft is the argmax (ties and near-ties, V = {V}): n_acc {n_acc.tolist()}, "
                               f"want [2, 2, 2]", "what fits: the rule given something other than the logits "
                               "(probabilities from softmax or log_softmax round row 2's near-tie to a tie)"
                               if n_acc.tolist()[:2] == [2, 2] else '')
    under_autocast(impl)
    k = 40
    greedy = torch.randint(11, (2, k), generator=torch.Generator().manual_seed(4))
    drafts = greedy[:, :-1].clone()
    drafts[1, 34] = (drafts[1, 34] + 1) % 11
    logits = scripted(greedy, 11)
    accepted, n_acc, bonus = impl.verify_greedy(logits, drafts, EXACT)
    assert_outputs(accepted, n_acc, bonus, 2, k)
    for last in (False, True):             # sort and topk's ties broken first first, then last first
        with harness.TieOrder(last):
            other = impl.verify_greedy(logits, drafts, EXACT)
        if not all(torch.equal(a, b) for a, b in zip(other, (accepted, n_acc, bonus))):
            raise harness.Fail(f"k = 40, drafts[1, 34] wrong, with the ties of sort and topk broken "
                               f"{'in reverse index order' if last else 'in index order'}: n_acc {other[1].tolist()}, bonus "
                               f"{other[2].tolist()}; without: n_acc {n_acc.tolist()}, bonus {bonus.tolist()}; want "
                               f"the same whatever their order",
                               "the order sort and topk give equal values is unspecified (a CPU's happens to keep "
                               "them in order for short rows, a GPU's may not): what fits is the first refusal or the "
                               "bonus read from the indices of a sort or topk over values with ties (the refusal "
                               "flags, the logits). argmax and argmin promise the first of equals; "
                               "sort(stable=True) keeps their order")
    if n_acc.tolist() != [39, 34] or bonus.long().tolist() != [int(greedy[0, 39]), int(greedy[1, 34])]:
        raise harness.Fail(f"k = 40, every draft right in row 0, drafts[1, 34] wrong: n_acc {n_acc.tolist()}, bonus "
                           f"{bonus.tolist()}, want [39, 34], {[int(greedy[0, 39]), int(greedy[1, 34])]}",
                           "the checks above use k <= 8: what fits is something that holds only for short blocks "
                           "(a table or a bit pattern of a fixed width)")


def under_autocast(impl):
    """Under bfloat16 autocast, as generate.py --dtype bfloat16 runs the step (the logits upcast to float32
    first): a near-tie 0.03 apart at 10 (equal in bfloat16) and tokens above 256 (not whole numbers in
    bfloat16) give the bonus argmax gives in float32."""
    logits = torch.zeros(2, 3, 4000)
    logits[:, :, 7], logits[:, :, 3001] = 10.0, 10.03                  # bfloat16 rounds both to 10
    logits[1, 0, 3001], logits[1, 0, 5], logits[1, 0, 2999] = 0.0, 10.0, 10.03
    drafts = torch.tensor([[3001, 3001], [7, 3001]])                     # row 0 all right, row 1's first wrong
    with torch.autocast('cpu', dtype=torch.bfloat16):
        _, n_acc, bonus = impl.verify_greedy(logits, drafts, EXACT)
    if n_acc.tolist() != [2, 0] or bonus.long().tolist() != [3001, 2999]:
        read = bonus.long().tolist() == [7, 5]
        raise harness.Fail(
            f"under bfloat16 autocast (generate.py --dtype bfloat16), float32 logits: n_acc {n_acc.tolist()}, bonus "
            f"{bonus.tolist()}, want [2, 0], [3001, 2999]: token 3001 is 0.03 above token 7 (row 0), token 2999 above "
            f"token 5 (row 1, first position), at 10: equal in bfloat16",
            "autocast runs a matrix product of float32 tensors (einsum, @, bmm, matmul, linalg.vecdot) in bfloat16, "
            "3 significant digits: " + (
                "what fits is the last committed position's logits picked by one (a one-hot times the logits), "
                "which rounds the near-tie to a tie" if read else "what fits is a product of that kind on the "
                "way (above 256 bfloat16 holds only some whole numbers: a token id picked by a one-hot product comes "
                "back rounded, 3001 as 3008)") + "; pick without a matrix product (autocast leaves elementwise "
            "ops and sums in float32), or switch autocast off on the logits' device "
            "(torch.autocast(logits.device.type, enabled=False)): autocast switched off on another device "
            "(torch.autocast('cuda', ...) on a CPU) leaves it on")


def test_the_rule_decides(impl):
    """The acceptance rule decides. Not a hard-coded argmax: with top-2 acceptance the second most
    likely tokens are all accepted, and with minblock:3 the first two drafts pass."""
    greedy = torch.randint(11, (2, 5), generator=torch.Generator().manual_seed(2))
    logits = scripted(greedy, 11)
    second = logits.topk(2, dim=-1).indices[..., 1]                     # runners-up (B, k)
    ignored = "what fits: the verdicts are exact's (a draft equal to the argmax), not those of the rule in `accept`"
    accepted, n_acc, bonus = impl.verify_greedy(logits, second[:, :-1], (verification.top_n, 2))
    if n_acc.tolist() != [4, 4]:
        raise harness.Fail(f"top-2 acceptance of runner-up drafts: n_acc {n_acc.tolist()}, want [4, 4]",
                           ignored if n_acc.tolist() == [0, 0] else '')
    if not torch.equal(bonus.long(), greedy[:, -1]):
        raise harness.Fail(f"top-2 acceptance: bonus {bonus.tolist()}, want the target's argmax after the last draft "
                           f"{greedy[:, -1].tolist()}", "whatever the rule, the bonus is the target's own argmax "
                           "after the last committed position" + (": yours is the draft there" if torch.equal(
                               bonus.long(), second[:, -2]) else ''))
    _, n_acc, _ = impl.verify_greedy(logits, second[:, :-1], (verification.min_block, 3))
    if n_acc.tolist() != [2, 2]:
        raise harness.Fail(f"minblock:3 with every draft wrong: n_acc {n_acc.tolist()}, want [2, 2]",
                           ignored if n_acc.tolist() == [0, 0] else '')


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device, nothing kept. No .item(), no
    boolean indexing, nothing that makes a GPU wait for the host; as many ops for 6 rows or 8
    positions as for 3 rows of 5; no tensor made off the logits' device (run on PyTorch's 'meta'
    device, which refuses a mix of devices as CUDA does); five calls keep no more of the
    tensors they make, nor more bytes, than one call (the step runs at every token decoded)."""
    greedy, drafts, _ = planted()
    logits = scripted(greedy, 11)
    with harness.HostSyncs() as syncs:
        impl.verify_greedy(logits, drafts, EXACT)
    if syncs.seen:
        raise harness.Fail(f"host syncs: {', '.join(sorted(set(syncs.seen)))}, want none",
                           "the ops listed make the host wait for the device: a value read back (.item(), int() or "
                           "bool() of a tensor, a Python if or loop bound on one) or a shape that depends on the "
                           "data (boolean indexing, nonzero); where each row's prefix ends is known only on the "
                           "device")
    harness.assert_no_python_loop('verify_greedy', [(f'B={B}, k={k}', lambda B=B, k=k: impl.verify_greedy(
        *sized(B, k), EXACT)) for B, k in ((3, 5), (6, 5), (3, 8))])
    harness.assert_keeps_nothing('verify_greedy', lambda i: impl.verify_greedy(*sized(3, 5), EXACT))   # one decode's k
    logits, drafts = harness.on_meta(logits), harness.on_meta(drafts)
    harness.assert_on_the_inputs_device('verify_greedy', lambda: impl.verify_greedy(logits, drafts, EXACT))


def sized(B, k, V=11):
    """Logits (B, k, V) and drafts (B, k-1), some right and some wrong."""
    g = torch.Generator().manual_seed(B * 100 + k)
    greedy = torch.randint(V, (B, k), generator=g)
    drafts = torch.where(torch.rand(B, k - 1, generator=g) < 0.7, greedy[:, :-1], (greedy[:, :-1] + 1) % V)
    return scripted(greedy, V), drafts


def test_decodes_exactly_greedy(impl):
    """Decodes exactly greedy. Through decode.generate (your function in merged_step) the output is
    plain greedy decoding's, token for token, for drafts that are always right, sometimes wrong and
    mostly wrong, k = 2..6."""
    model = harness.tiny_target()
    prompts = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(3))
    m = 40
    ref = harness.plain_greedy(model, prompts, m + 10)
    for k in (2, 4, 6):
        hint = ("it fails at k = 2, a block of a single draft (drafts and accepted (B, 1)). What fits: something "
                "that assumes more than one draft (a squeeze that drops that dimension), or an index past the last "
                "draft that a longer block has room for") if k == 2 else \
            ("the checks above use k = 5 and 6 on scripted logits; here every step's logits are the target's, and "
             "n_acc decides how far each row moves: what fits is n_acc or the bonus off for rows of different "
             "lengths, or for a block whose first draft is refused")
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
    """BPD heads at k = 8 on train.py's target, greedy: yours next to the reference (in a handout,
    the target alone)."""
    tryout.table(tryout.pair('BPD heads, k = 8', drafter=tryout.drafter('heads.pt'), k=8))
