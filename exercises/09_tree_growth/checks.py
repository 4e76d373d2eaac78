"""Exercise 9's checks: a best-first token tree from a drafter's distributions (README.md). Each
check reads the tree your grow_tree returns, node by node, against an enumeration of every prefix."""
import itertools
import math

import torch

from exercises import harness

NAMES = ('grow_tree',)
SEAMS = {'decode.grow_tree': 'grow_tree'}
REFERENCE = {'grow_tree': 'heads.grow_tree'}   # in a handout: a call of student.py's
STUBS = {}   # nothing else of the project is this answer
MAY_USE = ('heads.Drafter.next_log_q', 'verification.tree_attend', 'verification.walk_down')


class World:
    """A drafter's distributions after every prefix of up to n tokens of a vocabulary of V, row by
    row: log_q(d, prefix) reads them from a table (vectorised: no loop of its own), and every node
    of the tree can be enumerated with its score."""

    def __init__(self, B, V, n, seed=0, table=None):
        g = torch.Generator().manual_seed(seed)
        self.B, self.V, self.n = B, V, n
        self.table = table or [torch.log_softmax(2 * torch.randn(B, V ** d, V, generator=g, dtype=torch.float64), -1)
                               for d in range(n)]
        self.given = []           # what log_q returned, and a copy: grow_tree must not write into it
        self.asked = []           # (d, a copy of the prefixes log_q was asked about)
        self.most = None          # how many prefixes one call may ask about (grown sets it: nodes + 1)
        self.refused = []         # the Fail log_q raised for a call that asked about more

    def log_q(self, d, prefix):
        self.ask(d, prefix)
        place = self.V ** torch.arange(d - 1, -1, -1, device=prefix.device)
        index = (prefix * place).sum(-1)                                              # (B, M)
        out = self.table[d].to(prefix.device).gather(1, index[..., None].expand(-1, -1, self.V))
        if out.device.type != 'meta':
            self.given.append((out, out.clone()))
            self.asked.append((d, prefix.clone()))
        return out

    def ask(self, d, prefix):
        """Refuse a call that asks about more than `most` prefixes, before its output is made: a
        depth's candidates are children of the `nodes` best of the depth before, and more is V ** d
        on a real vocabulary (nodes + 1: a kept list with the bonus in it). Refused at once, since
        on the real vocabulary of test_a_real_vocabulary that output would not fit in memory."""
        M = prefix.size(1) if prefix.dim() == 3 else 0
        if self.most is not None and M > self.most:
            self.refused.append(harness.Fail(
                f"log_q was asked about {M} prefixes of {d} token{'' if d == 1 else 's'} in one call, want at most "
                f"nodes + 1 = {self.most} ({self.most - 1} nodes, V = {self.V}, n = {self.n})",
                "the candidates at depth j are the `nodes` best children of depth j-1's `nodes` best candidates, so "
                "log_q is asked about those alone: what fits is every prefix enumerated (V ** d at depth d: on "
                "GPT-2's V = 50304, 2.5e9 at depth 2)"))
            raise self.refused[-1]

    def score(self, b, path):
        """The score of the node whose prefix is `path` (a tuple of tokens), in row b."""
        total = 0.0
        for d, token in enumerate(path):
            index = sum(t * self.V ** (d - 1 - i) for i, t in enumerate(path[:d]))
            total += float(self.table[d][b, index, token])
        return total

    def nodes(self, b):
        return {path: self.score(b, path) for j in range(1, self.n + 1)
                for path in itertools.product(range(self.V), repeat=j)}

    def m(self, nodes):
        return min(nodes, sum(min(nodes, self.V ** j) for j in range(1, self.n + 1)))


