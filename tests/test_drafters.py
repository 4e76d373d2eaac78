"""The drafters that read the text (drafters.py): a draft model with its own KV cache, prompt
lookup, and several drafters' paths in one call; the token trees of the first two. Exactness
against plain greedy decoding, the draft model's drafts and tree scores against a full recompute at
batch > 1 with ragged acceptance, prompt lookup and its tree scores against Hugging Face's rule and
counting written out in Python, losslessness by chi-square with negative controls, and the
refusals."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

import drafters
import runner
from conftest import V8, peaky, tiny_model
from cli import BadInput
from decode import generate
from drafters import DraftModel, MixedPaths, PromptLookup
from heads import BlockHeads, Text, grow_tree
from model import GPT
from test_paths import chi2_paths
from test_sampling import chi2_of, chi_square, continuation_probs, make_drafter
from test_trees import tree_counts


# ----------------------------------------------------------------------------- prompt lookup

def lookup_reference(text, ngram, n_drafts):
    """Hugging Face's prompt lookup on one row (a list: the committed text and the bonus), written
    out: the longest n-gram first, its earliest occurrence with something after it; then this
    project's rule past the end of the text (the match's continuation repeated) and without a
    match (the bonus repeated)."""
    L = len(text)
    for g in range(min(ngram, L - 1), 0, -1):
        for i in range(L - g + 1):
            if text[i:i + g] == text[L - g:] and i + g < L:
                cont = text[i + g:]
                return [cont[j % len(cont)] for j in range(n_drafts)]
    return [text[-1]] * n_drafts


@pytest.mark.parametrize('ngram', [1, 2, 3])
def test_prompt_lookup_is_hugging_faces_rule(ngram):
    """Random texts of a 3-token vocabulary (so that n-grams repeat), each row its own length, with
    stale tokens past each row's end (which must never match): the drafts are the reference's."""
    g = torch.Generator().manual_seed(ngram)
    B, W, k = 64, 24, 6
    tokens = torch.randint(3, (B, W), generator=g)
    n = torch.randint(0, W - 1, (B,), generator=g)
    n[:4] = torch.tensor([0, 1, 2, W - 2])
    bonus = torch.randint(3, (B,), generator=g)
    drafts, Q = PromptLookup(ngram, k).draft(None, bonus, None, k, text=Text(tokens, n))
    assert Q is None
    for b in range(B):
        text = tokens[b, :n[b]].tolist() + [int(bonus[b])]
        assert drafts[b].tolist() == lookup_reference(text, ngram, k - 1), (b, text)


def test_prompt_lookup_ignores_what_lies_past_the_text():
    """A match in stale tokens past n is no match: the row drafts the bonus repeated."""
    tokens = torch.tensor([[1, 2, 3, 9, 5, 7, 5, 7, 6, 6]])
    drafts, _ = PromptLookup(2, 4).draft(None, torch.tensor([7]), None, 4, text=Text(tokens, torch.tensor([3])))
    assert drafts.tolist() == [[7, 7, 7]]


def occurrences_reference(text, ngram, n_drafts):
    """Every occurrence lookup_reference could have taken (the longest n-gram size with any, each
    occurrence with something after it), as the list of their continuations, in text order."""
    L = len(text)
    for g in range(min(ngram, L - 1), 0, -1):
        conts = [text[i + g:] for i in range(L - g + 1) if text[i:i + g] == text[L - g:] and i + g < L]
        if conts:
            return [[c[j % len(c)] for j in range(n_drafts)] for c in conts]
    return []


@pytest.mark.parametrize('ngram', [1, 2])
def test_a_lookup_tree_scores_children_by_the_occurrences_that_continue_so(ngram):
    """PromptLookup.next_log_q against counting written out: after a node's prefix, token x scores
    log(occurrences continuing with prefix + x / occurrences continuing with prefix), -inf where
    none does (a row without a match: every token); stale tokens past each row's end never count.
    Its one path (draft) is the earliest occurrence's continuation."""
    g = torch.Generator().manual_seed(10 + ngram)
    B, W, k, V = 48, 20, 5, 3
    tokens = torch.randint(V, (B, W), generator=g)
    n = torch.randint(0, W - 1, (B,), generator=g)
    n[:3] = torch.tensor([0, 1, W - 2])
    bonus = torch.randint(V, (B,), generator=g)
    lookup, target = PromptLookup(ngram, k), tiny_model(vocab_size=V)
    text = Text(tokens, n)
    log_q = lookup.next_log_q(None, bonus, target, k, text=text)
    for d in range(k - 1):
        prefix = torch.randint(V, (B, 6, d), generator=g)
        conts = [occurrences_reference(tokens[b, :n[b]].tolist() + [int(bonus[b])], ngram, k - 1) for b in range(B)]
        for b in range(B):           # the first row of each: a prefix some occurrence has, where one exists
            if conts[b]:
                prefix[b, 0] = torch.tensor(conts[b][int(torch.randint(len(conts[b]), (1,), generator=g))][:d])
        got = log_q(d, prefix)                                            # (B, 6, V)
        for b in range(B):
            for r in range(6):
                p = prefix[b, r].tolist()
                after = [c[d] for c in conts[b] if c[:d] == p]
                want = torch.tensor([math.log(after.count(x) / len(after)) if x in after else -math.inf
                                     for x in range(V)])
                assert torch.allclose(got[b, r].double(), want.double(), atol=1e-6, equal_nan=False), (b, r, p)
    drafts, _ = lookup.draft(None, bonus, None, k, text=text)
    for b in range(B):
        conts = occurrences_reference(tokens[b, :n[b]].tolist() + [int(bonus[b])], ngram, k - 1)
        assert drafts[b].tolist() == (conts[0] if conts else [int(bonus[b])] * (k - 1))


