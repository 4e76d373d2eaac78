"""Exercise 8's checks: verifying a tree of K greedy branches in one target call (README.md)."""
import torch
import torch.nn.functional as F

from dblast import DBlastDrafter
from exercises import harness
from model import sample, tempered, upcast

NAMES = ('tree_step',)
# The project's own tree verification is this exercise's answer: a handout leaves it out
# (exercises/handout.py), so several paths per call (generate.py --paths) need the full project.
WHY = "several drafted paths per call: generate.py --paths needs the full project; your tree_step runs in " \
      "python -m exercises check 8 and try 8"
STUBS = {'verification.tree_layout': WHY, 'verification.tree_nodes': WHY, 'verification.tree_walk': WHY,
         'verification.longest': WHY, 'verification.verify_tree_greedy': WHY, 'verification.verify_tree_sampled': WHY,
         'verification.try_candidate': WHY, 'verification.verify [if N > 1]': WHY,
         'model.KVCache.keep_path': WHY, 'model.GPT.forward_cached [else of tree is None]': WHY,
         'decode.merged_step [if paths > 1]': WHY,
         # a sampled tree's walk is the same multi-candidate speculative sampling, node by node
         'verification.sampled_tree_choice': "a sampled token tree (generate.py --branching) is walked by this "
                                             "exercise's multi-candidate speculative sampling: it needs the full "
                                             "project"}
MAY_USE = ('model.Layer.forward', 'model.KVCache.write', 'model.KVCache.commit', 'model.sample', 'model.tempered',
           'model.upcast', 'verification.verify_greedy')


def branch_paths(drafter, h, bonus, model, k):
    """Every branch's greedy drafts (B, K, k-1): the argmax path of each branch of the mixture."""
    _, logits = drafter.mixture_logits(h, bonus, model, k)
    return logits.argmax(-1)


def partly_right(paths, ref, n_out, calls, V):
    """paths with one branch a row made right to a depth that changes with the row and the step
    (ref: plain greedy's output, whose tokens after n_out + 1 the drafts stand for), so that rows
    accept 0 to n drafts, drift to lengths of their own, and share nodes with the other branches."""
    B, K, n = paths.shape
    rows, j = torch.arange(B), torch.arange(n)
    depth = (calls + 2 * rows) % (n + 1)                                        # right drafts: 0 .. n
    right = ref.gather(1, (n_out[:, None] + 1 + j).clamp(max=ref.size(1) - 1))
    paths = paths.clone()
    paths[rows, (calls + rows) % paths.size(1)] = torch.where(j < depth[:, None], right, (right + 1) % V)
    return paths


@torch.no_grad()
def tree_generate(model, prompt, max_new_tokens, drafter=None, temperature=0.0, generator=None, step=None, ref=None):
    """decode.generate with tree verification: each call verifies all K greedy branches of a DBlast
    drafter (step: a tree_step) -> (out (B, T0 + max_new_tokens), stats with calls and
    accept_lengths). ref (greedy: plain greedy's output): one branch a row made right in part
    (partly_right)."""
    B, T0 = prompt.shape
    k, K = drafter.k, drafter.K
    total = T0 + max_new_tokens
    cache = model.new_cache(B, total + 1 + K * (k - 1) + k)     # room for the last tree block
    out = torch.zeros(B, total + 2 * k, dtype=torch.long)      # finished rows write past the end
    out[:, :T0] = prompt
    h = model.forward_cached(prompt, cache)[:, -1]
    cache.commit(T0)
    logits = upcast(model.lm_head(h))
    bonus = logits.argmax(-1) if temperature == 0 else sample(F.softmax(tempered(logits, temperature), -1), generator)
    n_out = torch.full((B,), T0)
    taus, calls = [], 1
    while True:
        active = n_out < total
        if not active.any():
            break
        paths = branch_paths(drafter, h, bonus, model, k)
        if ref is not None:
            paths = partly_right(paths, ref, n_out, calls, model.config.vocab_size)
        n_acc, branch, next_bonus, h = step(model, cache, bonus, paths, active, temperature, generator)
        chosen = paths.gather(1, branch.view(B, 1, 1).expand(B, 1, k - 1)).squeeze(1)
        out.scatter_(1, n_out[:, None] + torch.arange(k), torch.cat([bonus[:, None], chosen], 1))
        n_out += (n_acc + 1) * active
        taus += (n_acc + 1)[active].tolist()
        bonus, calls = next_bonus, calls + 1
    return out[:, :total], dict(calls=calls, accept_lengths=taus)


def random_drafter(config, k=4, K=4, seed=2, sharp=True):
    d = harness.peaky(DBlastDrafter(config, k, K, sample_drafts=False), 0.3, seed)
    if sharp:
        with torch.no_grad():
            d.block.ln.weight.mul_(4.0)
    return d