def grown(impl, world, nodes):
    world.given.clear()
    world.asked.clear()
    world.refused.clear()
    world.most = nodes + 1
    tokens, tree = impl.grow_tree(world.log_q, world.B, world.n, nodes, 'cpu')
    if world.refused:                  # raised inside grow_tree, which went on all the same
        raise world.refused[0]
    m = world.m(nodes)
    for name, t, shape in (('tokens', tokens, (world.B, m)), ('tree', tree, (world.B, 2, 1 + m))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.long:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            shaped = isinstance(t, torch.Tensor) and tuple(t.shape) == shape
            raise harness.Fail(f"{name} is {got}, want {shape} torch.int64 (m = {m} for {nodes} nodes, V = {world.V}, "
                               f"n = {world.n})", "long (int64) integers: decode indexes with them" if shaped else
                               "m = min(nodes, c_1 + .. + c_n) with c_j = min(nodes, V ** j): the nodes the "
                               "depth-by-depth search has as candidates, at most `nodes`")
    for d, (out, before) in enumerate(world.given):
        if not torch.equal(out, before):
            raise harness.Fail(f"log_q's output (call {d}) was changed by grow_tree, want it left as it was",
                               "what fits: an in-place add into what log_q returned (score += ..., .add_()). A "
                               "drafter may return a view of its own tensors (heads.BlockHeads.next_log_q returns an "
                               "expand, which cannot be written into): add out of place, score[..., None] + log_q")
    bad_token = (tokens < 0) | (tokens >= world.V)
    bad_depth = (tree[:, 1] < 0) | (tree[:, 1] > world.n)
    if bad_token.any() or bad_depth.any():
        b, j = (int(x) for x in (bad_token if bad_token.any() else bad_depth[:, 1:]).nonzero()[0])
        raise harness.Fail(f"row {b}, slot {j + 1}: token {int(tokens[b, j])} at depth {int(tree[b, 1, j + 1])}, want "
                           f"a token of the vocabulary (0 to {world.V - 1}) at a depth of 0 to {world.n}, padding "
                           f"too", "the target reads every slot, padding included (its token is embedded, its depth "
                           "is a position), and only its parent -1 keeps the walk off it: pad with any token of "
                           "the vocabulary, at any depth up to n")
    return tokens, tree


def paths(tokens, tree, b, n):
    """{slot: its prefix (a tuple of tokens)} of row b, each slot checked against its parent's
    (padding left out), or a Fail naming the first slot that is not a node of a tree."""
    parent, depth = tree[b, 0].tolist(), tree[b, 1].tolist()
    if parent[0] != 0 or depth[0] != 0:
        raise harness.Fail(f"row {b}: slot 0 (the bonus) has parent {parent[0]}, depth {depth[0]}; want 0 and 0",
                           "slot 0 is the bonus: its own parent, at depth 0")
    found = {0: ()}
    for j in range(1, len(parent)):
        up = parent[j]
        if up == -1:
            continue
        if not 0 <= up < j:
            raise harness.Fail(f"row {b}: slot {j}'s parent is slot {up}; want a slot before it (or -1, padding)",
                               "What fits: a parent's candidate index (or id) taken for its slot, where a table from "
                               "ids to slots is needed; or slots in an order where a child can come before its "
                               "parent")
        if up not in found:
            raise harness.Fail(f"row {b}: slot {j}'s parent, slot {up}, is padding",
                               "padding (parent -1) is for nodes of score -inf only, and has no children. What fits: "
                               "a node's score taken otherwise than the sum of log_q along its whole prefix (its own "
                               "token's alone, or a prefix that lost its earlier tokens), so that a node of some "
                               "probability is judged -inf, or is kept without its parent")
        if depth[j] != depth[up] + 1 or depth[j] > n:
            raise harness.Fail(f"row {b}: slot {j} at depth {depth[j]} has its parent, slot {up}, at depth "
                               f"{depth[up]}; want {depth[up] + 1}",
                               "What fits: depths counted otherwise than the bonus 0 and a first drafted token 1; "
                               "a parent slot that is not the parent's (the ids-to-slots table); or a node chosen "
                               "without its parent, which the m best, ties to the shallower, never are (a child "
                               "never scores more than its parent)")
        found[j] = found[up] + (int(tokens[b, j - 1]),)
    seen = {}
    for j, path in found.items():
        if path in seen:
            raise harness.Fail(f"row {b}: slots {seen[path]} and {j} are the same node {list(path)}",
                               "a node is a prefix: two children of one parent hold different tokens")
        seen[path] = j
    return found


def nodes_of(tokens, tree, n):
    """Row 0's drafted nodes, each a prefix (a tuple of tokens), sorted; padding left out."""
    return sorted(p for s, p in paths(tokens, tree, 0, n).items() if s)


def scores_of(world, b, found):
    return sorted((world.score(b, p) for s, p in found.items() if s), reverse=True)


def best_nodes(impl, world, nodes, what='', hint=None):
    """Fail unless each row's chosen nodes are its world.m(nodes) best. hint: what fits in this
    world, where the chosen scores are not the best (None: said from how many are missing)."""
    tokens, tree = grown(impl, world, nodes)
    for b in range(world.B):
        found = paths(tokens, tree, b, world.n)
        got, want = scores_of(world, b, found), sorted(world.nodes(b).values(), reverse=True)[:world.m(nodes)]
        if len(got) != len(want) or any(abs(g - w) > 1e-9 for g, w in zip(got, want)):
            missing = (f"{len(want) - len(got)} slot(s) fewer hold a node of some probability than there are: "
                       f"such nodes marked padding, or reached through a wrong parent (a parent's index into another "
                       f"list than its depth's kept nodes)" if len(got) < len(want) else '')
            raise harness.Fail(f"{what}row {b}: the chosen nodes' scores {[round(x, 3) for x in got]}, want the "
                               f"{len(want)} best {[round(x, 3) for x in want]}", missing if hint is None else hint)


def test_the_best_nodes(impl):
    """The m best nodes. In a world of V = 3 tokens and n = 3 depths (39 prefixes a row, each
    enumerated with its score), 7 nodes: the chosen nodes' scores are the 7 best scores of each row;
    with V = 2, n = 2 and 10 nodes, m is the 6 prefixes there are; where the 3 best are all at
    depth 1 (flat_world); 12 nodes of V = 16 that hold the child of the 11th best first token, or 11
    children of one node (wide_world); and the first world again with its log q in float32, as
    every drafter's is.
    Hint: a node's score is the sum of log_q along its whole prefix (the log of the product of its
    tokens' probabilities); at each depth the `nodes` best children of the last depth's best are the
    candidates, and of all depths' candidates the `nodes` best are taken."""
    for world, nodes in ((World(B=2, V=3, n=3, seed=0), 7), (World(B=1, V=2, n=2, seed=5), 10), (flat_world(), 3)):
        best_nodes(impl, world, nodes)
    best_nodes(impl, wide_world(), 12, what='12 nodes, V = 16 (wide_world): ',
               hint="here row 0's 12 best nodes are its 11 likely first tokens and the one child of the 11th, and "
                    "row 1's its likely first token and 11 of its children. What fits: fewer than `nodes` kept at a "
                    "depth, or fewer than `nodes` children taken of a node (EAGLE-2's top_k, 10, a constant apart "
                    "from its total_tokens): the candidates at depth j are the `nodes` best children of depth j-1's "
                    "`nodes` best")
    # a drafter's log q is float32 (heads.scores_from, prompt lookup's counts): the checks' other
    # worlds are float64, where a constant beyond float32's range still fits
    single = World(B=2, V=3, n=3, table=[t.float() for t in World(B=2, V=3, n=3, seed=0).table])
    try:
        best_nodes(impl, single, 7, what='float32 log q: ')
    except (AssertionError, NotImplementedError):
        raise
    except Exception as e:
        raise harness.Fail(f"float32 log q (as every drafter's): {type(e).__name__}: {harness.first_line(e)}"
                           f"{harness.where_in_student(e)}; want the tree, as from float64",
                           "the same code runs on float64 log q: what fits is a constant float32 cannot hold "
                           "(torch.finfo(torch.float64).min, say) filled into log q's own dtype, which masked_fill "
                           "refuses. Keep -inf as it is, or take a constant from torch.finfo(log q's dtype)")


def flat_world():
    """V = 4, n = 2: the first token uniform, the second at 1/2, 3/10, 1/10, 1/10: the 3 best nodes
    are all at depth 1, so each depth's candidates must be its `nodes` best, none fewer."""
    first = torch.full((1, 1, 4), math.log(0.25), dtype=torch.float64)
    then = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64).log().expand(1, 4, 4).clone()
    return World(B=1, V=4, n=2, table=[first, then])