# ----------------------------------------------------------------------------- exactness

def near(model, scale, seed):
    """A copy of model with its weights moved by noise of relative size `scale`: a draft model
    that agrees with the target often, not always (ragged acceptance)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp(min=1e-3))
    return other


@pytest.fixture(scope='module')
def world():
    target = tiny_model(0, std=0.3)
    prompt = torch.randint(64, (3, 9), generator=torch.Generator().manual_seed(0))
    prompt[:, 4:8] = prompt[:, :4]           # something for the lookup to find
    base, _ = generate(target, prompt, 40)
    return target, prompt, base


def drafters_of(target):
    heads = peaky(BlockHeads(target.config, 5), 0.05, 3)
    return {'draft model': (DraftModel(near(target, 0.3, 1), k=5), 1),
            'prompt lookup': (PromptLookup(2, 5), 1),
            'heads + lookup': (MixedPaths([heads, PromptLookup(2, 5)]), 2),
            'heads + draft model + lookup': (MixedPaths([heads, DraftModel(near(target, 0.3, 2), k=5),
                                                         PromptLookup(1, 5)]), 3)}


@pytest.mark.parametrize('name', ['draft model', 'prompt lookup', 'heads + lookup', 'heads + draft model + lookup'])
@pytest.mark.parametrize('compile', [False, True])
def test_greedy_output_is_plain_greedy_decodings(world, name, compile, monkeypatch):
    """Batch 3, ragged acceptance: every drafter and mix decodes exactly plain greedy decoding's
    tokens, op by op and through the compiled loop's static buffers and units of steps (run as
    Python here: test_compiled.py traces them)."""
    target, prompt, base = world
    drafter, paths = drafters_of(target)[name]
    if compile:
        monkeypatch.setattr(runner, 'compiled', lambda fn, *how, **options: fn)
    out, stats = generate(target, prompt, 40, drafter=drafter, paths=paths, compile=compile)
    assert torch.equal(out, base), name
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 5).any(), (name, stats['mean_tau'])


@pytest.mark.parametrize('kind', ['lookup', 'draft model'])
@pytest.mark.parametrize('nodes', [1, 6, 24])
@pytest.mark.parametrize('compile', [False, True])
def test_text_drafters_trees_decode_exactly_greedy(world, kind, nodes, compile, monkeypatch):
    """A tree of the text's repeats (PromptLookup.next_log_q) or of a draft model's q
    (DraftModel.next_log_q), walked with the target's argmax: plain greedy decoding's tokens,
    batch 3, eager and through the compiled loop (as Python)."""
    target, prompt, base = world
    if compile:
        monkeypatch.setattr(runner, 'compiled', lambda fn, *how, **options: fn)
    drafter = PromptLookup(2, 5) if kind == 'lookup' else DraftModel(near(target, 0.3, 1), k=5)
    out, stats = generate(target, prompt, 40, drafter=drafter, nodes=nodes, compile=compile)
    assert torch.equal(out, base)
    assert any(t > 1 for t in stats['accept_lengths'])


class Recomputed(DraftModel):
    """A draft model that checks each of its drafts against a full recompute (GPT.forward over
    the row's committed text, the bonus and the drafts before it, no cache)."""
    worst = 0.0

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None, text=None):
        drafts, Q = super().draft(h, bonus, target, k, temperature, generator, text)
        for r in range(bonus.size(0)):
            seq = torch.cat([text.tokens[r, :int(text.n[r])], bonus[r:r + 1], drafts[r, :-1]])
            logits = self.model(seq[None])[0][0, -(k - 1):]
            if Q is None:
                assert torch.equal(logits.argmax(-1), drafts[r]), (r, logits.argmax(-1), drafts[r])
            else:
                q = F.softmax(logits / temperature, dim=-1)
                Recomputed.worst = max(Recomputed.worst, float((q - Q[r]).abs().max()))
        return drafts, Q