@torch.no_grad()
def single_branch_n_acc(model, prefix, bonus, paths):
    """Each branch verified alone, exactly, on a full forward: (B, K) accepted drafts, counted one
    position at a time. prefix: (B, T), or a list of B rows of their own lengths."""
    B, K, n = paths.shape
    res = torch.zeros(B, K, dtype=torch.long)
    for b in range(B):
        for z in range(K):
            seq = torch.cat([prefix[b], bonus[b:b + 1], paths[b, z]])
            greedy = model(seq[None])[0][0, len(prefix[b]):-1].argmax(-1)          # after bonus, d_1, ..
            while res[b, z] < n and paths[b, z, res[b, z]] == greedy[res[b, z]]:
                res[b, z] += 1
    return res


def test_greedy_accepts_the_longest_branch(impl):
    """Greedy: the longest matching branch. For K = 4 branches (some sharing a first token, one the
    target's greedy path), n_acc is the longest accepted prefix among them, the bonus the target's
    argmax after it, and the cache afterwards equals a fresh prefill of what was committed; with one
    row (a single prompt), the same answer in shapes of one row; branches of 14 drafts that
    differ in their first token only; and rows at lengths of their own (6, 9, 4), whose branches
    share a node in row 0 alone."""
    model = harness.tiny_target()
    B, n = 3, 3
    prefix = torch.randint(32, (B, 6), generator=torch.Generator().manual_seed(0))
    greedy = harness.plain_greedy(model, prefix, 1 + n + 1)[:, 6:]                # bonus, 3 greedy drafts, next
    bonus = greedy[:, 0]
    paths = torch.randint(32, (B, 4, n), generator=torch.Generator().manual_seed(1))
    paths[:, 1] = greedy[:, 1:1 + n]                                              # branch 1: all right
    paths[:, 2, 0] = greedy[:, 1]                                                 # branch 2: one right
    paths[:, 3, 0] = greedy[:, 1]                                                 # branch 3 shares it
    paths[1, 1, 2] = (paths[1, 1, 2] + 1) % 32                                    # row 1: branch 1 two right
    cache = model.new_cache(B, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    with LayerCalls(model) as calls:
        n_acc, branch, nxt, h = impl.tree_step(model, cache, bonus, paths, torch.ones(B, dtype=torch.bool), 0.0)
    if max(calls.n) > 1:
        raise harness.Fail(f"the target's layers ran {calls.n} times in one tree_step, want once each: one call "
                           f"verifies the whole tree", "what fits: a call per branch, or a second call (over the "
                           "kept branch, say) where its keys and values can be moved in the cache")
    greedy_step_is_right(impl, model, prefix, bonus, paths, cache, (n_acc, branch, nxt, h), best=1)
    one = model.new_cache(1, 32)                 # one row, as a single prompt decodes: row 0's answer
    model.forward_cached(prefix[:1], one)
    one.commit(6)
    got = impl.tree_step(model, one, bonus[:1], paths[:1], torch.ones(1, dtype=torch.bool), 0.0)
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in got]
    want = [(1,), (1,), (1,), (1, h.size(-1))]
    if shapes != want:
        raise harness.Fail(f"one row (B = 1): n_acc, branch, the bonus and h have shapes {shapes}, want {want}",
                           harness.ONE_ROW_HINT)
    if [int(got[0]), int(got[1]), int(got[2])] != [int(n_acc[0]), int(branch[0]), int(nxt[0])]:
        raise harness.Fail(f"one row (B = 1): n_acc, branch and the bonus {[int(t) for t in got[:3]]}, want row 0's of "
                           f"the batch {[int(n_acc[0]), int(branch[0]), int(nxt[0])]}", "")
    # the right branch last; row 2 with every branch wrong at its first draft (the state at the bonus
    # is h); and a cache that holds old keys past the prefix, as a decode leaves a refused block's
    paths = torch.randint(32, (B, 4, n), generator=torch.Generator().manual_seed(5))
    paths[:, 3] = greedy[:, 1:1 + n]
    paths[2] = (greedy[2, 1] + 1 + torch.arange(4 * n).view(4, n)) % 32
    cache = model.new_cache(B, 48)
    model.forward_cached(torch.randint(32, (B, 40), generator=torch.Generator().manual_seed(6)), cache)
    model.forward_cached(prefix, cache)                                           # over the old ones' first 6
    cache.commit(6)
    got = impl.tree_step(model, cache, bonus, paths, torch.ones(B, dtype=torch.bool), 0.0)
    greedy_step_is_right(impl, model, prefix, bonus, paths, cache, got, best=3,
                         case="with branch 3 the right one, row 2's branches all wrong at once, and old keys in the "
                              "cache past the prefix: ")
    # branches whose first two tokens sum (and so hash, by a sum) as the right branch's do, though
    # no prefix of theirs is its: no node is shared
    g = greedy[:, 1:1 + n]
    paths = g[:, None].repeat(1, 4, 1)
    paths[:, 0, 0], paths[:, 0, 1] = g[:, 0] + 1, g[:, 1] - 1
    paths[:, 2, 0], paths[:, 2, 1] = g[:, 0] - 1, g[:, 1] + 1
    paths[:, 3] = torch.randint(32, (B, n), generator=torch.Generator().manual_seed(9))
    assert ((paths >= 0) & (paths < 32)).all(), "the check's world is not the one its branches were made for"
    cache = model.new_cache(B, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    got = impl.tree_step(model, cache, bonus, paths, torch.ones(B, dtype=torch.bool), 0.0)
    greedy_step_is_right(impl, model, prefix, bonus, paths, cache, got, best=1,
                         case="with branches 0 and 2 holding, at their first two drafts, tokens of the same sum as "
                              "the right branch 1's: ")
    # branches of 14 drafts that differ in their first token only (the right one second): a prefix
    # coded as one int64, code * V + token, loses its first token from the 14th on (32^13 = 2^65),
    # as GPT-2's 50304 = 2^7 x 393 loses it from the 11th, and shares the two branches' deep nodes
    n = 14
    greedy = harness.plain_greedy(model, prefix, 1 + n + 1)[:, 6:]
    bonus, g = greedy[:, 0], greedy[:, 1:1 + n]
    paths = torch.stack([g, g, (g + 1) % 32, (g + 2) % 32], 1)
    paths[:, 0, 0] = (g[:, 0] + 3) % 32
    cache = model.new_cache(B, 64)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    got = impl.tree_step(model, cache, bonus, paths, torch.ones(B, dtype=torch.bool), 0.0)
    greedy_step_is_right(impl, model, prefix, bonus, paths, cache, got, best=1,
                         case="branches of 14 drafts, branch 0 unlike the right branch 1 in its first token only: ")
    # rows of other lengths (6, 9 and 4 tokens committed, old keys past them), as a decode leaves them
    # after steps that accepted more in one row than in another, and branches that share a node in
    # row 0 alone: the right branch 2 shares its first token with branch 1 in row 0, not in rows 1
    # and 2 (a tree, or a cache offset, made for batch 1, as Medusa's and EAGLE's are, takes row 0's
    # for every row)
    n, lengths = 3, [6, 9, 4]
    long = torch.randint(32, (B, 9), generator=torch.Generator().manual_seed(10))
    rows = [long[b, :lengths[b]] for b in range(B)]
    greedy = [harness.plain_greedy(model, r[None], 1 + n + 1)[0, len(r):] for r in rows]
    bonus = torch.stack([g[0] for g in greedy])
    g = torch.stack([gr[1:1 + n] for gr in greedy])                                # (B, n) the right drafts
    paths = (g[:, None, :] + 1 + torch.arange(4)[None, :, None]) % 32             # every draft wrong
    paths[:, 2] = g                                                               # branch 2 right
    paths[1, 2, 2] = (g[1, 2] + 5) % 32                                           # row 1: two right
    paths[0, 1, 0] = g[0, 0]                                                      # row 0: branch 1 shares the first
    cache = model.new_cache(B, 32)
    model.forward_cached(long, cache)
    cache.commit(torch.tensor(lengths))
    got = impl.tree_step(model, cache, bonus, paths, torch.ones(B, dtype=torch.bool), 0.0)
    greedy_step_is_right(impl, model, rows, bonus, paths, cache, got, best=2,
                         case="rows at other lengths (6, 9, 4), branch 1 sharing the right branch 2's first token "
                              "in row 0 alone: ")


class LayerCalls:
    """How many times each of the target's layers runs inside the block (n, one count a layer)."""

    def __init__(self, model):
        self.layers = model.transformer.h

    def __enter__(self):
        self.n = [0] * len(self.layers)
        self.hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: self.n.__setitem__(i, self.n[i] + 1))
                      for i, layer in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()