def wide_world():
    """V = 16, n = 2, 12 nodes, two rows. Row 0: 11 likely first tokens (0 to 10, about 1/11 each,
    the 11th the least), whose children are uniform but for token 10's, which is token 0 for sure:
    its 12 best nodes are the 11 first tokens and [10, 0]. Row 1: one likely first token (0), and 16
    children of it about 1/16 each: its 12 best are [0] and 11 of them. A frontier of fewer than
    12 nodes a depth misses [10, 0], fewer than 12 children a node misses row 1's last."""
    first = torch.full((2, 1, 16), -20.0, dtype=torch.float64)
    first[0, 0, :11] = torch.log(1 - 0.01 * torch.arange(11, dtype=torch.float64))
    first[1, 0, 0] = 0.0
    then = torch.zeros(2, 16, 16, dtype=torch.float64)
    then[0, 10, 1:] = -30.0                                             # after 10: token 0 for sure
    then[1, 0] = -0.01 * torch.arange(16, dtype=torch.float64)         # after 0: 16 close children
    return World(B=2, V=16, n=2, table=[torch.log_softmax(first, -1), torch.log_softmax(then, -1)])


def test_every_row_is_a_tree(impl):
    """Every row is a tree. 3 rows, V = 5, n = 4 depths, 12 nodes: slot 0 is the bonus, each other
    slot's parent is a slot before it, one depth up, siblings hold different tokens, and each row's
    nodes are that row's best.
    Hint: the scores say which nodes are off. What fits: a node's score (the sum of log_q along its
    whole prefix, carried from depth to depth with the prefix itself), the candidates (the `nodes`
    best children of the last depth's `nodes` best), or a row's nodes taken from another row."""
    best_nodes(impl, World(B=3, V=5, n=4, seed=1), 12)