class RecomputedTree(DraftModel):
    """A draft model that checks every score it gives a tree's nodes against a full recompute (its
    log q at the temperature, greedy at 1, after the row's committed text, the bonus and the node's
    prefix, no cache)."""
    worst, scored = 0.0, 0

    def next_log_q(self, h, bonus, target, k, temperature=0.0, text=None):
        log_q = super().next_log_q(h, bonus, target, k, temperature, text)
        n = text.n.clone()                     # the text as it is now: the walk writes it later

        def checked(d, prefix):
            got = log_q(d, prefix)
            for r in range(bonus.size(0)):
                for m in range(prefix.size(1)):
                    seq = torch.cat([text.tokens[r, :int(n[r])], bonus[r:r + 1], prefix[r, m]])
                    want = F.log_softmax(self.model(seq[None])[0][0, -1] / (temperature or 1.0), dim=-1)
                    RecomputedTree.worst = max(RecomputedTree.worst, float((got[r, m] - want).abs().max()))
                    RecomputedTree.scored += 1
            return got
        return checked


@pytest.mark.parametrize('temperature', [0.0, 1.0, 0.6])
def test_a_draft_models_tree_scores_are_a_full_recomputes(world, temperature):
    """At batch 3 with ragged acceptance, every node the draft model scores (its catch-up, then one
    call a depth feeding every node's prefix as a chain after the bonus) gets the log q a full
    recompute gives, at the temperature (greedy: 1), to 1e-9 in float64. A chain that saw another chain's tokens, or a depth whose
    chains were not fed past the bonus, fails this."""
    target, prompt, _ = world
    RecomputedTree.worst, RecomputedTree.scored = 0.0, 0
    d = RecomputedTree(near(target, 0.3, 1), k=5)
    _, stats = generate(target, prompt, 30, drafter=d, temperature=temperature, nodes=7,
                        generator=torch.Generator().manual_seed(0))
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 5).any()
    # prompts shorter than k: the first windows reach past the text (DraftModel.catch_up)
    generate(target, prompt[:, :2], 6, drafter=d, temperature=temperature, nodes=7,
             generator=torch.Generator().manual_seed(0))
    assert RecomputedTree.scored > 100 and RecomputedTree.worst < 1e-9


