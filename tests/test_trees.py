"""Token trees from the drafters' own distributions (generate's nodes=M, MATH.md §10): the tree a
drafter grows is the best prefix-closed set of its nodes, each slot sees its ancestors, greedy
walks give plain greedy decoding's tokens, the sampled walk attains p(D) at every node and is
lossless (chi-square over every 3-token continuation of the 8-token world, k = 4 and k = 2), and
the same test catches a walk whose draws are not independent."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import decode
import runner
import verification
from cli import BadInput
from conftest import V8, V8_PROMPT, naive_greedy, peaky, tiny_model
from dblast import DBlastDrafter
from decode import generate
from heads import BlockHeads, Drafter, Text, grow_tree, sample_tree, tree_size
from model import GPT, sample
from test_sampling import chi_square, continuation_probs, make_drafter
from verification import tree_attend, walk_down

V = V8.vocab_size


@pytest.fixture(scope='module')
def target8():
    return peaky(GPT(V8), 0.3, 0).float()


def brute_force_tree(log_q, n, nodes):
    """The tree grow_tree must take, by enumeration for one row: every prefix of up to n tokens,
    scored by its summed log q, the `nodes` best with ties to the shallower and then to the
    earlier (prefix-closed by construction), as sets of prefixes."""
    V = log_q(0, torch.zeros(1, 1, 0, dtype=torch.long)).size(-1)
    scored = []
    for d in range(1, n + 1):
        for prefix in itertools.product(range(V), repeat=d):
            s = sum(float(log_q(j, torch.tensor([[prefix[:j]]], dtype=torch.long))[0, 0, prefix[j]]) for j in range(d))
            scored.append((-s, d, prefix))
    scored.sort(key=lambda x: (x[0], x[1]))
    return {p for s, d, p in scored[:nodes] if s < math.inf}


def prefixes_of(tokens, tree):
    """The set of drafted prefixes (tuples) of a grown tree's valid slots, row 0."""
    parent, depth = tree[0, 0].tolist(), tree[0, 1].tolist()
    toks = [None] + tokens[0].tolist()
    out = {}
    for s in range(1, len(toks)):
        if parent[s] < 0:
            continue
        assert parent[s] < s and depth[s] == depth[parent[s]] + 1   # parents first, one deeper
        out[s] = (out[parent[s]] if parent[s] else ()) + (toks[s],)
    return set(out.values())


@pytest.mark.parametrize('nodes', [1, 5, 12])
def test_grow_tree_takes_the_best_prefix_closed_set(nodes):
    """For a mixture drafter (whose conditionals follow the prefix) the grown tree is exactly the
    `nodes` most probable drafted prefixes, each with its parent, siblings holding distinct tokens;
    a drafter that gives fewer tokens any probability pads the rest, and no padding is a parent."""
    torch.manual_seed(0)
    cfg = GPT(V8).config
    d = peaky(DBlastDrafter(cfg, 4, 3), 0.4, 3).double()
    model = peaky(GPT(V8), 0.3, 0).double()
    h, bonus = torch.randn(1, V8.n_embd, dtype=torch.float64), torch.tensor([3])
    log_q = d.next_log_q(h, bonus, model, 4, 1.0)
    tokens, tree = grow_tree(log_q, 1, 3, nodes, 'cpu')
    assert tokens.shape == (1, nodes) and tree.shape == (1, 2, nodes + 1)
    assert prefixes_of(tokens, tree) == brute_force_tree(log_q, 3, nodes)
    # a larger budget holds the smaller tree: its expected tau is never lower
    assert prefixes_of(tokens, tree) <= prefixes_of(*grow_tree(log_q, 1, 3, nodes + 7, 'cpu'))
    # a drafter with two tokens of probability at each position: 2 + 4 + 8 nodes at most
    two = torch.full((1, 1, V), -math.inf, dtype=torch.float64)
    two[..., :2] = math.log(0.5)
    tokens, tree = grow_tree(lambda j, prefix: two.expand(1, prefix.size(1), V), 1, 3, 20, 'cpu')
    valid = tree[0, 0, 1:] >= 0
    padding = set((1 + torch.nonzero(~valid)).flatten().tolist())
    assert int(valid.sum()) == 14 and not set(tree[0, 0].tolist()) & padding