def tie_world():
    """V = 3, n = 2: tokens 0 and 1 at depth 1 with probability 1/2 each, then token 0 for sure: four
    nodes of equal score (0, 1, 00, 10), the rest of probability 0."""
    half, sure = math.log(0.5), 0.0
    first = torch.tensor([[[half, half, -math.inf]]], dtype=torch.float64)
    then = torch.tensor([[[sure, -math.inf, -math.inf]] * 3], dtype=torch.float64)
    return World(B=1, V=3, n=2, table=[first, then])


def test_ties_go_to_the_shallower(impl):
    """Ties go to the shallower. Nodes 0, 1, 00 and 10 score the same (1/2 each) and 3 are taken:
    both depth-1 nodes and one child, never a child without its parent; and a tie between depths 2
    and 3 goes to depth 2, whatever the parents score (deeper_tie_world). Run twice: every sort and
    top-k that does not ask for stable=True breaks its ties first by index, then the other way
    round, as a GPU may (harness.TieOrder). And a near tie is no tie: a depth-2 node better by 2^-21
    than a depth-1 node comes first (near_tie_world).
    Hint: of equal scores the shallower first (a stable sort of the candidates in depth order keeps
    it so); a child never scores more than its parent, so then every chosen node's parent is chosen."""
    wants = ((tie_world(), 3, ([(0,), (0, 0), (1,)], [(0,), (1,), (1, 0)]),
              "want [0], [1] and one of [0, 0], [1, 0]", "both depth-1 nodes, then one child"),
             (deeper_tie_world(), 5, ([(0,), (0, 0), (0, 1), (1,), (1, 0)],),
              "want [0], [0, 0], [1], [0, 1] and [1, 0]", "[1, 0] (depth 2) before [0, 0, 0] (depth 3), whatever "
              "their parents score"))
    for world, nodes, right, want, which in wants:
        for last in (False, True):
            with harness.TieOrder(last):
                tokens, tree = grown(impl, world, nodes)
            chosen = nodes_of(tokens, tree, world.n)
            if chosen not in right:
                raise harness.Fail(f"the chosen nodes {[list(p) for p in chosen]}, {want}"
                                   + (" (here every sort without stable=True put equal values last index first, as "
                                      "a GPU may)" if last else ''),
                                   f"of equal scores the shallower first: {which}"
                                   + (". A sort's order of equal values is unspecified unless it asks for stable=True, "
                                      "and top-k's always is" if last else ''))
    tokens, tree = grown(impl, near_tie_world(), 2)
    chosen = nodes_of(tokens, tree, 2)
    if chosen != [(0,), (0, 0)]:
        raise harness.Fail(f"the chosen nodes {[list(p) for p in chosen]}, want [0] and [0, 0]: [0, 0] scores "
                           f"-1 + 2^-21, more than [1]'s -1",
                           "equal scores alone go to the shallower; a deeper node that scores more, by however "
                           "little, comes first. What fits: ties broken by a penalty on depth (score - eps * depth), "
                           "which outweighs a real difference smaller than eps. Break them exactly: a stable sort of "
                           "the candidates in depth order")