def greedy_step_is_right(impl, model, prefix, bonus, paths, cache, got, best, case=''):
    """tree_step's answer `got` (n_acc, branch, the next bonus, h) for a greedy step from `prefix`
    ((B, T), or a list of B rows of their own lengths) against each branch verified alone, a full
    forward of what it committed, and a fresh prefill (the cache after it). best: the branch that
    accepts the most, in every row that accepts any (or a list, one a row)."""
    n_acc, branch, nxt, h = got
    B = len(prefix)
    bests = best if isinstance(best, list) else [best] * B
    alone = single_branch_n_acc(model, prefix, bonus, paths)                      # (B, K)
    want = alone.max(-1).values
    if n_acc.tolist() != want.tolist():
        if any(n_acc.tolist() == alone[:, z].tolist() for z in range(4)):
            hint = ("n_acc is one fixed branch's in every row: the step keeps the branch that accepts the most, "
                    "row by row")
        elif (n_acc > want).any():
            hint = ("more accepted than any branch accepts alone. What fits: a token judged by logits that saw "
                    "another branch's tokens (the mask), a draft compared with the logits at its own slot rather "
                    "than its parent's, or tokens counted past the first mismatch")
        else:
            hint = ("fewer accepted than the longest branch accepts alone. What fits: a token judged by another "
                    "slot's logits than its parent's (the bonus's for the first token), positions other than the "
                    "prefix length + 1 + depth, a mask that hides the branch's own earlier tokens, or nodes "
                    "shared as another row's branches share them (row 0's, as a tree built for batch 1 is): each "
                    "row's branches make its own tree")
        raise harness.Fail(f"{case}n_acc {n_acc.tolist()}, want the longest single branch's {want.tolist()} (each "
                           f"branch alone: {alone.tolist()})", hint)
    for b in range(B):
        assert n_acc[b] == 0 or branch[b] == bests[b], \
            f"{case}branch {branch.tolist()}, want {best} where a draft is accepted: branch {bests[b]} is the " \
            f"longest in row {b}"
    committed = [torch.cat([prefix[b], bonus[b:b + 1], paths[b, bests[b], :int(n_acc[b])]]) for b in range(B)]
    for b in range(B):
        logits = model(committed[b][None])[0][0]
        if int(nxt[b]) != int(logits[-1].argmax()):
            raise harness.Fail(f"{case}row {b}: the next bonus is {int(nxt[b])}, want the target's argmax "
                               f"{int(logits[-1].argmax())}", "n_acc is right, the bonus after it is not. What "
                               "fits: the argmax read at another slot than the last accepted token's (the slot after "
                               "it, or another branch's slot that is not the same node)")
        err = (h[b] - model.hidden(committed[b][None])[0, -1]).abs().max().item()
        if not err < 1e-10:
            raise harness.Fail(f"{case}row {b}: h differs from the state at the last committed token by {err:.2e}, "
                               f"want below 1e-10", "h is the target's final hidden state (after ln_f) at the last "
                               "accepted token. What fits: another slot's state, or one before ln_f")
    want = [len(prefix[b]) + 1 + int(n_acc[b]) for b in range(B)]
    assert cache.lengths.tolist() == want, \
        f"{case}cache lengths {cache.lengths.tolist()}, want {want} (the prefix, the bonus, n_acc)"
    probe = torch.randint(32, (B, 2), generator=torch.Generator().manual_seed(2))
    got = model.lm_head(model.forward_cached(probe, cache))
    for b in range(B):
        want = model(torch.cat([committed[b], probe[b]])[None])[0][0, -2:]
        if not (got[b] - want).abs().max() < 1e-10:
            raise harness.Fail(f"{case}row {b}: the cache does not hold the committed tokens: logits after it differ "
                               f"by {(got[b] - want).abs().max().item():.2e}, want below 1e-10",
                               "the committed tokens' keys and values must sit right after the bonus. What fits: "
                               "the kept branch's left at the slots it was written to (another branch's sit right "
                               "after the bonus), moved from another branch's slots, written at other positions, or "
                               "moved at another row's offset (row 0's length, as code written for batch 1 takes "
                               "it): each row's slots start at its own cache.lengths")


