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
MAY_USE = ('heads.Drafter.next_log_q', 'decode.tree_attend', 'decode.walk_down')


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

    def log_q(self, d, prefix):
        place = self.V ** torch.arange(d - 1, -1, -1, device=prefix.device)
        index = (prefix * place).sum(-1)                                              # (B, M)
        out = self.table[d].to(prefix.device).gather(1, index[..., None].expand(-1, -1, self.V))
        if out.device.type != 'meta':
            self.given.append((out, out.clone()))
        return out

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
    tokens, tree = impl.grow_tree(world.log_q, world.B, world.n, nodes, 'cpu')
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


def best_nodes(impl, world, nodes):
    tokens, tree = grown(impl, world, nodes)
    for b in range(world.B):
        found = paths(tokens, tree, b, world.n)
        got, want = scores_of(world, b, found), sorted(world.nodes(b).values(), reverse=True)[:world.m(nodes)]
        if len(got) != len(want) or any(abs(g - w) > 1e-9 for g, w in zip(got, want)):
            raise harness.Fail(f"row {b}: the chosen nodes' scores {[round(x, 3) for x in got]}, want the "
                               f"{len(want)} best {[round(x, 3) for x in want]}",
                               f"{len(want) - len(got)} slot(s) fewer hold a node of some probability than there "
                               f"are: such nodes marked padding, or reached through a wrong parent (a parent's "
                               f"index into another list than its depth's kept nodes)" if len(got) < len(want)
                               else '')


def test_the_best_nodes(impl):
    """The m best nodes. In a world of V = 3 tokens and n = 3 depths (39 prefixes a row, each
    enumerated with its score), 7 nodes: the chosen nodes' scores are the 7 best scores of each row;
    with V = 2, n = 2 and 10 nodes, m is the 6 prefixes there are; and where the 3 best are all at
    depth 1 (flat_world).
    Hint: a node's score is the sum of log_q along its whole prefix (the log of the product of its
    tokens' probabilities); at each depth the `nodes` best children of the last depth's best are the
    candidates, and of all depths' candidates the `nodes` best are taken."""
    for world, nodes in ((World(B=2, V=3, n=3, seed=0), 7), (World(B=1, V=2, n=2, seed=5), 10), (flat_world(), 3)):
        best_nodes(impl, world, nodes)


def flat_world():
    """V = 4, n = 2: the first token uniform, the second at 1/2, 3/10, 1/10, 1/10: the 3 best nodes
    are all at depth 1, so each depth's candidates must be its `nodes` best, none fewer."""
    first = torch.full((1, 1, 4), math.log(0.25), dtype=torch.float64)
    then = torch.tensor([0.5, 0.3, 0.1, 0.1], dtype=torch.float64).log().expand(1, 4, 4).clone()
    return World(B=1, V=4, n=2, table=[first, then])


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
    round, as a GPU may (harness.TieOrder).
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


def deeper_tie_world():
    """V = 3, n = 3, whole-nat log q: nodes 0, 00, 1, 01 score -1, -2, -3, -4, and 10 and 000 tie at
    -5, the rest -inf: of 5 nodes the fifth is 10, the shallower, though 000's parent scores more."""
    inf = math.inf
    first = torch.tensor([[[-1.0, -3.0, -inf]]], dtype=torch.float64)
    then = torch.tensor([[[-1.0, -3.0, -inf], [-2.0, -inf, -inf], [-inf, -inf, -inf]]], dtype=torch.float64)
    last = torch.full((1, 9, 3), -inf, dtype=torch.float64)
    last[0, 0, 0] = -3.0                                                     # 000: -1 - 1 - 3
    return World(B=1, V=3, n=3, table=[first, then, last])


def test_padding_where_the_drafter_gives_no_probability(impl):
    """Padding where the drafter gives nothing. Only 3 nodes of V = 4, n = 2 have probability (0,
    then 00 and 01); of the 6 slots the other 3 are padding: parent -1, which no walk follows. The
    same with V = 2, where the padding holds the children of node 1 (probability 0), whose own
    tokens have probability 1/2 each. And a node of probability e^-120 is a node, not padding.
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
    # node 1 has probability e^-120: tiny, and a node all the same
    faint = World(B=1, V=3, n=2, table=[torch.tensor([[[0.0, -120.0, -math.inf]]], dtype=torch.float64),
                                        torch.tensor([[[0.0, -math.inf, -math.inf]] * 3], dtype=torch.float64)])
    tokens, tree = grown(impl, faint, 3)
    real = nodes_of(tokens, tree, faint.n)
    if real != [(0,), (0, 0), (1,)]:
        raise harness.Fail(f"node [1] of score -120 (probability e^-120): the nodes {[list(p) for p in real]}, want "
                           f"[0], [0, 0] and [1], none padding", "padding is for a score of -inf alone: what fits is "
                           "a score kept as a probability in float32, which rounds e^-120 to 0 (log space keeps it)")


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device. grow_tree makes the host wait for
    nothing, dispatches as many ops for 5 rows or 11 nodes as for 2 rows of 6 (its loop over the n
    depths aside), and makes no tensor off `device` (run on PyTorch's 'meta' device, which refuses a
    mix of devices as CUDA does)."""
    world = World(B=2, V=5, n=3, seed=2)
    with harness.HostSyncs() as syncs:
        impl.grow_tree(world.log_q, 2, 3, 6, 'cpu')
    if syncs.seen:
        raise harness.Fail(f"host syncs: {', '.join(sorted(set(syncs.seen)))}, want none",
                           "the ops listed make the host wait for the device: a value read back (.item(), a Python "
                           "if on a tensor) or a shape that depends on the data (boolean indexing, nonzero)")
    sizes = [(f'B={B}, nodes={m}', World(B=B, V=5, n=3, seed=3), m) for B, m in ((2, 6), (5, 6), (2, 11))]
    harness.assert_no_python_loop('grow_tree', [(size, lambda w=w, m=m: impl.grow_tree(w.log_q, w.B, 3, m, 'cpu'))
                                                for size, w, m in sizes])
    meta = World(B=2, V=5, n=3, table=[t.to('meta') for t in world.table])
    harness.assert_on_the_inputs_device('grow_tree', lambda: impl.grow_tree(meta.log_q, 2, 3, 6, 'meta'), strict=True)