def deeper_tie_world():
    """V = 3, n = 3, whole-nat log q: nodes 0, 00, 1, 01 score -1, -2, -3, -4, and 10 and 000 tie at
    -5, the rest -inf: of 5 nodes the fifth is 10, the shallower, though 000's parent scores more."""
    inf = math.inf
    first = torch.tensor([[[-1.0, -3.0, -inf]]], dtype=torch.float64)
    then = torch.tensor([[[-1.0, -3.0, -inf], [-2.0, -inf, -inf], [-inf, -inf, -inf]]], dtype=torch.float64)
    last = torch.full((1, 9, 3), -inf, dtype=torch.float64)
    last[0, 0, 0] = -3.0                                                     # 000: -1 - 1 - 3
    return World(B=1, V=3, n=3, table=[first, then, last])


def near_tie_world():
    """V = 2, n = 2: [0] scores -0.5, [0, 0] -1 + 2^-21 and [1] -1, the rest -5 or less: of 2 nodes
    the second is [0, 0], the deeper. The gap is below a 1e-6 penalty on depth, and a power of 2
    that float32 and float64 sums both keep exactly."""
    gap = 2.0 ** -21
    first = torch.tensor([[[-0.5, -1.0]]], dtype=torch.float64)
    then = torch.tensor([[[-0.5 + gap, -5.0], [-5.0, -5.0]]], dtype=torch.float64)
    return World(B=1, V=2, n=2, table=[first, then])


