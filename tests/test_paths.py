"""Several drafted paths per call (MATH.md §9): the tree block through the target, greedy keeping
the longest agreeing path, and multi-step speculative sampling, lossless for every way of
proposing (chi-square over every 3-token continuation of the 8-token world, at k = 4 and at k = 2,
where the bonus at the leaf of a fully accepted path is among the counted tokens), each beside a
wrong verifier or drafter that the same test catches."""
import ast
import copy
import os

import pytest
import torch

import dblast
import decode
import runner
import verification
from conftest import ROOT, V8, V8_PROMPT, naive_greedy, peaky, tiny_model
from dblast import DBlastDrafter
from decode import generate
from exercises.harness import GreedyOracle
from heads import Drafter
from model import GPT, KVCache, sample
from test_sampling import chi_square, continuation_probs, make_drafter
from verification import tree_layout, tree_nodes, tree_walk, verify_tree_greedy

V = V8.vocab_size


@pytest.fixture(scope='module')
def target8():
    return peaky(GPT(V8), 0.3, 0).float()


class OraclePaths(Drafter):
    """N greedy paths, each the target's greedy continuation made wrong at its own place (path i at
    draft j where (7t + 3i) % (k + 1) == j, t the position of the bonus; past k-2 it is never
    wrong): which path is longest changes from step to step."""

    def __init__(self, model, ref, k):
        super().__init__()
        self.k, self.model, self.ref = k, model, ref

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        return self.draft_paths(h, bonus, target, k, 1, temperature, generator)[0][:, 0], None

    def draft_paths(self, h, bonus, target, k, paths, temperature=0.0, generator=None):
        drafts = [GreedyOracle(self.model, self.ref, k, lambda t, j, i=i: (7 * t + 3 * i) % (k + 1) == j)
                  .draft(h, bonus, target, k)[0] for i in range(paths)]
        return torch.stack(drafts, 1), None