@pytest.mark.parametrize('temperature,paths', [(0.0, 1), (1.0, 2)])
def test_draft_models_drafts_are_a_full_recomputes(world, temperature, paths):
    """At batch 3 with ragged acceptance (and two paths, each with its own cache), every draft
    the cached draft model makes is the one a full recompute makes: its argmax, or under sampling
    its q (float64, to 1e-9). A cache that does not catch up after a fully accepted block, or is
    not rolled back after a rejection, fails this (decoding stays exact either way: only the
    drafts would be worse)."""
    target, prompt, _ = world
    Recomputed.worst = 0.0
    d = Recomputed(near(target, 0.3, 1), k=5)
    _, stats = generate(target, prompt, 40, drafter=d, temperature=temperature, paths=paths,
                        generator=torch.Generator().manual_seed(0))
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus == 5).any() and (taus < 5).any()      # fully accepted blocks and rejections both
    # prompts shorter than k: the first windows reach past the text (DraftModel.catch_up)
    generate(target, prompt[:, :2], 10, drafter=d, temperature=temperature, paths=paths,
             generator=torch.Generator().manual_seed(0))
    assert Recomputed.worst < 1e-9


class WindowOfTwo(Recomputed):
    """Recomputed, catching up on the last committed token and the bonus only."""

    def catch_up(self, bonus, k, text):
        return super().catch_up(bonus, 1, text)


def test_one_path_needs_a_catch_up_of_two_tokens_only(world):
    """MATH.md §11: with one path, a catch-up window of the last committed token and the bonus gives
    a full recompute's drafts, rejections and fully accepted blocks alike; with two paths it does
    not (another path's drafts sit where the kept path's tokens now are)."""
    target, prompt, _ = world
    worst = []
    for paths in (1, 2):
        Recomputed.worst = 0.0
        _, stats = generate(target, prompt, 40, drafter=WindowOfTwo(near(target, 0.3, 1), k=5), temperature=1.0,
                            paths=paths, generator=torch.Generator().manual_seed(0))
        taus = torch.tensor(stats['accept_lengths'])
        assert (taus == 5).any() and (taus < 5).any()
        worst.append(Recomputed.worst)
    assert worst[0] < 1e-9 and worst[1] > 1e-3, worst


def test_a_draft_model_that_is_the_target_is_always_accepted(world):
    """The target as its own draft model: every draft is accepted, greedy and sampled (p = q)."""
    target, prompt, base = world
    for T in (0.0, 1.0):
        out, stats = generate(target, prompt, 40, drafter=DraftModel(target, k=5), temperature=T,
                              generator=torch.Generator().manual_seed(1))
        assert set(stats['accept_lengths']) == {5}, stats['accept_lengths']
        assert T > 0 or torch.equal(out, base)


# ----------------------------------------------------------------------------- losslessness

@pytest.fixture(scope='module')
def target8(v8_target):
    return copy.deepcopy(v8_target).float()


def draft_model8(sample_drafts=True):
    return DraftModel(peaky(GPT(V8), 0.3, 5).float(), k=4, sample_drafts=sample_drafts)


@pytest.mark.parametrize('which,temperature', [
    ('draft model, sampled drafts', 1.5),
    pytest.param('draft model, argmax drafts', 0.7, marks=pytest.mark.slow),
    ('prompt lookup', 1.5)])
def test_text_drafters_are_lossless(target8, which, temperature):
    """3-token continuations follow the target's exact distribution (test_sampling's chi-square)."""
    drafter = {'draft model, sampled drafts': draft_model8(True), 'draft model, argmax drafts': draft_model8(False),
               'prompt lookup': PromptLookup(2, 4)}[which]
    stat, crit, stats = chi2_of(target8, drafter, temperature)
    assert stat < crit, f"{which} T={temperature}: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 4).any()