def test_tree_attend_sees_exactly_the_ancestors():
    tree = torch.tensor([[[0, 0, 0, 1, 1, 3, -1], [0, 1, 1, 2, 2, 3, 1]]])      # slot 6: padding
    depth, attend = tree_attend(tree, 3)
    want = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 1, 3, 5}, 6: {6}}
    assert {i: set(torch.nonzero(attend[0, i]).flatten().tolist()) for i in range(7)} == want
    assert torch.equal(depth, tree[:, 1])


def test_a_tree_slot_sees_its_own_path():
    """Through forward_cached with a token tree, the state at each node is the target's state
    after [prefix, bonus, the node's path] (float64), each row its own tree."""
    model = tiny_model(std=0.3)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(64, (2, 5), generator=g)
    block = torch.randint(64, (2, 6), generator=g)
    tree = torch.tensor([[[0, 0, 0, 1, 3, 2], [0, 1, 1, 2, 3, 2]], [[0, 0, 1, 1, 0, 4], [0, 1, 2, 2, 1, 2]]])
    cache = model.new_cache(2, 24)
    model.forward_cached(prefix, cache)
    cache.commit(5)
    h = model.forward_cached(block, cache, tree_attend(tree, 3))
    for b in range(2):
        for s in range(6):
            path, t = [], s
            while t:
                path.insert(0, int(block[b, t]))
                t = int(tree[b, 0, t])
            seq = torch.cat([prefix[b], block[b, :1], torch.tensor(path, dtype=torch.long)])
            assert torch.allclose(h[b, s], model.hidden(seq[None])[0, -1], atol=1e-10), (b, s)


def test_greedy_walk_follows_the_targets_argmax():
    """walk_down: from the bonus, the child holding the target's choice, until none does; the path's
    slots depth by depth."""
    block = torch.tensor([[9, 4, 5, 6, 7, 8]])
    tree = torch.tensor([[[0, 0, 0, 1, 1, 4], [0, 1, 1, 2, 2, 3]]])     # 4 -> {6, 7}, 7 -> 8; 5 a leaf
    choice = torch.tensor([[4, 7, 1, 2, 8, 3]])          # the bonus chose 4, slot 1 chose 7, slot 4 chose 8
    _, attend = tree_attend(tree, 3)
    n_acc, last, slots = walk_down(choice, block, tree, attend, 3)
    assert n_acc.tolist() == [3] and last.tolist() == [5] and slots.tolist() == [[1, 4, 5]]
    choice[0, 1] = 5                                                     # 5 is no child of slot 1: stop there
    n_acc, last, slots = walk_down(choice, block, tree, attend, 3)
    assert n_acc.tolist() == [1] and last.tolist() == [1] and slots[0, 0].item() == 1


def tree_drafter(kind, cfg, dtype=torch.float64):
    if kind == 'heads':
        return peaky(BlockHeads(cfg, 4), 0.2, 1).to(dtype).eval()
    return peaky(DBlastDrafter(cfg, 4, 4), 0.2, 1).to(dtype).eval()


@pytest.mark.parametrize('kind', ['heads', 'dblast', 'second best'])
@pytest.mark.parametrize('nodes', [1, 6, 30])
def test_greedy_trees_decode_exactly_greedy(kind, nodes):
    """Every token of greedy decoding through trees of any size is plain greedy decoding's (float64,
    3 rows accepting their own numbers), the walk going down to the leaves where the tree holds the
    greedy path (SecondBest, below: its second child at every node)."""
    model = tiny_model(std=0.3)
    prompt = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(2))
    ref = naive_greedy(model, prompt, 40)
    drafter = SecondBest(model, ref, 4) if kind == 'second best' else tree_drafter(kind, model.config)
    out, stats = generate(model, prompt, 40, drafter=drafter, k=4, nodes=nodes)
    assert torch.equal(out, ref)
    assert all(1 <= t <= 4 for t in stats['accept_lengths'])
    if kind == 'second best' and nodes == 30:   # 2 + 4 + 8 nodes hold every greedy block whole
        assert set(stats['accept_lengths']) == {4}