def test_inactive_rows_stay(impl):
    """Inactive rows do not advance, and tree_step leaves its inputs as they were."""
    model = harness.tiny_target()
    prefix = torch.randint(32, (2, 6), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(2, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    paths = torch.randint(32, (2, 2, 3), generator=torch.Generator().manual_seed(4))
    bonus, active = prefix[:, -1].clone(), torch.tensor([True, False])
    harness.assert_inputs_unchanged(
        'tree_step', lambda: impl.tree_step(model, cache, bonus, paths, active, 0.0),
        "what fits: an in-place op (mul_, masked_fill_, an indexed assignment) on an input; the caller keeps them "
        "(a row that takes no part keeps its pending block)", bonus=bonus, paths=paths, active=active)
    if not (cache.lengths[1] == 6 and cache.lengths[0] > 6):
        raise harness.Fail(f"cache lengths {cache.lengths.tolist()}, want [>6, 6] (row 1 inactive)",
                           "an inactive row commits nothing, an active one at least its bonus: " + (
                               "here the inactive row moved" if cache.lengths[1] != 6 else
                               "here the active row did not"))


def test_decodes_exactly_greedy(impl):
    """Decodes exactly greedy, to the end of the context. Through tree_generate, with a random
    K = 4 drafter, one branch a row made right to a depth that changes with the row and the step
    (rows drift to lengths of their own), the output is plain greedy decoding's (float64): 30
    tokens, then up to the target's last position (a context of 32: 24 tokens after a prompt of
    8), where the last tree blocks reach past the positions the target has."""
    model = harness.tiny_target()
    d = random_drafter(model.config)
    prompts = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(5))
    hint = ("if the first check passes and this fails, the step goes wrong later in a decode: what fits: rows at "
            "different lengths (each row writes at its own cache.lengths), a row whose branches all fail at once, or "
            "what an inactive row does while the others decode")
    ref = harness.plain_greedy(model, prompts, 30)
    out, _ = tree_generate(model, prompts, 30, drafter=d, step=impl.tree_step, ref=ref)
    if not torch.equal(out, ref):
        raise harness.Fail(f"the output differs from plain greedy decoding at {harness.first_difference(out, ref, 8)}",
                           hint)
    short = harness.tiny_target(block_size=32)
    ref = harness.plain_greedy(short, prompts, 24)
    try:
        out, _ = tree_generate(short, prompts, 24, drafter=random_drafter(short.config), step=impl.tree_step, ref=ref)
    except (IndexError, RuntimeError) as e:
        raise harness.Fail(f"decoding up to the end of a context of 32 positions: {type(e).__name__}: "
                           f"{harness.first_line(e)}{harness.where_in_student(e)}", END_HINT)
    if not torch.equal(out, ref):
        raise harness.Fail(f"decoding up to the end of a context of 32 positions, the output differs from plain "
                           f"greedy decoding at {harness.first_difference(out, ref, 8)}",
                           f"the first decode passed, this one did not. What fits: slots past the last position "
                           f"handled so that committed ones move too, or something the first decode did not reach: "
                           f"{hint[hint.index('rows at'):]}; the first check says more where it fails")


END_HINT = ("near the end of the context a tree block's slots lie past the last position the target has (its "
            "position table has block_size rows). They are never committed there, but the call must run, and must "
            "not change the positions of the slots that are (the statement says what such a slot gets)")


# The step checked token by token: bonus 7 after the enumerable world's prompt, in the world whose
# conditionals depend on the last three tokens (harness.context_target), five branches
BONUS, PATHS = 7, [[1, 6, 6], [6, 6, 6], [1, 2, 4], [1, 6, 2], [1, 6, 4]]
# the emitted tokens tested: the first, then the next after each of these prefixes (shared nodes:
# [1] is the first token of branches 0, 2, 3 and 4, [1, 6] the first two of branches 0, 3 and 4;
# [6, 6] and [6, 6, 6] are branch 1's prefixes, whose last tokens are branch 0's at the same depths
# after another first token)
TESTED = [(), (1,), (1, 6), (6, 6), (6, 6, 6)]
# at T = 0.6, branches whose shared nodes are not branch 0's ([6] three share, [6, 6] two), and
# whose leaves the walk reaches often (the bonus drawn there at T too); run with the ties of sort
# and top-k broken last index first (T = 1: first first), as a GPU's may: where the walk stops at
# [6] or [6, 6], a sort of the branches' counts then keeps the last of the longest, whose own copy
# of the node is not the one whose sample the walk read (a bonus read there: a statistic of 2843
# against a critical value of 72, measured)
PATHS_COLD, TESTED_COLD = [[0, 0, 0], [6, 6, 6], [6, 6, 2], [6, 1, 4], [1, 6, 6]], [(), (6,), (6, 6), (6, 6, 6)]
STEPS = 20000


@torch.no_grad()
def test_sampling_every_token_of_a_step_follows_p(impl):
    """Sampling: every token of a step follows p. 20,000 steps from one prefix with five branches:
    [1, 6, 6], [6, 6, 6], [1, 2, 4], [1, 6, 2] and [1, 6, 4], at T = 1, on a target whose next token
    depends on the last three. The first token committed, the second after a first 1 (a node four
    branches share), the third after 1, 6 (a node three share) and after 6, 6, and the fourth after
    6, 6, 6 (branch 1's own nodes, whose tokens branch 0 has at the same depths after another first
    token) each follow the target's conditional: one chi-square over the five, p < 1e-5. Then the
    same at T = 0.6 with [0, 0, 0], [6, 6, 6], [6, 6, 2], [6, 1, 4] and [1, 6, 6], whose shared nodes
    are not branch 0's; the first part with the ties of sort and top-k broken in index order, the
    second in reverse, as a GPU's may be (harness.TieOrder)."""
    # Power: the test's statistic is a sum of Pearson statistics, noncentral chi-square with
    # lambda >= n (2 TV)^2 for a term whose n rows follow a distribution at total variation TV from
    # the one tested (Cauchy-Schwarz: (sum |q - p|)^2 <= sum (q - p)^2 / p). A tree that shares the
    # nodes of branches with the same token at a depth (not the same prefix) reads the sample after
    # [1, 6] where [6, 6] was reached: TV 0.49 (the world's numbers, asserted below), on the 16.5%
    # of the steps that commit 6, 6 (3300 rows): lambda >= 3160. With 5 x 7 degrees of freedom the
    # critical value at 1e-5 is 83, and a statistic of mean 35 + 3160 and sd
    # sqrt(2 (35 + 2 x 3160)) = 113, 27 sd above it, falls below it with probability under 1e-100; at
    # depth 4 (after 6, 6, 6: TV 0.66 on 10% of the steps) alone, lambda >= 3480. One sample per node
    # at the first depth only (each branch drawing its own below it) was measured at a statistic of
    # 127 to 146 with 10,000 steps (three seeds; 103 to 120 of it after [1, 6]): with 20,000, about
    # 240, 5 sd above the critical value. A right answer fails with probability 1e-5.
    world = harness.context_target()
    conditionals = F.softmax(world(torch.stack([torch.cat([harness.PROMPT8[0], torch.tensor([BONUS, *p, 0])])
                                                for p in ((1, 6), (6, 6))]))[0], -1)   # (2, T, V)
    T0 = harness.PROMPT8.size(1)
    reach = conditionals[1, T0, 6] * conditionals[1, T0 + 1, 6]
    tv = 0.5 * (conditionals[0, T0 + 2] - conditionals[1, T0 + 2]).abs().sum()
    assert reach > 0.16 and tv > 0.45, f"the check's world is not the one its power was worked out for " \
                                       f"(reach {float(reach):.3f}, TV {float(tv):.3f})"
    for T, paths, tested, last in ((1.0, PATHS, TESTED, False), (0.6, PATHS_COLD, TESTED_COLD, True)):
        step_follows_p(impl, world, T, paths, tested, last)


def step_follows_p(impl, world, T, paths, tested, last):
    """STEPS steps of tree_step at T from PROMPT8 and BONUS with these branches, every sort and top-k
    in it breaking ties last index first if `last` (harness.TieOrder): the committed tokens after
    each prefix of `tested` against the target's conditional at T, one chi-square."""
    model = harness.float32(world)
    T0 = harness.PROMPT8.size(1)
    prefix = harness.PROMPT8.expand(STEPS, -1)
    paths = torch.tensor(paths).repeat(STEPS, 1, 1)           # rows of their own, as the drafter's argmax gives them
    cache = model.new_cache(STEPS, 32)
    model.forward_cached(prefix, cache)
    cache.commit(T0)
    with harness.TieOrder(last):
        n_acc, branch, nxt, _ = impl.tree_step(model, cache, torch.full((STEPS,), BONUS), paths,
                                               torch.ones(STEPS, dtype=torch.bool), T, torch.Generator().manual_seed(0))
    chosen = paths.gather(1, branch.view(STEPS, 1, 1).expand(STEPS, 1, 3)).squeeze(1)
    emitted = torch.cat([chosen, torch.zeros(STEPS, 1, dtype=torch.long)], 1)
    emitted.scatter_(1, n_acc[:, None], nxt[:, None])                     # the committed drafts, then the bonus
    length = n_acc + 1
    stat, df, parts, off = 0.0, 0, [], []
    for p in tested:
        j = len(p)
        rows = (length > j) & (emitted[:, :j] == torch.tensor(p, dtype=torch.long)).all(1)
        if not rows.any():
            raise harness.Fail(f"T = {T}: no step of {STEPS} committed {list(p)} and a token after it, which the "
                               f"target's samples do in about one step in ten or more; want the target's samples",
                               "what fits: drafts accepted by fewer than the samples that match them (a walk cut "
                               "short, or n_acc capped), or the bonus counted as a draft")
        logits = world(torch.cat([harness.PROMPT8[0], torch.tensor([BONUS, *p])])[None])[0][0, -1]
        s, d = harness.pearson(torch.bincount(emitted[rows, j], minlength=8).double(), F.softmax(logits / T, -1))
        stat, df = stat + s, df + d
        parts.append(f"after {list(p)}: {s:.0f} over {int(rows.sum())} steps")
        if s > harness.critical(d):
            off.append(p)
    crit = harness.critical(df)
    if not stat < crit:
        raise harness.Fail(f"T = {T}, branches {paths[0].tolist()}: the step's tokens are not the target's: "
                           f"chi-square {stat:.0f}, want below {crit:.0f} (p < {harness.ALPHA:g}); {'; '.join(parts)}",
                           sampling_hint(off) if T == 1.0 else cold_hint(off))


def sampling_hint(off):
    """What fits the tested prefixes whose next token is off, for the check above."""
    if () in off:
        return ("the first committed token is off already. What fits: a bonus drawn anew rather than the sample "
                "where the walk stopped, a draft accepted otherwise than by equalling the sample at its parent "
                "node, or the samples drawn at another temperature")
    if (1,) in off:
        return ("the first token is right, the one after the first token 1 (a node branches 0, 2, 3 and 4 share) is "
                "not. What fits: each branch drawing its own sample at a node it shares with another (one sample per "
                "node, shared), or a bonus drawn anew")
    if (1, 6) in off:
        return ("the first two tokens are right, the one after [1, 6] (a node branches 0, 3 and 4 share, two deep) "
                "is not. What fits: one sample per node at the first depth only, each branch drawing its own below "
                "it (one sample per node, shared, at every depth)")
    if off:
        return ("the tokens after [6, 6] or [6, 6, 6], branch 1's own nodes, are off, those after shared prefixes "
                "are not. What fits: nodes shared by the token at a depth rather than by the whole prefix (branch "
                "0 has 6 and 6 at those depths after another first token)")
    return ("no one of them is off by itself, together they are. What fits: a small bias at every node (a "
            "temperature slightly off, a bonus drawn anew now and then)")


def cold_hint(off):
    """What fits the tested prefixes whose next token is off at T = 0.6 (PATHS_COLD), for the check above."""
    at_t = " At T != 1: every token the step draws, the leaf's bonus too, is a sample of softmax(logits / T)"
    if () in off or not off:
        return sampling_hint(off) + at_t
    if (6,) in off or (6, 6) in off:
        return ("the tokens after [6] or [6, 6], nodes branches 1, 2 and 3 share (not branch 0), are off. What fits: "
                "nodes shared with branch 0 only (each other branch drawing its own sample), or the bonus read at "
                "the kept branch's own copy of a shared node: the walk read the first branch's copy, and here sort "
                "and top-k put equal values last index first, as a GPU's may, so a branch picked by sorting the "
                "counts is the last of the longest (argmax and max promise the first)")
    return ("the token after [6, 6, 6] is off: the walk stops there at a leaf, where nothing is tried. What fits: the "
            "leaf's bonus drawn otherwise than the other nodes' samples (untempered, or its argmax)." + at_t)


def test_sampling_is_lossless(impl):
    """Sampling is lossless. Through tree_generate with a K = 4 drafter's greedy branches at
    T = 1.3, every 4-token continuation of the 8-token world, whose next token depends on the last
    three, comes out with the target's probability (chi-square, 10,000 samples, p < 1e-5)."""
    # Measured on 4,096 continuations (pooled below 5 expected: about 480 cells), critical value 590:
    # the reference 463 and 464 at two seeds; a fresh bonus 4255 and 4597, shared nodes sampled anew
    # 1079 and 1114, branch 0's keys and values committed 1120 and 1169. (A tree that shares nodes by
    # the token at a depth passes here, 465, as random branches seldom reach such a node: the check
    # above is built for it.)
    model = harness.context_target()
    d = random_drafter(model.config)
    harness.assert_lossless(model, d, 1.3, n_rows=10000, m=4,
                            decoder=lambda *a, k=None, **kw: tree_generate(*a, step=impl.tree_step, **kw))


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device, nothing kept. tree_step, greedy
    and sampled, for three rows and for one, and sampled without a generator (the global RNG's
    draws), makes the host wait for nothing (tree_generate around it reads how far the rows are, as
    decode.generate does), draws from the generator it is given (the same seed, the same step,
    whatever the global RNG; without one, from the global RNG, two steps drawing anew and the same
    global seed drawing the same), dispatches as many ops for 6 rows or 5 drafts a branch as for 3
    rows of 3, makes no tensor off the device of its inputs (run on PyTorch's 'meta' device, which
    refuses a mix of devices as CUDA does), and five steps of one decode keep no more of the tensors
    they make, nor more bytes, than one call."""
    model = harness.tiny_target()
    for T, B, g in ((0.0, 3, 8), (1.0, 3, 8), (0.0, 1, 8), (1.0, 1, 8), (1.0, 3, None)):   # one row; no generator
        step_args = sized_step(model, B, 3)
        with harness.HostSyncs() as syncs:
            impl.tree_step(*step_args, T, None if g is None else torch.Generator().manual_seed(g))
        if syncs.seen:
            raise harness.Fail(f"T={T}, {B} row(s){', generator None' if g is None else ''}: host syncs "
                               f"{', '.join(sorted(set(syncs.seen)))}, want none",
                               "the ops listed make the host wait for the device: a value read back (.item(), int() "
                               "or bool() of a tensor, a Python if or loop bound on one), a shape that depends on "
                               "the data (boolean indexing, nonzero), or a draw that checks its input on the host "
                               "(torch.multinomial does, on a GPU)")
    # every draw from the generator: the same seed, the same step, whatever the global RNG's state
    outs = []
    for global_seed in (1, 2):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(global_seed)
            outs.append(impl.tree_step(*sized_step(model, 6, 3), 1.0, torch.Generator().manual_seed(8))[:3])
    if not all(torch.equal(a, b) for a, b in zip(*outs)):
        raise harness.Fail("T=1.0: the same generator seed, the global RNG seeded otherwise: the steps differ, want "
                           "the same", "some draw came from the global RNG, not from `generator` (torch.rand or "
                           "a sampler called without it)")
    # without a generator the draws are the global RNG's, which moves on: two steps draw anew; and
    # torch.manual_seed fixes them: the same seed, the same step
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        first, second = (impl.tree_step(*sized_step(model, 64, 3), 1.0, None)[:3] for _ in range(2))
        torch.manual_seed(3)
        again = impl.tree_step(*sized_step(model, 64, 3), 1.0, None)[:3]
    if all(torch.equal(a, b) for a, b in zip(first, second)):
        raise harness.Fail("T=1.0, generator None: two steps from the same 64 rows drew the same in every row, want "
                           "the global RNG's draws, which move on from call to call",
                           "what fits: a generator made and seeded inside tree_step when none is given (every step "
                           "then draws the same numbers)")
    if not all(torch.equal(a, b) for a, b in zip(first, again)):
        raise harness.Fail("T=1.0, generator None: the global RNG seeded alike, two runs of the same step from the "
                           "same 64 rows differ, want the same: the global RNG's draws, which torch.manual_seed fixes",
                           "what fits: a generator made inside tree_step when none is given and seeded by the "
                           "system (Generator.seed()), which torch.manual_seed does not reach: draw from the global "
                           "RNG instead (generator=None)")
    # rows and drafts a branch: other sizes, as many ops (K stays 4: a loop over it is allowed); each
    # call after a prefill of its own into a fresh cache, whose ops are the same at every size
    for T in (0.0, 1.0):
        harness.assert_no_python_loop(f"T={T}", [(f'B={B}, {n} drafts a branch', lambda B=B, n=n: impl.tree_step(
            *sized_step(model, B, n), T, torch.Generator().manual_seed(8))) for B, n in ((3, 3), (6, 3), (3, 5))])
    # nothing kept: steps of one decode (no autograd graph, as decode runs them: a graph through the
    # cache's buffers would keep every cache alive)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        prefix, cache = torch.randint(32, (3, 6), generator=g), model.new_cache(3, 64)
        model.forward_cached(prefix, cache)
        cache.commit(6)
        harness.assert_keeps_nothing('tree_step', lambda i: impl.tree_step(
            model, cache, prefix[:, -1].clone(), torch.randint(32, (3, 4, 3), generator=g),
            torch.ones(3, dtype=torch.bool), (0.0, 1.0)[i % 2], g))
    target = harness.on_meta(model)
    prefix = torch.randint(32, (3, 6), generator=torch.Generator().manual_seed(6))
    paths = torch.randint(32, (3, 4, 3), generator=torch.Generator().manual_seed(7))
    prefix, paths, active = (harness.on_meta(t) for t in (prefix, paths, torch.ones(3, dtype=torch.bool)))
    for T in (0.0, 1.0):
        with harness.autocast_off_on_meta():
            cache = target.new_cache(3, 32)
            target.forward_cached(prefix, cache)
        cache.commit(6)
        harness.assert_on_the_inputs_device(f"T={T}", lambda: impl.tree_step(target, cache, prefix[:, -1], paths,
                                                                             active, T, None))


def sized_step(model, B, n, K=4):
    """tree_step's arguments before T: B rows after a 6-token prefix in a fresh cache, K branches of
    n drafts."""
    g = torch.Generator().manual_seed(B * 10 + n)
    prefix, paths = torch.randint(32, (B, 6), generator=g), torch.randint(32, (B, K, n), generator=g)
    cache = model.new_cache(B, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    return model, cache, prefix[:, -1], paths, torch.ones(B, dtype=torch.bool)


def try_it(impl, tryout):
    """train.py's DBlast K = 4 drafter with greedy branches, at T = 0 and 1.5: your tree verification
    of all four branches next to the reference's (in a handout, the target alone), beside the
    project's verification of the drawn branch alone and of the mixture's conditionals, with a
    chi-square p-value of the second token under sampling."""
    d = tryout.drafter('dblast_K4.pt')
    d.sample_drafts = False
    tree = lambda code: dict(decoder=lambda *a, **kw: tree_generate(*a, step=code.tree_step, **kw))   # noqa: E731
    rows = []
    for T in (0.0, 1.5):
        for label, verify in (('drawn branch alone (verify=branch)', 'branch'), ("mixture's conditionals", 'mixture')):
            d.verify = verify
            rows.append(tryout.row(label, None, T, T > 0, drafter=d))
        rows += tryout.pair('tree of all 4 branches', T, T > 0, make=tree, drafter=d)
    d.sample_drafts, d.verify = True, 'mixture'
    tryout.table(rows, extra=[('p-value, 2nd token (4000 decodes)', 'p')])