def test_padding_where_the_drafter_gives_no_probability(impl):
    """Padding where the drafter gives nothing. Only 3 nodes of V = 4, n = 2 have probability (0,
    then 00 and 01); of the 6 slots the other 3 are padding: parent -1, which no walk follows. The
    same with V = 2, where the padding holds the children of node 1 (probability 0), whose own
    tokens have probability 1/2 each. And a node of probability e^-120, e^-800 or e^-100000 is a
    node, not padding.
    Hint: a candidate of score -inf is still taken when fewer than m have more (static shapes), but
    its parent slot is -1."""
    four = World(B=1, V=4, n=2, table=[
        torch.tensor([[[0.0, -math.inf, -math.inf, -math.inf]]], dtype=torch.float64),
        torch.tensor([[[math.log(0.5), math.log(0.5), -math.inf, -math.inf]] * 4], dtype=torch.float64)])
    # below a node of no probability, children whose own token has some: their score is still -inf
    two = World(B=1, V=2, n=2, table=[torch.tensor([[[0.0, -math.inf]]], dtype=torch.float64),
                                      torch.full((1, 2, 2), math.log(0.5), dtype=torch.float64)])
    for world, what, hint in ((four, '', ''), (two, "V = 2: ", "a child of a node of probability 0 has probability 0 "
                                                "whatever its own token's: what fits is padding judged by the node's "
                                                "own token's log q rather than its prefix's score")):
        tokens, tree = grown(impl, world, 6)
        parent = tree[0, 0].tolist()
        real = nodes_of(tokens, tree, world.n)
        if real != [(0,), (0, 0), (0, 1)] or parent.count(-1) != 3:
            raise harness.Fail(f"{what}parents {parent}, the nodes they make {[list(p) for p in real]}; want [0], "
                               f"[0, 0] and [0, 1], and the other 3 slots padding (parent -1)"
                               + (", [1]'s children among them" if what else ''), hint)
    # node 1 has a tiny probability, and is a node all the same: at -120 a float32 probability is 0,
    # at -800 a float64 one (below e^-745), and -100000 is below a finite stand-in for -inf that real
    # scores can reach (-1e4, the attention mask's)
    for faint, why in ((-120.0, "a score kept as a probability in float32, which rounds e^-120 to 0"),
                       (-800.0, "a score kept as a probability in float64, which rounds e^-800 to 0 (below e^-745)"),
                       (-1e5, "-inf replaced by a finite floor (the -1e4 of an attention mask, say) and a node at or "
                              "below it taken for padding: a real score can be lower")):
        world = World(B=1, V=3, n=2, table=[torch.tensor([[[0.0, faint, -math.inf]]], dtype=torch.float64),
                                            torch.tensor([[[0.0, -math.inf, -math.inf]] * 3], dtype=torch.float64)])
        tokens, tree = grown(impl, world, 3)
        real = nodes_of(tokens, tree, world.n)
        if real != [(0,), (0, 0), (1,)]:
            raise harness.Fail(f"node [1] of score {faint:g} (probability e^{faint:g}): the nodes "
                               f"{[list(p) for p in real]}, want [0], [0, 0] and [1], none padding",
                               f"padding is for a score of -inf alone: what fits is {why} (log space keeps every "
                               f"score, and -inf as it is)")


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device. grow_tree makes the host wait for
    nothing, dispatches as many ops for 5 rows or 11 nodes as for 2 rows of 6 (its loop over the n
    depths aside), with V = 5 tokens and with 16, and makes no tensor off `device` (run on PyTorch's
    'meta' device, which refuses a mix of devices as CUDA does)."""
    world = World(B=2, V=5, n=3, seed=2)
    with harness.HostSyncs() as syncs:
        impl.grow_tree(world.log_q, 2, 3, 6, 'cpu')
    if syncs.seen:
        raise harness.Fail(f"host syncs: {', '.join(sorted(set(syncs.seen)))}, want none",
                           "the ops listed make the host wait for the device: a value read back (.item(), a Python "
                           "if on a tensor) or a shape that depends on the data (boolean indexing, nonzero, "
                           "bincount, which on CUDA reads its input's max back even given minlength)")
    # V = 5, fewer tokens than nodes, and V = 16, more: a loop over min(nodes, V) (each parent's
    # children one rank at a time) runs 5 times at every size of the first, and counts the nodes in
    # the second
    for V in (5, 16):
        sizes = [(f'B={B}, nodes={m}, V={V}', World(B=B, V=V, n=3, seed=3), m) for B, m in ((2, 6), (5, 6), (2, 11))]
        calls = [(size, lambda w=w, m=m: impl.grow_tree(w.log_q, w.B, 3, m, 'cpu')) for size, w, m in sizes]
        try:
            harness.assert_no_python_loop('grow_tree', calls)
        except harness.Fail as e:
            raise harness.Fail(str(e), "more rows or nodes, more operations: a Python loop over them (a for over "
                               "range(B) or over the nodes, a list comprehension, torch.stack or torch.cat of per-row "
                               "or per-node results)" + (", here where V is more than the nodes: a for over "
                               "range(min(nodes, V)), a parent's children found one rank at a time (topk finds them "
                               "at once)" if V > max(m for _, _, m in sizes) else '')
                               + ". On a GPU each op is a kernel launch") from None
    meta = World(B=2, V=5, n=3, table=[t.to('meta') for t in world.table])
    harness.assert_on_the_inputs_device('grow_tree', lambda: impl.grow_tree(meta.log_q, 2, 3, 6, 'meta'), strict=True)


class Heads(World):
    """BPD's heads on a real vocabulary: each depth's log q the same whatever the prefix, float32 and
    an expand that cannot be written into (as heads.BlockHeads.next_log_q's), V = 50304 (GPT-2's,
    padded). At each depth one token of row b, chain[b, d], has probability about 0.9998, the
    others about 2e-8: the `n` best nodes are the chain's prefixes. Its tokens are in the upper half
    of the vocabulary, so that a prefix of 5 of them, coded as one integer, is past int64."""

    def __init__(self, B, V, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.B, self.V, self.n = B, V, n
        self.chain = torch.randint(V // 2, V, (B, n), generator=g)
        logits = torch.randn(B, n, V, generator=g).scatter_(2, self.chain[..., None], 20.0)
        self.heads = torch.log_softmax(logits, -1)                                    # (B, n, V) float32
        self.given, self.asked, self.most, self.refused = [], [], None, []

    def log_q(self, d, prefix):
        self.ask(d, prefix)
        out = self.heads[:, d, None].expand(-1, prefix.size(1), -1)
        self.given.append((out, out.clone()))
        self.asked.append((d, prefix.clone()))
        return out


def test_a_real_vocabulary(impl):
    """Prefixes on a real vocabulary. BPD's heads, whose q does not read the prefix, on GPT-2's
    V = 50304 tokens, n = 6 (k = 7), 6 nodes, 2 rows: each row's tree is its chain of likely tokens,
    and log_q was asked about each chosen node's parent's prefix, token for token (a q that reads no
    prefix cannot show a wrong one: this check reads what log_q was asked); and again under bfloat16
    autocast, as generate.py --dtype bfloat16 grows the tree, where the same chain is the tree."""
    world = Heads(B=2, V=50304, n=6)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        tokens, tree = grown(impl, world, 6)
    for b in range(world.B):
        found = paths(tokens, tree, b, world.n)
        real = sorted(p for s, p in found.items() if s)
        chain = tuple(world.chain[b].tolist())
        if real != [chain[:j] for j in range(1, world.n + 1)]:
            raise harness.Fail(f"under bfloat16 autocast (generate.py --dtype bfloat16): row {b}'s nodes "
                               f"{[list(p) for p in real]}, want the chain {list(chain)} and its prefixes, as "
                               f"without autocast", "autocast runs a matrix product of float32 tensors (einsum, @, "
                               "bmm, matmul) in bfloat16, 3 significant digits: above 256 it holds only some whole "
                               "numbers, so a token (or an id) picked by a product with a one-hot comes back "
                               "rounded, and the tree drafts tokens no head proposed. Pick with gather, or switch "
                               "autocast off on `device` (torch.autocast(torch.device(device).type, enabled=False))")
    world = Heads(B=2, V=50304, n=6)
    tokens, tree = grown(impl, world, 6)
    for b in range(world.B):
        found = paths(tokens, tree, b, world.n)
        chain = tuple(world.chain[b].tolist())
        real = sorted(p for s, p in found.items() if s)
        if real != [chain[:j] for j in range(1, world.n + 1)]:
            raise harness.Fail(f"row {b}: the nodes {[list(p) for p in real]}, want the chain {list(chain)} and "
                               f"its prefixes, of probability 0.9998 a token", "the best nodes follow each depth's "
                               "likely token: what fits is a node's score or token taken from another row or depth, "
                               "or a candidate's index into the flattened children not split by V (index // V, "
                               "index % V)")
        for s, p in sorted(found.items()):
            asked = [tuple(x) for d, prefix in world.asked if d == len(p) - 1 for x in prefix[b].tolist()]
            if s and p[:-1] not in asked:
                raise harness.Fail(f"row {b}: slot {s}'s parent has the prefix {list(p[:-1])}, and log_q was asked "
                                   f"about {[list(x) for x in asked[:2]]}{' ..' if len(asked) > 2 else ''} at depth "
                                   f"{len(p) - 1}; want its children scored after its own prefix",
                                   "a prefix must reach log_q token for token: what fits is a prefix carried in a "
                                   "form that loses tokens, such as one integer, parent * V + token, which passes "
                                   "int64's 9.2e18 at 5 tokens of GPT-2's 50304 (or 8 of 256 bytes); carry the "
                                   "(B, M, d) tokens themselves, gathered by parent and extended by one a depth")


def test_nothing_kept_from_call_to_call(impl):
    """Nothing kept from call to call. Five trees keep no more of the tensors they make, nor
    more bytes, than one call: decode grows a tree at every step, and a list that every call adds
    to is memory that grows with the tokens decoded."""
    def call(seed):
        world = World(B=2, V=5, n=3, seed=seed)
        impl.grow_tree(world.log_q, 2, 3, 6, 'cpu')
        world.given.clear()
        world.asked.clear()
    harness.assert_keeps_nothing('grow_tree', call)