class SecondBest(Drafter):
    """A drafter whose distribution at every depth puts the target's greedy token second (0.3) and a
    wrong one first (0.6): its one path, the argmax, is refused at once; a tree of two children a
    node holds the greedy path. It finds where h came from as exercises' GreedyOracle does (the
    reference's hidden state nearest to it), so it uses nothing but the drafter contract."""

    def __init__(self, model, ref, k):
        super().__init__()
        self.k, self.sample_drafts, self.V = k, False, model.config.vocab_size
        self.ref = torch.cat([ref, torch.zeros(ref.size(0), k + 1, dtype=torch.long)], 1)
        with torch.no_grad():
            self.H = model.hidden(ref)                                      # (B, T, C)

    def log_q(self, h):
        """(B, k-1, V): the drafter's log-probabilities at the drafted positions after h."""
        t = ((self.H - h[:, None]) ** 2).sum(-1).argmin(-1)                 # (B,) where h came from
        right = self.ref.gather(1, t[:, None] + 2 + torch.arange(self.k - 1))   # (B, k-1)
        q = torch.full((h.size(0), self.k - 1, self.V), math.log(0.1 / (self.V - 2)), dtype=torch.float64)
        q.scatter_(2, right[..., None], math.log(0.3))
        return q.scatter_(2, (right[..., None] + 1) % self.V, math.log(0.6))

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        return self.log_q(h)[:, :k - 1].argmax(-1), None

    def next_log_q(self, h, bonus, target, k, temperature=0.0):
        q = self.log_q(h)
        return lambda d, prefix: q[:, d, None].expand(-1, prefix.size(1), -1)


def test_a_tree_commits_what_one_path_misses():
    """With the target's greedy token second at every depth, the one path is refused at every step
    (tau 1, m calls) and a tree of two children a node (2 + 4 + 8 nodes) commits every block whole:
    calls = ceil((m - 1) / k) + 1, every token plain greedy's."""
    model = tiny_model(std=0.3)
    prompt = torch.randint(64, (2, 5), generator=torch.Generator().manual_seed(4))
    ref = naive_greedy(model, prompt, 40)
    drafter = SecondBest(model, ref, 4)
    out, stats = generate(model, prompt, 40, drafter=drafter, k=4)
    assert torch.equal(out, ref) and stats['calls'] == 40
    out, stats = generate(model, prompt, 40, drafter=drafter, k=4, nodes=14)
    assert torch.equal(out, ref) and stats['calls'] == math.ceil(39 / 4) + 1 and set(stats['accept_lengths']) == {4}


@pytest.mark.parametrize('kind', ['heads', 'dblast'])
def test_a_tree_is_grown_from_the_drafters_conditionals(kind):
    """BPD heads score a node's children alike whatever its prefix (independent positions); the
    mixture's conditionals follow the prefix: two sibling subtrees get different distributions."""
    model = peaky(GPT(V8), 0.3, 0).double()
    drafter = peaky(BlockHeads(V8, 4), 0.3, 1).double() if kind == 'heads' else \
        peaky(DBlastDrafter(V8, 4, 4), 0.6, 1).double()
    log_q = drafter.next_log_q(torch.randn(1, V8.n_embd, dtype=torch.float64), torch.tensor([2]), model, 4, 1.0)
    siblings = log_q(1, torch.tensor([[[0], [5]]]))                      # two depth-1 nodes' children
    assert torch.allclose(siblings.exp().sum(-1), torch.ones(1, 2, dtype=torch.float64))
    assert torch.allclose(siblings[0, 0], siblings[0, 1]) == (kind == 'heads')



def test_a_mixture_scores_a_tree_with_its_branches_softmax_greedy_branches_too():
    """MATH.md §10: a DBlast tree's scores are the mixture's conditionals with each branch's softmax
    q at the temperature, whatever sample_drafts says (greedy branches draft one path by argmax, but
    a tree is chosen from the distributions); and at T = 0 they are those at 1."""
    model = peaky(GPT(V8), 0.3, 0).double()
    drafter = peaky(DBlastDrafter(V8, 4, 4), 0.6, 1).double()
    h, bonus, prefix = torch.randn(1, V8.n_embd, dtype=torch.float64), torch.tensor([2]), torch.tensor([[[0], [5]]])
    scores = {}
    for sampled in (True, False):
        drafter.sample_drafts = sampled
        for T in (0.0, 0.7, 1.0):
            scores[sampled, T] = drafter.next_log_q(h, bonus, model, 4, T)(1, prefix)
    assert all(torch.equal(scores[True, T], scores[False, T]) for T in (0.0, 0.7, 1.0))
    assert torch.equal(scores[True, 0.0], scores[True, 1.0])
    assert not torch.allclose(scores[True, 0.7], scores[True, 1.0])