@pytest.mark.parametrize('which,temperature', [('sampled heads + lookup', 1.5),
                                               pytest.param('draft model + argmax heads', 0.7,
                                                            marks=pytest.mark.slow)])
def test_mixed_paths_are_lossless(target8, which, temperature):
    """Paths of different drafters in one call, each verified against its own proposal (a point
    mass for the lookup's and argmax heads'): the target's distribution (test_paths' chi-square)."""
    drafters = {'sampled heads + lookup': [make_drafter('heads-sampled'), PromptLookup(2, 4)],
                'draft model + argmax heads': [draft_model8(True), make_drafter('heads-argmax')]}[which]
    stat, crit, stats = chi2_paths(target8, MixedPaths(drafters), temperature, 2)
    assert stat < crit, f"{which}: chi2 {stat:.1f} >= {crit:.1f}"
    taus = torch.tensor(stats['accept_lengths'])
    assert (taus > 1).any() and (taus < 4).any()


@pytest.mark.parametrize('which,tree', [('prompt lookup', 'best-first'), ('prompt lookup', 'sampled'),
                                        pytest.param('draft model', 'best-first', marks=pytest.mark.slow),
                                        pytest.param('draft model', 'sampled', marks=pytest.mark.slow)])
def test_text_drafters_trees_are_lossless(target8, which, tree):
    """A tree of the text's repeats, or of a draft model's q, walked with the target's own samples,
    or drawn from them and walked by recursive rejection sampling (test_trees' chi-square): the
    target's distribution, with some drafts taken."""
    drafter = PromptLookup(1, 4) if which == 'prompt lookup' else draft_model8()
    how = dict(nodes=6) if tree == 'best-first' else dict(nodes=None, branching=(2, 2, 2))
    counts, stats = tree_counts(target8, drafter, 1.5, 4, **how)
    stat, crit = chi_square(counts, continuation_probs(1.5), 20000)
    assert stat < crit, f"{which} {tree} tree: chi2 {stat:.1f} >= {crit:.1f}"
    assert any(t > 1 for t in stats['accept_lengths'])


def test_chi_square_catches_a_draft_models_q_at_another_temperature(target8, monkeypatch):
    """Drafts sampled at T = 1.5 but verified with the draft model's q at T = 1: biased, caught."""
    drafter = draft_model8(True)
    real = drafters.drafts_from

    def q_at_t1(logits, temperature, sample_drafts, generator):
        d, q = real(logits, temperature, sample_drafts, generator)
        return d, F.softmax(logits.float(), dim=-1)
    monkeypatch.setattr(drafters, 'drafts_from', q_at_t1)
    stat, crit, _ = chi2_of(target8, drafter, 1.5)
    assert stat > crit, f"q at another temperature passed: chi2 {stat:.1f} < {crit:.1f}"


def test_chi_square_catches_mixed_paths_verified_against_one_drafters_q(target8, monkeypatch):
    """Every path verified against the first drafter's Q (the lookup's point mass taken for the
    sampled heads' q): biased, caught."""
    mixed = MixedPaths([make_drafter('heads-sampled'), PromptLookup(1, 4)])
    real = mixed.draft_paths

    def first_q(*a, **kw):
        drafts, Q = real(*a, **kw)
        return drafts, Q[:, :1].expand_as(Q).contiguous()
    monkeypatch.setattr(mixed, 'draft_paths', first_q)
    stat, crit, _ = chi2_paths(target8, mixed, 1.5, 2)
    assert stat > crit, f"one drafter's Q for every path passed: chi2 {stat:.1f} < {crit:.1f}"


# ----------------------------------------------------------------------------- refusals

def test_a_draft_model_that_does_not_fit_is_refused(world):
    target, prompt, _ = world
    other_vocab = tiny_model(1, vocab_size=32)
    short = tiny_model(1, block_size=32)
    for draft, want in ((other_vocab, "vocabulary has 32 ids, the target's 64"),
                        (short, "context is 32 tokens, shorter than the target's 64")):
        with pytest.raises(BadInput, match=want):
            generate(target, prompt, 4, drafter=DraftModel(draft))