def test_tree_block_sees_each_path_as_its_own_sequence():
    """Through forward_cached with the tree mask, the state at path i's token j is the target's
    state after [prefix, bonus, path i's tokens 0..j], paths sharing a prefix included (float64)."""
    model = tiny_model(std=0.3)
    B, N, n = 2, 3, 3
    g = torch.Generator().manual_seed(0)
    prefix, bonus = torch.randint(64, (B, 6), generator=g), torch.randint(64, (B,), generator=g)
    paths = torch.randint(64, (B, N, n), generator=g)
    paths[:, 2, :2] = paths[:, 0, :2]                                  # paths 0 and 2 share two tokens
    cache = model.new_cache(B, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    h = model.forward_cached(torch.cat([bonus[:, None], paths.flatten(1)], 1), cache, tree_layout(N, n, 'cpu'))
    for i in range(N):
        want = model.hidden(torch.cat([prefix, bonus[:, None], paths[:, i]], 1))[:, 6:]     # (B, 1 + n, C)
        got = torch.cat([h[:, :1], h[:, 1 + i * n:1 + (i + 1) * n]], 1)
        assert (got - want).abs().max() < 1e-10, i


def test_greedy_keeps_the_first_longest_path():
    """verify_tree_greedy: each path judged by the rule alone, the longest kept (the first of equals),
    the bonus the target's argmax after it; a lossy rule applies per path too."""
    B, N, n, Vs = 1, 3, 3, 5
    # the target's argmax after every slot: after the bonus 1; after path i's token j, given below
    argmax = torch.tensor([[1, 2, 3, 0, 2, 4, 0, 1, 0, 0, 1]])             # (B, 1 + N n)
    logits = torch.nn.functional.one_hot(argmax, Vs).double()
    paths = torch.tensor([[[1, 2, 4], [1, 2, 3], [1, 3, 0]]])              # 2, 2 and 1 agree
    n_acc, bonus, path = verify_tree_greedy(logits, paths)
    assert n_acc.tolist() == [2] and path.tolist() == [0] and bonus.tolist() == [3]
    n_acc, _, path = verify_tree_greedy(logits, paths, (verification.min_block, 4))   # everything taken
    assert n_acc.tolist() == [3] and path.tolist() == [0]


@pytest.mark.parametrize('N', [2, 4])
def test_greedy_paths_decode_exactly_greedy_and_commit_the_longest(N, monkeypatch):
    """Greedy with N paths, 3 rows of ragged acceptance: the output is plain greedy decoding's, and
    each step commits the longest path's prefix, so tau grows with N. Breaking keep_path (the
    kept path's keys and values left where they were) breaks the output."""
    model = tiny_model(std=0.3)
    prompts = torch.randint(64, (3, 8), generator=torch.Generator().manual_seed(1))
    ref = naive_greedy(model, prompts, 40)
    taus = {}
    for paths in (1, N):
        out, stats = generate(model, prompts, 30, drafter=OraclePaths(model, ref, 4), k=4, paths=paths)
        assert torch.equal(out, ref[:, :38]), paths
        taus[paths] = sum(stats['accept_lengths']) / len(stats['accept_lengths'])
    assert taus[N] > taus[1] + 0.3, taus
    monkeypatch.setattr(KVCache, 'keep_path', lambda self, slots: None)
    out, _ = generate(model, prompts, 30, drafter=OraclePaths(model, ref, 4), k=4, paths=N)
    assert not torch.equal(out, ref[:, :38])


# Rows per chi-square test, by a power calculation on the controls below (each a bug the test
# must catch). A control's statistic is noncentral chi-square, with mean df + lambda and variance
# 2(df + 2 lambda), lambda growing in proportion to the rows. At 5000 rows the weakest control (r
# not updated) measures 886 against a critical value of 503: lambda about 450 over about 430
# degrees of freedom, so the critical value lies 7 standard deviations below its mean. (At 3000:
# 513 against 331, under 5; the other two controls measure 883 against 332 and 1228 against 417.)
N_ROWS = 5000


def counts_of(model, drafter, temperature, paths, n_rows=N_ROWS, seed=0, m=3, compile=False, k=4):
    g = torch.Generator().manual_seed(seed)
    out, stats = generate(model, V8_PROMPT.expand(n_rows, -1), m, drafter=drafter, k=k, temperature=temperature,
                          generator=g, paths=paths, compile=compile)
    codes = (out[:, V8_PROMPT.size(1):] * torch.tensor([V ** (m - 1 - i) for i in range(m)])).sum(-1)
    return torch.bincount(codes, minlength=V ** m).double(), stats


def chi2_paths(model, drafter, temperature, paths, compile=False, k=4):
    counts, stats = counts_of(model, drafter, temperature, paths, compile=compile, k=k)
    return chi_square(counts, continuation_probs(temperature), N_ROWS) + (stats,)


# (drafter spec of test_sampling, T, paths, DBlast's paths_from): i.i.d. paths of sampled heads,
# of point-mass heads (every path the same: duplicates at every node) and of the K = 1 drafter;
# i.i.d. paths of the K = 4 mixture verified against its conditionals or against each path's
# branch, sampled or greedy branches; one path per branch, each verified against its own branch
# (sampled, greedy, past K, Z_T = 0)
WAYS = [('heads-sampled', 1.5, 4, 'iid'), ('heads-argmax', 0.7, 3, 'iid'),
        ('K1-sampled-mixture-zt1', 0.7, 8, 'iid'), ('K4-sampled-mixture-zt1', 1.5, 4, 'iid'),
        ('K4-sampled-branch-zt1', 1.0, 2, 'iid'), ('K4-greedy-mixture-zt1', 1.0, 4, 'iid'),
        ('K4-sampled-branch-zt1', 0.7, 4, 'branches'), ('K4-greedy-branch-zt0.5', 1.5, 8, 'branches'),
        ('K4-sampled-branch-zt0', 1.0, 3, 'branches')]


# the quick tier keeps i.i.d. paths of sampled heads and one path per branch
QUICK = {('heads-sampled', 1.5, 4, 'iid'), ('K4-sampled-branch-zt1', 0.7, 4, 'branches')}


@pytest.mark.parametrize('spec,temperature,paths,paths_from',
                         [w if w in QUICK else pytest.param(*w, marks=pytest.mark.slow) for w in WAYS])
def test_several_paths_are_lossless(target8, spec, temperature, paths, paths_from):
    d = make_drafter(spec)
    d.paths_from = paths_from
    if spec == 'heads-argmax':   # all paths alike: generate() refuses it as meaningless; the verifier must hold
        d.meaningless = lambda temperature, paths: []
    stat, crit, stats = chi2_paths(target8, d, temperature, paths)
    assert stat < crit, f"{spec} x{paths} {paths_from} T={temperature}: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 4).any()


# k = 2: paths of one draft, three tokens over up to two steps, so the bonus drawn at the leaf a
# fully accepted path reaches (a sample of p there, nothing tried) is among the counted tokens
K2 = [('K4-sampled-branch-zt1', 0.7, 4, 'branches'), ('heads-sampled', 1.5, 4, 'iid'),
      ('K4-sampled-mixture-zt1', 0.7, 4, 'iid'), ('K4-greedy-branch-zt0.5', 0.7, 4, 'branches')]


@pytest.mark.parametrize('spec,temperature,paths,paths_from',
                         [w if w == K2[0] else pytest.param(*w, marks=pytest.mark.slow) for w in K2])
def test_several_paths_are_lossless_at_k2(target8, spec, temperature, paths, paths_from):
    d = make_drafter(spec)
    d.paths_from = paths_from
    stat, crit, stats = chi2_paths(target8, d, temperature, paths, k=2)
    assert stat < crit, f"{spec} x{paths} {paths_from} T={temperature} k=2: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus == 2).any() and (taus == 1).any()      # paths accepted to their leaf (its bonus counted), and not


def test_chi_square_at_k2_catches_a_leafs_bonus_drawn_at_its_parent(target8, monkeypatch):
    """The walk told to stop one node short when it reaches a leaf, so that the bonus is drawn from
    what is left of p at the leaf's parent instead of p at the leaf: at k = 4 the three counted
    tokens never include a leaf's bonus (the same seed gives the same tokens with and without the
    bug), at k = 2 the test catches it. It measures 601 to 776 over six seeds against a critical
    value of 332 (the lossless run: 250)."""
    real = verification.tree_walk

    def parent_of_leaf(kept_token, node, drafts):
        match, n_acc, path, last = real(kept_token, node, drafts)
        up = node[torch.arange(drafts.size(0)), path, (n_acc - 1).clamp(min=0)]
        return match, n_acc, path, torch.where(n_acc == drafts.size(-1), up, last)
    d = make_drafter('K4-sampled-branch-zt1')
    d.paths_from = 'branches'
    runs = []
    for walk in (real, parent_of_leaf):
        monkeypatch.setattr(verification, 'tree_walk', walk)
        runs.append(generate(target8, V8_PROMPT.expand(500, -1), 3, drafter=d, k=4, temperature=0.7, paths=4,
                             generator=torch.Generator().manual_seed(1))[0])
    assert torch.equal(*runs)
    stat, crit, _ = chi2_paths(target8, d, 0.7, 4, k=2)
    assert stat > crit, f"a leaf's bonus from its parent passed at k=2: chi2 {stat:.1f} < {crit:.1f}"


def test_several_paths_are_lossless_in_units_of_steps(target8, monkeypatch):
    """i.i.d. DBlast paths through the compiled loop's units (runner.py, run as Python): lossless."""
    monkeypatch.setattr(runner, 'compiled', lambda fn, *how, **options: fn)
    stat, crit, stats = chi2_paths(target8, make_drafter('K4-sampled-mixture-zt1'), 1.5, 4, compile=True)
    assert stat < crit, f"paths in units: chi2 {stat:.1f} >= {crit:.1f}"


def test_chi_square_catches_r_not_updated_after_a_rejected_candidate(target8, monkeypatch):
    """The next candidate tested against p instead of the residual, and the bonus drawn from p."""
    monkeypatch.setattr(verification, 'residual', lambda p, q, drafts: p)
    stat, crit, _ = chi2_paths(target8, make_drafter('heads-sampled'), 1.5, 4)
    assert stat > crit, f"r not updated passed: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.slow
def test_chi_square_catches_every_candidate_tested_against_path_0s_q(target8, monkeypatch):
    """One path per branch, each branch its own q; testing all of them against the first path's q
    is wrong wherever the branches differ."""
    real = verification.verify_tree_sampled
    monkeypatch.setattr(verification, 'verify_tree_sampled',
                        lambda logits, q, drafts, T, g=None: real(logits, q[:, :1].expand_as(q), drafts, T, g))
    d = make_drafter('K4-sampled-branch-zt1')
    d.paths_from = 'branches'
    stat, crit, _ = chi2_paths(target8, d, 0.7, 4)
    assert stat > crit, f"path 0's q for all passed: chi2 {stat:.1f} < {crit:.1f}"


@pytest.mark.slow
def test_chi_square_catches_branch_paths_verified_against_the_mixture(target8, monkeypatch):
    """Paths drawn one per branch are not i.i.d. samples of the mixture: verifying them against the
    mixture's conditionals (right for i.i.d. paths) biases the output. At Z_T = 0 the mixture is
    the top branch alone, so every later branch's path is tested against the top branch's q."""
    d = make_drafter('K4-sampled-branch-zt0')
    d.paths_from = 'branches'
    real = d.draft_paths

    def mixture_q(h, bonus, tgt, k, paths, T, g):
        drafts, _ = real(h, bonus, tgt, k, paths, T, g)
        log_pi, logits = d.mixture_logits(h, bonus, tgt, k)
        rows = lambda t: t.repeat_interleave(paths, 0)                     # noqa: E731
        Q = dblast.conditionals(rows(dblast.prior(log_pi, d.zt)), rows(dblast.branch_log_probs(logits, T, True)),
                                drafts.flatten(0, 1))
        return drafts, Q.view(*drafts.shape, -1)
    monkeypatch.setattr(d, 'draft_paths', mixture_q)
    stat, crit, _ = chi2_paths(target8, d, 1.0, 2)
    assert stat > crit, f"mixture Q for branch paths passed: chi2 {stat:.1f} < {crit:.1f}"


def test_branch_order_is_a_draw_without_replacement_from_the_prior():
    """branch_order (MATH.md §9): a permutation of the branches, drawn without replacement from
    pi' = softmax(log pi / Z_T): at Z_T = 1 its first is a sample of pi (Gumbel-max); at Z_T = 0.5,
    where pi' != pi, its first ~ pi' and its second ~ sum_a pi'(a) pi'(.) / (1 - pi'(a)); Z_T = 0
    sorts by the prior."""
    log_pi = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(30000, 3)
    order = dblast.branch_order(log_pi, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(order.sort(-1).values, torch.arange(3).expand(30000, 3))
    first = torch.bincount(order[:, 0], minlength=3).double() / 30000
    assert (first - torch.tensor([0.1, 0.6, 0.3])).abs().max() < 0.015, first
    assert dblast.branch_order(log_pi[:1], 0.0).tolist() == [[1, 2, 0]]
    n, zt = 40000, 0.5
    pi = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    pp = pi ** (1 / zt) / (pi ** (1 / zt)).sum()
    order = dblast.branch_order(pi.log().expand(n, 3), zt, torch.Generator().manual_seed(0))
    second = torch.stack([sum(pp[a] * pp[b] / (1 - pp[a]) for a in range(3) if a != b) for b in range(3)])
    for got, want in ((order[:, 0], pp), (order[:, 1], second)):
        freq = torch.bincount(got, minlength=3).double() / n
        se = (want * (1 - want) / n).sqrt()
        assert ((freq - want).abs() < 4.5 * se + 1e-4).all(), (freq, want)


def test_one_path_is_todays_step(target8, monkeypatch):
    """MATH.md §9: N = 1 is the step of section 2, unchanged. draft_paths with one path draws the
    same random numbers as draft (drafts and Q bit for bit, for the mixture and for any drafter's
    default), and paths=1 decodes without any of the tree of paths' code: its layout, its
    verifiers, moving the kept path's keys and values."""
    h = torch.randn(5, V8.n_embd)
    bonus = torch.randint(V, (5,))
    for d in (make_drafter('K4-sampled-mixture-zt1'), make_drafter('heads-sampled')):
        a = d.draft(h, bonus, target8, 4, 1.2, torch.Generator().manual_seed(3))
        b = d.draft_paths(h, bonus, target8, 4, 1, 1.2, torch.Generator().manual_seed(3))
        assert torch.equal(a[0], b[0][:, 0]) and torch.equal(a[1], b[1][:, 0])

    def tree_of_paths(*args, **kwargs):
        raise AssertionError("paths=1 went through the tree of paths")
    for where, name in ((decode, 'tree_layout'), (verification, 'verify_tree_greedy'),
                        (verification, 'verify_tree_sampled'), (KVCache, 'keep_path')):
        monkeypatch.setattr(where, name, tree_of_paths)
    d = copy.deepcopy(make_drafter('K4-sampled-mixture-zt1'))
    for temperature in (0.0, 1.0):
        _, stats = generate(target8, V8_PROMPT.expand(8, -1), 12, drafter=d, temperature=temperature, paths=1,
                            generator=torch.Generator().manual_seed(5))
        assert max(stats['accept_lengths']) > 1
    with pytest.raises(AssertionError, match='tree of paths'):   # the control: two paths do
        generate(target8, V8_PROMPT.expand(8, -1), 12, drafter=d, temperature=1.0, paths=2,
                 generator=torch.Generator().manual_seed(5))


def math_md_tree_example():
    """The worked example's tensors as MATH.md §9 prints them: `name = value  # comment` lines
    (a value may run over indented lines) in the code block after the tree-example marker."""
    text = open(os.path.join(ROOT, 'MATH.md')).read().split('<!-- tree-example -->', 1)[1]
    block = text.split('```', 2)[1]
    entries, name = {}, None
    for line in block.splitlines()[1:]:
        code = line.split('#', 1)[0].rstrip()
        if not code.strip():
            continue
        if not line[0].isspace():
            name, _, code = code.partition('=')
            name = name.strip()
            entries[name] = ''
        entries[name] += code.strip()
    return {k: ast.literal_eval(v) for k, v in entries.items()}


def test_the_worked_tree_example_in_math_md_is_what_the_code_computes():
    """MATH.md §9's example, recomputed: the block, the tree mask, the node bookkeeping and the
    walk from the printed coins' outcome, down to the slots KVCache.keep_path moves."""
    ex = math_md_tree_example()
    drafts = torch.tensor([ex['drafts']])                                  # (1, N, n)
    N, n = drafts.shape[1:]
    assert ex['block'] == ['b'] + drafts.flatten().tolist()
    depth, attend = tree_layout(N, n, 'cpu')
    assert depth.tolist() == ex['depth'] and attend.int().tolist() == ex['attend']
    same, first, node, through = tree_nodes(drafts)
    assert same.int()[0].tolist() == ex['same'] and first[0].tolist() == ex['first']
    assert node[0].tolist() == ex['node'] and through.int()[0].tolist() == ex['through']
    match, n_acc, path, last = tree_walk(torch.tensor([ex['kept_token']]), node, drafts)
    assert match.int()[0].tolist() == ex['match']
    assert (int(n_acc), int(path), int(last)) == (ex['n_acc'], ex['path'], ex['last'])
    src = verification.path_slots(N, n, 'cpu')[path][0, 1:]
    assert [src.tolist(), list(range(1, n + 1))] == ex['keep']
    assert not through[0, ex['last']].any()        # the walk ends at a leaf: its r is p, untouched


def test_paths_that_part_and_meet_again_share_no_node():
    """A node is a prefix, not a token at a depth: paths [3, 5, 7] and [6, 5, 7] part at their first
    token and agree after it, and share no node below the bonus. With 6 and then 5 accepted, the walk
    goes down path 1 to its own slot 5 (whose p gives the bonus), not to path 0's node [3, 5]."""
    drafts = torch.tensor([[[3, 5, 7], [6, 5, 7]]])
    same, first, node, through = tree_nodes(drafts)
    assert not same[0, 0, 1].any() and not same[0, 1, 0].any()
    assert node[0].tolist() == [[0, 1, 2, 3], [0, 4, 5, 6]]
    assert not through[0, 2, 1] and through[0, 5, 1]        # path 1 continues below its own node only
    kept = torch.full((1, 7), -1)
    kept[0, 0], kept[0, 4] = 6, 5                           # 6 accepted at the root, 5 below it
    _, n_acc, path, last = tree_walk(kept, node, drafts)
    assert (int(n_acc), int(path), int(last)) == (2, 1, 5)


@pytest.mark.parametrize('point_mass', [False, True])
def test_a_rejected_token_has_no_mass_left_at_its_node(point_mass):
    """MATH.md §9's lemma: after a candidate token v is rejected at a node, the residual is 0 at v,
    whatever the proposal (so a duplicate of v is never accepted later at that node)."""
    g = torch.Generator().manual_seed(0)
    B, V = 20000, 6
    r = torch.softmax(torch.randn(B, 1, V, generator=g, dtype=torch.float64) * 2, -1)
    Q = None if point_mass else torch.softmax(torch.randn(B, 1, V, generator=g, dtype=torch.float64) * 2, -1)
    c = torch.randint(V, (B, 1), generator=g) if point_mass else sample(Q, g)
    rejected = ~verification.accept_sampled(r, Q, c, g)[:, 0]
    assert rejected.sum() > 1000                                            # the test sees many rejections
    left = verification.residual(r, Q, c)                                         # (B, 1, V)
    assert (left.gather(-1, c[..., None])[rejected] == 0).all()


# ----------------------------------------------------------------------------- what docstrings say, pinned

def _branchy(K, **kw):
    torch.manual_seed(0)
    d = peaky(DBlastDrafter(V8, 4, K, **kw), 0.6, 2)
    target = peaky(GPT(V8), 0.3, 0)
    h = torch.randn(3, V8.n_embd, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return d, target, h, torch.tensor([1, 4, 6])


def _argmax_paths(d, target, h, bonus):
    """Each branch's argmax path (B, K, n) and the prior log pi (B, K)."""
    with torch.no_grad():
        log_pi, logits = d.mixture_logits(h, bonus, target, 4)
    return logits.argmax(-1), log_pi


def test_one_path_per_branch_comes_round_again_past_K():
    """DBlastDrafter.draft_paths, paths_from='branches': 'past K they come round again' (path i is
    branch order[i mod K]); argmax branches, so each path is its branch's argmax path."""
    K, paths = 2, 5
    d, target, h, bonus = _branchy(K, sample_drafts=False, verify='branch', paths_from='branches')
    own, _ = _argmax_paths(d, target, h, bonus)
    assert not torch.equal(own[:, 0], own[:, 1])                           # the branches differ
    drafts, Q = d.draft_paths(h, bonus, target, 4, paths, 1.0, torch.Generator().manual_seed(0))
    assert Q is None
    for i in range(paths):
        assert torch.equal(drafts[:, i], drafts[:, i % K]), i
    assert all({tuple(x) for x in drafts[b, :K].tolist()} == {tuple(x) for x in own[b].tolist()} for b in range(3))


def test_at_zt0_one_path_per_branch_takes_the_K_most_probable_and_is_not_refused():
    """DBlastDrafter.meaningless: at Z_T = 0 argmax i.i.d. paths are all the top branch's (refused),
    'while one per branch takes the K most probable' (allowed): path i is the i-th most probable
    branch's argmax path."""
    K = 3
    d, target, h, bonus = _branchy(K, sample_drafts=False, verify='branch', paths_from='branches', zt=0.0)
    assert d.meaningless(0.0, K) == []
    drafts, _ = d.draft_paths(h, bonus, target, 4, K, 0.0)
    own, log_pi = _argmax_paths(d, target, h, bonus)
    order = log_pi.argsort(-1, descending=True)
    assert torch.equal(drafts, own.gather(1, order[:, :, None].expand(-1, -1, own.size(-1))))
    iid = _branchy(K, sample_drafts=False, verify='branch', zt=0.0)[0]
    assert [s for s, _, _ in iid.meaningless(0.0, K)] == ['paths']