# ----------------------------------------------------------------------------- the sampled walk

def exact_walk_tau(model, prompt, block, tree, temperature):
    """E[tau] of the sampled walk on one fixed tree, by enumeration: 1 + the sum over every node of
    the target's probability of its whole path (the walk reaches a node iff the target's samples
    along the way are its tokens: it attains p(D) at every node)."""
    parent, tokens = tree[0, 0].tolist(), block[0].tolist()
    total = 1.0
    for s in range(1, len(tokens)):
        if parent[s] < 0:
            continue
        path, t = [], s
        while t:
            path.insert(0, tokens[t])
            t = parent[t]
        seq = torch.cat([prompt[0], torch.tensor([tokens[0]] + path)])
        logp = torch.log_softmax(model(seq[None])[0][0] / temperature, -1)
        n = prompt.size(1)
        total += math.exp(sum(float(logp[n - 1 + j, seq[n + j]]) for j in range(1, len(path) + 1)))   # after the bonus
    return total


def test_the_sampled_walk_attains_p_of_the_children_at_every_node():
    """One tree, 20,000 rows walked with the target's own samples: the mean tau is the enumerated
    sum of the target's probability of every node's path (within 4 standard errors), the most any
    lossless rule can accept from a fixed set of children (MATH.md §10)."""
    model = peaky(GPT(V8), 0.3, 0).float()
    drafter = make_drafter('K4-sampled-mixture-zt1')
    n_rows, T = 20000, 1.3
    cache = model.new_cache(n_rows, 32)
    prompt = V8_PROMPT.expand(n_rows, -1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        block, _, tree = decode.first_block(model, drafter, cache, prompt, T, g, 1, 4, nodes=10)
        block[:] = block[:1]          # one tree for every row: the first row's
        tree[:] = tree[:1]
        text = Text(torch.zeros(n_rows, 16, dtype=torch.long), torch.full((n_rows,), V8_PROMPT.size(1)))
        n_acc, *_ = decode.tree_step(model, drafter, cache, text, block, tree, torch.ones(n_rows, dtype=torch.bool), T,
                                     g, 4, 10)
        want = exact_walk_tau(peaky(GPT(V8), 0.3, 0).double(), V8_PROMPT, block[:1], tree[:1], T)
    taus = (n_acc + 1).double()
    assert abs(float(taus.mean()) - want) < 4 * float(taus.std()) / math.sqrt(n_rows), (float(taus.mean()), want)
    assert want > 1.3   # the tree is walked into, not a single node


def tree_counts(model, drafter, temperature, k, nodes, n_rows=20000, seed=0, m=3, compile=False, branching=None):
    g = torch.Generator().manual_seed(seed)
    out, stats = generate(model, V8_PROMPT.expand(n_rows, -1), m, drafter=drafter, k=k, temperature=temperature,
                          generator=g, nodes=nodes, compile=compile, branching=branching)
    codes = (out[:, V8_PROMPT.size(1):] * torch.tensor([V ** (m - 1 - i) for i in range(m)])).sum(-1)
    return torch.bincount(codes, minlength=V ** m).double(), stats


# every kind of drafter the tree can come from, k = 4 (three tokens: a walk of up to three drafts)
# and k = 2 (three tokens over two steps: a fully accepted block's bonus and a leaf's bonus counted)
WALKS = [('heads-sampled', 1.5, 4, 12), ('K4-sampled-mixture-zt1', 1.5, 4, 24), ('K1-sampled-mixture-zt1', 0.7, 4, 6),
         ('K4-greedy-mixture-zt0.5', 1.0, 4, 10), ('heads-argmax', 1.0, 2, 3), ('K4-sampled-mixture-zt1', 1.5, 2, 5)]
QUICK = {('heads-sampled', 1.5, 4, 12), ('K4-sampled-mixture-zt1', 1.5, 2, 5)}


@pytest.mark.parametrize('spec,temperature,k,nodes', [w if w in QUICK else pytest.param(*w, marks=pytest.mark.slow)
                                                      for w in WALKS])
def test_the_sampled_walk_is_lossless(target8, spec, temperature, k, nodes):
    counts, stats = tree_counts(target8, make_drafter(spec), temperature, k, nodes)
    stat, crit = chi_square(counts, continuation_probs(temperature), 20000)
    assert stat < crit, f"{spec} k={k} nodes={nodes} T={temperature}: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < k).any()
    if k == 2:    # three tokens over two steps: some rows accepted a whole block (its bonus counted)
        assert (taus == 2).any()


@pytest.mark.slow
def test_the_sampled_walk_is_lossless_in_units_of_steps(target8, monkeypatch):
    monkeypatch.setattr(runner, 'compiled', lambda fn, *how, **options: fn)
    counts, _ = tree_counts(target8, make_drafter('K4-sampled-mixture-zt1'), 1.5, 4, 16, compile=True)
    stat, crit = chi_square(counts, continuation_probs(1.5), 20000)
    assert stat < crit, f"tree walk in units: chi2 {stat:.1f} >= {crit:.1f}"


def test_chi_square_catches_a_walk_whose_draws_share_one_number(target8, monkeypatch):
    """A walk drawing every node's token with one uniform number per row (torch.rand(B, 1) where
    each node needs its own): each token is p's at its own node, yet a child's draw is tied to its
    parent's, and the output is biased. The test catches it, at a quarter of the rows."""
    def one_number(logits, temperature, generator=None):
        if temperature == 0.0 or logits.dim() < 3:
            return real(logits, temperature, generator)
        cdf = torch.softmax(logits / temperature, -1).cumsum(-1)
        u = torch.rand(logits.size(0), 1, 1, generator=generator)
        return torch.searchsorted(cdf, u.expand(-1, logits.size(1), 1) * cdf[..., -1:], right=True).squeeze(-1).clamp(
            max=logits.size(-1) - 1)
    real = verification.target_choice
    monkeypatch.setattr(decode, 'target_choice', one_number)
    counts, _ = tree_counts(target8, make_drafter('K4-sampled-mixture-zt1'), 1.5, 4, 24, n_rows=5000)
    stat, crit = chi_square(counts, continuation_probs(1.5), 5000)
    assert stat > crit, f"shared draws passed: chi2 {stat:.1f} < {crit:.1f}"


# ----------------------------------------------------------------------------- sampled trees

def test_a_sampled_tree_draws_each_nodes_children_without_replacement():
    """sample_tree: slots depth by depth, a node's children next to each other, the spine widest; the ordered pair of
    a node's two children has the law of two draws without replacement, q(a) q(b) / (1 - q(a))
    (chi-square over the 12 ordered pairs); a child q cannot give is padding, and so is all below it;
    Q at each slot is the q its children were drawn from."""
    q = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20000
    log_q = lambda d, prefix: q.log().expand(prefix.size(0), prefix.size(1), -1)   # noqa: E731
    tokens, tree, Q = sample_tree(log_q, n, (2, 1), 'cpu', torch.Generator().manual_seed(0))
    assert tree[0].tolist() == [[0, 0, 0, 1, 2], [0, 1, 1, 2, 2]]
    assert torch.allclose(Q[:, :3], q.expand(n, 3, -1)) and (Q[:, 3:] == 0).all()
    assert (tokens[:, 0] != tokens[:, 1]).all()
    pairs = torch.bincount(tokens[:, 0] * 4 + tokens[:, 1], minlength=16).double()
    law = torch.tensor([float(q[a] * q[b] / (1 - q[a])) if a != b else 0.0 for a in range(4) for b in range(4)])
    stat, crit = chi_square(pairs, law, n)
    assert stat < crit, (stat, crit)
    # the spine, the first-drawn children, gets the widths, every other node one child (MATH.md's (4, 4, 4): 21)
    tokens, tree, _ = sample_tree(log_q, 1, (3, 2, 2), 'cpu')
    assert tree[0, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 7] and tokens.size(1) == tree_size((3, 2, 2)) == 12
    assert tree[0, 1].tolist() == [0] + [1] * 3 + [2] * 4 + [3] * 5 and tree_size((4, 4, 4)) == 21
    # a q of one token: the second child is padding, and so is the child below it
    one = torch.tensor([0.0, 1.0, 0.0, 0.0]).log()
    tokens, tree, _ = sample_tree(lambda d, prefix: one.expand(1, prefix.size(1), -1), 1, (2, 1), 'cpu')
    assert tokens[0, 0] == 1 and tree[0, 0].tolist() == [0, 0, -1, 1, -1]


@pytest.mark.parametrize('spec,temperature,k,branching', [
    ('K4-sampled-mixture-zt1', 1.5, 2, (4,)), pytest.param('heads-sampled', 1.0, 4, (2, 2, 2), marks=pytest.mark.slow)])
def test_a_sampled_tree_is_lossless(target8, spec, temperature, k, branching):
    """Recursive rejection sampling over children drawn without replacement (MATH.md §10): every
    3-token continuation as the target's own sampling, with k = 2 counting a leaf's bonus and a fully
    accepted block's (a DBlast tree at k = 4 below, in units of steps)."""
    counts, stats = tree_counts(target8, make_drafter(spec), temperature, k, None, branching=branching)
    stat, crit = chi_square(counts, continuation_probs(temperature), 20000)
    assert stat < crit, f"{spec} k={k} branching={branching} T={temperature}: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < k).any()
    if k == 2:
        assert (taus == 2).any()


@pytest.mark.slow
def test_a_sampled_tree_is_lossless_in_units_of_steps(target8, monkeypatch):
    monkeypatch.setattr(runner, 'compiled', lambda fn, *how, **options: fn)
    counts, stats = tree_counts(target8, make_drafter('K4-sampled-mixture-zt1'), 1.5, 4, None, compile=True,
                                branching=(3, 2, 1), n_rows=10000)
    stat, crit = chi_square(counts, continuation_probs(1.5), 10000)
    assert (torch.tensor(stats['accept_lengths']) == 3).any()   # walks three deep: the bonus and two children
    assert stat < crit, f"sampled tree in units: chi2 {stat:.1f} >= {crit:.1f}"


def node_law(p, Q, w, n=20000):
    """How often each token is emitted at one node of p's (V,) with w children drawn from Q (V,)
    (sample_tree, sampled_tree_choice), and how often a child is accepted."""
    g = torch.Generator().manual_seed(0)
    tokens, tree, Q_slots = sample_tree(lambda d, prefix: Q.log().expand(n, prefix.size(1), -1), n, (w,), 'cpu', g)
    block = torch.cat([torch.zeros(n, 1, dtype=torch.long), tokens], 1)
    choice = verification.sampled_tree_choice(p.log().expand(n, 1 + w, -1), Q_slots, block, tree, 1.0, w, g)[:, 0]
    return torch.bincount(choice, minlength=len(p)).double(), (choice[:, None] == tokens).any(1).double().mean()


NODES = [([0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], 2), ([0.1, 0.3, 0.3, 0.3], [0.7, 0.1, 0.1, 0.1], 3),
         ([0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0], 3), ([0.2, 0.2, 0.2, 0.4], [0.25, 0.25, 0.25, 0.25], 4),
         ([0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], 2)]


@pytest.mark.parametrize('p,Q,w', NODES)
def test_one_node_of_a_sampled_tree_emits_p(p, Q, w):
    """At a node, recursive rejection sampling over w children drawn without replacement from Q emits
    a token of p (chi-square), Q with fewer tokens than w (padding) and p with zeros included; with
    w = V children of a Q that gives every token some probability, or with Q = p, a child is always
    accepted (with Q = p, the first: MATH.md §10)."""
    p, Q = torch.tensor(p), torch.tensor(Q)
    counts, accepted = node_law(p, Q, w)
    stat, crit = chi_square(counts, p, 20000)
    assert stat < crit, (stat, crit)
    if w == len(p) or torch.equal(p, Q):
        assert accepted == 1
    if torch.equal(p, Q):
        assert node_law(p, Q, 1)[1] == 1


@pytest.mark.parametrize('broken', ['each child against the whole q', 'residual kept'])
def test_chi_square_catches_a_sampled_tree_verified_wrongly(monkeypatch, broken):
    """Negative controls: a later child tested against the node's whole q, not q without the earlier
    children (what it was drawn from); the residual not updated after a rejection."""
    if broken == 'residual kept':
        monkeypatch.setattr(verification, 'residual', lambda r, q, x: r)
    else:
        monkeypatch.setattr(torch.Tensor, 'scatter', lambda q, *removed: q)   # the earlier children left in q
    p, Q, w = (torch.tensor(t) if isinstance(t, list) else t for t in NODES[0])
    counts, _ = node_law(p, Q, w)
    stat, crit = chi_square(counts, p, 20000)
    assert stat > crit, f"{broken} passed: chi2 {stat:.1f} < {crit:.1f}"


def test_where_p_is_spread_a_sampled_candidate_beats_fixed_children():
    """MATH.md §10's example: p = Q uniform over 100 tokens. One candidate drawn from Q is accepted
    with probability sum_v min(p(v), Q(v)) = 1 (verification.accept_sampled), while the walk from a node
    with 8 fixed children moves with probability p(D) = 0.08 (within 4 standard errors)."""
    g, n = torch.Generator().manual_seed(0), 20000
    p = torch.full((n, 1, 100), 0.01)
    assert verification.accept_sampled(p, p, sample(p, g), g).all()
    block = torch.arange(9).expand(n, -1)                                  # the bonus, then children 1..8
    tree = torch.stack([torch.zeros(n, 9, dtype=torch.long), (torch.arange(9) > 0).long().expand(n, -1)], 1)
    choice = sample(torch.full((n, 9, 100), 0.01), g)
    n_acc, _, _ = walk_down(choice, block, tree, tree_attend(tree, 1)[1], 1)
    moved = n_acc.double().mean()
    assert abs(float(moved) - 0.08) < 4 * math.sqrt(0.08 * 0.92 / n)


# ----------------------------------------------------------------------------- refused

@pytest.mark.parametrize('kw,needle', [
    (dict(nodes=0), "nodes=0: drafted tokens of a tree per call, a whole number from 1 to 1024"),
    (dict(nodes=1025), "nodes=1025"), (dict(nodes=2.5), "nodes=2.5"),
    (dict(nodes=8, paths=2), "nodes=8 and paths=2: a call verifies one tree or several paths, not both"),
    (dict(nodes=8, accept='topk:2'), "accept='topk:2' with nodes=8: a tree is walked"),
    (dict(nodes=8, accept='minblock:2'), "accept='minblock:2' with nodes=8"),
    (dict(nodes=8, drafter=None, k=None), "nodes=8: a tree needs a drafter (drafter=...)"),
    (dict(branching=(2, 2)), "branching=(2, 2) at k=4: want one width a drafted position, k-1 = 3 of them"),
    (dict(branching=(2, 0, 1)), "branching=(2, 0, 1): want the children of the tree's spine at each drafted position"),
    (dict(branching='4,2,1'), "branching='4,2,1': want the children"), (dict(branching=()), "branching=()"),
    (dict(branching=(2, 2, 2), temperature=0.0), "branching=(2, 2, 2): a sampled tree is for sampling"),
    (dict(branching=(2, 2, 2), nodes=8), "a call verifies a sampled tree (branching), a best-first one (nodes)"),
    (dict(branching=(2, 2, 2), paths=2), "a call verifies a sampled tree (branching), a best-first one (nodes)"),
    (dict(branching=(1024, 1, 1)), "branching=(1024, 1, 1): a tree of 3072 drafted tokens; at most 1024"),
    (dict(branching=(65, 1, 1)), "branching=(65, 1, 1): a node has at most as many children as the vocabulary has tokens, 64"),
    (dict(branching=(2, 2, 2), drafter=None, k=None), "branching=(2, 2, 2): a tree needs a drafter")])
def test_what_a_tree_cannot_take_is_one_line(kw, needle):
    model = tiny_model(std=0.3)
    args = {**dict(drafter=BlockHeads(model.config, 4).double(), k=4), **kw}
    if 'branching' in kw:
        args.setdefault('temperature', 1.0)
    with pytest.raises(BadInput) as e:
        generate(model, torch.zeros(1, 4, dtype=torch.long), 8, **args)
    assert needle in str(e.value) and '\n' not in str(e.value)


def test_a_drafter_that_grows_no_trees_is_refused():
    class Plain(Drafter):
        k = 4

        def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
            return bonus[:, None].expand(-1, k - 1), None
    model = tiny_model(std=0.3)
    with pytest.raises(BadInput, match=r"^nodes=4: this drafter grows no token trees"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 8, drafter=Plain(), nodes=4)
    with pytest.raises(BadInput, match=r"^branching=\(2, 1, 1\): this drafter grows no token trees"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 8, drafter=Plain(), branching=(2, 1, 1), temperature=1.0)


# ----------------------------------------------------------------------------- MATH.md's equations, written out

def test_tree_scores_are_the_drafters_log_probability_of_the_whole_prefix():
    """§10: a node's score sum_{i<=j} log q_i(d_i | d_<i) is, for the DBlast mixture, the log of the
    mixture's own probability of the prefix, log sum_z pi'_z prod_i q_i(d_i | z) (softmax q at T, the
    prior at Z_T: here 0.6, where pi' != pi); for BPD heads each head's own log softmax(logits_i / T)."""
    target = peaky(GPT(V8), 0.3, 0)
    h, b, T = torch.randn(1, V8.n_embd, generator=torch.Generator().manual_seed(0), dtype=torch.float64), \
        torch.tensor([2]), 0.8
    d = peaky(DBlastDrafter(V8, 4, 3, zt=0.6), 0.5, 1)
    log_q = d.next_log_q(h, b, target, 4, T)
    with torch.no_grad():
        log_pi, logits = d.mixture_logits(h, b, target, 4)
    pi_p, q = F.softmax(log_pi / 0.6, -1)[0], F.softmax(logits[0] / T, -1)      # (K,), (K, 3, V)
    prefixes = torch.tensor(list(itertools.product(range(8), repeat=3)))       # (512, 3)
    score = sum(log_q(j, prefixes[None, :, :j])[0].gather(-1, prefixes[:, j:j + 1]).squeeze(-1) for j in range(3))
    want = (pi_p[:, None] * q[:, 0, prefixes[:, 0]] * q[:, 1, prefixes[:, 1]] * q[:, 2, prefixes[:, 2]]).sum(0)
    torch.testing.assert_close(score.exp(), want, rtol=1e-10, atol=1e-14)
    heads = peaky(BlockHeads(V8, 4), 0.3, 1)
    lq = heads.next_log_q(h, b, target, 4, T)
    with torch.no_grad():
        own = F.log_softmax(heads(h, target.lm_head, 3) / T, -1)             # (1, 3, V)
    for j in range(3):
        torch.testing.assert_close(lq(j, prefixes[None, :5, :j])[0], own[0, j].expand(5, -1), rtol=0, atol=1e-12)


def test_no_walk_follows_padding():
    """§10: a node the drafter gives no probability is padding (parent -1), and no walk follows it,
    even where its token is the target's choice at the bonus (greedy or sampled)."""
    block = torch.tensor([[9, 4, 5, 7, 6]])
    tree = torch.tensor([[[0, 0, 0, 1, -1], [0, 1, 1, 2, 2]]])         # slot 4: padding (depth 2 as grown)
    _, attend = verification.tree_attend(tree, 2)
    choice = torch.tensor([[6, 7, 1, 2, 3]])                            # the bonus chose 6: no child holds it
    n_acc, last, _ = verification.walk_down(choice, block, tree, attend, 2)
    assert n_acc.tolist() == [0] and last.tolist() == [0]
    choice[0, 0] = 4                                                    # 4 is a child: the walk goes 4 -> 7
    n_acc, last, slots = verification.walk_down(choice, block, tree, attend, 2)
    assert n_acc.tolist() == [2] and last.tolist() == [3] and slots.tolist() == [[1, 3]]