def test_refusals_of_text_drafters(world):
    target, prompt, _ = world
    with pytest.raises(BadInput, match='paths=2 means nothing here'):
        generate(target, prompt, 4, drafter=PromptLookup(2, 4), paths=2)
    with pytest.raises(BadInput, match='grows no token trees'):
        generate(target, prompt, 4, drafter=MixedPaths([PromptLookup(1, 4), PromptLookup(2, 4)]), nodes=8)
    with pytest.raises(BadInput, match='use paths=2'):
        generate(target, prompt, 4, drafter=MixedPaths([PromptLookup(1, 4), PromptLookup(2, 4)]))
    with pytest.raises(ValueError, match='ngram >= 1'):
        PromptLookup(0, 4)
    context = target.config.block_size           # a drafter that drafts any length is given its k
    for drafter in (PromptLookup(2, context + 1), DraftModel(near(target, 0.3, 1), k=context + 1)):
        with pytest.raises(BadInput, match=rf"^k={context + 1}: a block of k tokens would be longer than the model's "
                                           rf"context of {context} tokens$"):
            generate(target, prompt, 4, drafter=drafter)
    with pytest.raises(BadInput, match=r"^nodes=1024 at k=20: growing a tree scores up to nodes x \(k-1\) = 19456"):
        generate(target, prompt, 4, drafter=PromptLookup(2, 20), nodes=1024)


def test_the_exact_evaluator_refuses_a_drafter_that_reads_the_text(world):
    """The exact evaluator needs a drafter's distributions from the target's state; a draft model
    or prompt lookup has none: one line, before any work."""
    from dblast import expected_tau
    target, _, _ = world
    for d in (DraftModel(target), PromptLookup(2, 4)):
        with pytest.raises(BadInput, match='the exact evaluator .* has none: measure it by decoding'):
            expected_tau(d, target, None, 4, 1.0, True, 'mixture')


def test_a_drafter_that_does_not_fit_the_target_is_refused_before_any_work(world):
    """A drafter made for a target of another width, or in another dtype than the target's (a
    .float() drafter beside a float64 target): one line, not torch's error from inside a matmul."""
    target, prompt, _ = world
    narrow = BlockHeads(tiny_model(1, n_embd=16).config, 4).double()
    with pytest.raises(BadInput, match='width n_embd=16; this target.s is 32'):
        generate(target, prompt, 4, drafter=narrow)
    with pytest.raises(BadInput, match='its weights are torch.float32, the target.s torch.float64'):
        generate(target, prompt, 4, drafter=BlockHeads(target.config, 4).float())


# ----------------------------------------------------------------------------- MATH.md's equations, written out

def test_a_draft_model_costs_k_minus_1_calls_per_target_call_path_or_tree():
    """§11: a draft model drafts one path in k - 1 calls of its own (the catch-up, then one a draft
    but the last, which is never fed), and grows a tree in k - 1 calls too (the catch-up, then one a
    depth)."""
    target, k = tiny_model(0, std=0.3), 5
    dm = DraftModel(tiny_model(1, std=0.3), k=k)
    calls = []
    real = dm.model.forward_cached
    dm.model.forward_cached = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    prompt = torch.randint(64, (2, 9), generator=torch.Generator().manual_seed(0))
    for nodes in (None, 6):
        state = dm.new_state(2, 64)
        dm.read_prompt(state, prompt)
        calls.clear()
        text = Text(F.pad(prompt, (0, 1)), torch.full((2,), 9), state)
        bonus = torch.tensor([3, 4])
        if nodes is None:
            drafts, _ = dm.draft(None, bonus, target, k, 0.0, None, text=text)
            assert drafts.shape == (2, k - 1)
        else:
            grow_tree(dm.next_log_q(None, bonus, target, k, 0.0, text=text), 2, k - 1, nodes, 'cpu')
        assert len(calls) == k - 1, (nodes, len(calls))
