"""
decode.py: Blockwise Parallel Decoding's drafted fast path against the plain / naive reference.

Exact mode equals plain greedy (and plain greedy equals the naive full recompute) for untrained,
randomised and trained heads at every k, and for an oracle drafter; the lossy modes (topk:N,
minblock:N) commit only what their rule allows; bad arguments to generate and bad drafter
checkpoints (load_drafter) raise BadInput; the rows of a batch advance independently; the decode
command line ends bad input in one clean `error:` line.

Tiny seeded models, float64 wherever a test claims exactness. The module fixtures train one tiny
target on a periodic token stream and BPD heads on it (a few seconds), so "trained heads" accept
long blocks while "randomised heads" are mostly wrong: both must reproduce plain greedy exactly.
"""
import math
import os

import numpy as np
import pytest
import torch

from cli import BadInput, Precision, pick_dtype
from conftest import ROOT, Proc, assert_clean_error, naive_greedy, randomise, run_main, tiny_model
from data import save_checkpoint
import decode
from dblast import DBlastDrafter
from decode import generate, merged_step
from drafters import load_drafter
from runner import static_cache
from heads import BlockHeads, Text
from model import GPT, GPTConfig
import verification

V = 32           # vocabulary of the tiny target
K_MAX = 8        # block size the heads are built / trained for
T0 = 12          # prompt length
M = 40           # new tokens in the batch tests
CFG = dict(block_size=96, vocab_size=V, n_layer=2, n_head=2, n_embd=32)


# ----------------------------------------------------------------------------- helpers

class Oracle:
    """A drafter that knows the target's greedy future `ref` (B, L) and drafts it.

    It tracks each row's bonus position itself: prefill puts the bonus at T0; after each step an
    active row moves on by `adv[b]` tokens (k for a row drafted correctly, which accepts the whole
    block; 1 for a row whose first draft is deliberately wrong). `draft` asserts that the bonus it
    is handed is the one it expects, so a desynchronised pointer (or a wrong commit) fails loudly.
    """

    def __init__(self, ref, t0, total, k_max, bad_rows=()):
        B = ref.size(0)
        self.k = k_max
        self.ref = torch.cat([ref, torch.zeros(B, 4 * k_max, dtype=torch.long)], dim=1)
        self.total = total
        self.bad = torch.zeros(B, dtype=torch.bool)
        self.bad[list(bad_rows)] = True
        self.pos = None
        self.t0 = t0
        self.n_calls = 0

    def draft(self, h, bonus, target, k, temperature, generator):
        assert h.shape == (bonus.size(0), target.config.n_embd)
        if self.pos is None:
            self.pos = torch.full((bonus.size(0),), self.t0, dtype=torch.long)
        else:
            adv = torch.where(self.bad, torch.ones_like(self.pos), torch.full_like(self.pos, k))
            self.pos = torch.where(self.pos < self.total, self.pos + adv, self.pos)
        self.n_calls += 1
        rows = torch.arange(bonus.size(0))
        live = self.pos < self.total
        assert torch.equal(bonus[live], self.ref[rows, self.pos][live]), "oracle desynchronised"
        idx = self.pos[:, None] + torch.arange(1, k)                   # (B, k-1)
        drafts = self.ref.gather(1, idx).clone()
        drafts[self.bad, 0] = (drafts[self.bad, 0] + 1) % target.config.vocab_size  # always wrong
        return drafts, None


def replay(model, heads, out, taus, t0, k, mode, n):
    """Re-derive every step of a single-row run (out (1, total), taus its accept lengths) from a
    full causal forward over the output and check it against the rules of MATH.md §2 (the merged
    step): each step's bonus is the target's argmax, the committed tokens are the heads' drafts
    from the hidden state before the bonus, every committed draft passes the mode's acceptance
    predicate and the first uncommitted draft (if any, and visible) fails it."""
    total = out.size(1)
    with torch.no_grad():
        H = model.hidden(out)                                          # (1, total, C)
        logits = model.lm_head(H)[0]                                   # (total, V)
        drafts_at = heads(H[0], model.lm_head, k - 1).argmax(-1)       # (total, k-1)
    greedy_next = logits.argmax(-1)                                    # token after position t

    def ok(j, p, d):  # draft j (0-based) of the block whose bonus sits at p, token d
        if mode == 'topk':
            return bool((logits[p + j].topk(n).indices == d).any())
        if mode == 'minblock' and j < n - 1:
            return True
        return int(d) == int(greedy_next[p + j])

    p = t0
    for s, tau in enumerate(taus):
        assert 1 <= tau <= k
        assert p < total, f"step {s} starts past the end"
        assert out[0, p] == greedy_next[p - 1], f"step {s}: bonus at {p} is not the target's argmax"
        d = drafts_at[p - 1]
        for j in range(tau - 1):                                       # committed drafts
            if p + 1 + j < total:
                assert out[0, p + 1 + j] == d[j], f"step {s}: committed token {j} is not the draft"
                assert ok(j, p, d[j]), f"step {s}: draft {j} committed but fails {mode}"
        j = tau - 1                                                    # first rejected draft
        if tau < k and p + 1 + j < total:
            assert not ok(j, p, d[j]), f"step {s}: draft {j} passes {mode} but was rejected"
        p += tau
    # the steps tile all but the last token, the last call's bonus: the target's argmax too
    assert p >= total - 1 and (not taus or p - taus[-1] < total - 1), "accept lengths do not tile the output"
    assert p > total - 1 or out[0, p] == greedy_next[p - 1], "the last bonus is not the target's argmax"


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """These models are tiny: intra-op threads only add contention on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope='module')
def data():
    """A periodic token stream (period 23 over a 32-token vocabulary), learnable in 100 steps."""
    rng = np.random.default_rng(0)
    period = rng.integers(0, V, size=23)
    return np.tile(period, 200).astype(np.uint8)


@pytest.fixture(scope='module')
def trained(data):
    """(model, heads): a tiny target trained on `data`, then k=8 heads with the target frozen.
    Trained in float32, returned in float64 (both in eval mode)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    stream = torch.from_numpy(data.astype(np.int64))

    def batch(B, L):
        ix = torch.randint(len(stream) - L, (B,), generator=g)
        return torch.stack([stream[i:i + L] for i in ix.tolist()])

    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(100):
        x = batch(16, 65)
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)

    heads = BlockHeads(model.config, K_MAX)
    opt = torch.optim.Adam(heads.parameters(), lr=3e-3)
    T = 48
    for _ in range(60):
        x = batch(8, T + K_MAX)
        with torch.no_grad():
            h = model.hidden(x[:, :T])
        loss = heads.loss(h, model.lm_head, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    heads.eval().requires_grad_(False)
    return model.double(), heads.double()


@pytest.fixture(scope='module')
def model(trained):
    return trained[0]


@pytest.fixture(scope='module')
def prompts(data):
    """Three rows: two corpus windows at different phases and one random prompt."""
    g = torch.Generator().manual_seed(1)
    stream = torch.from_numpy(data.astype(np.int64))
    return torch.stack([stream[5:5 + T0], stream[40:40 + T0], torch.randint(0, V, (T0,), generator=g)])


@pytest.fixture(scope='module')
def greedy_ref(model, prompts):
    """Plain greedy for `prompts`, M + 2*K_MAX tokens (the oracle needs the future past M)."""
    out, stats = generate(model, prompts, M + 2 * K_MAX)
    assert stats['calls'] == M + 2 * K_MAX              # one call a token, the prefill's included
    return out


def make_heads(kind, model, trained_heads, seed=0):
    if kind == 'trained':
        return trained_heads
    torch.manual_seed(seed)
    heads = BlockHeads(model.config, K_MAX).double().eval()
    return randomise(heads, seed) if kind == 'randomised' else heads


# ----------------------------------------------------------------------------- sanity of fixtures

def test_plain_generate_matches_naive_full_recompute(model, prompts, greedy_ref):
    """The reference the other tests compare to: static-cache plain greedy == full recompute."""
    assert torch.equal(greedy_ref, naive_greedy(model, prompts, M + 2 * K_MAX))


@pytest.mark.parametrize('temperature', [0.0, 0.8])
def test_plain_decoding_calls_no_verifier(model, prompts, greedy_ref, temperature, monkeypatch):
    """Plain decoding has no drafts to verify: its step takes the target's own token
    (verification.target_choice), so it runs with every verifier broken (as in a handout where only the
    cache is written), greedy or sampled equal to GPT.generate's full recompute from the same
    generator."""
    def broken(*a, **kw):
        raise AssertionError("plain decoding called a verifier")
    for name in ('verify_greedy', 'verify_sampled', 'verify_tree_greedy', 'verify_tree_sampled'):
        monkeypatch.setattr(verification, name, broken)
    m = 12
    out, stats = generate(model, prompts, m, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert stats['calls'] == m and stats['accept_lengths'] == [1] * ((m - 1) * prompts.size(0))
    if temperature == 0.0:
        assert torch.equal(out, greedy_ref[:, :out.size(1)])
        return
    # GPT.generate draws the same way (one draw per row per token, from the tempered softmax)
    assert torch.equal(out, model.generate(prompts, m, temperature, generator=torch.Generator().manual_seed(0)))


def test_fixture_heads_span_acceptance_range(model, trained, prompts):
    """Trained heads accept long blocks, randomised ones mostly nothing: the exactness tests
    below therefore cover both full and partial acceptance."""
    _, st_tr = generate(model, prompts, M, drafter=trained[1], k=K_MAX)
    _, st_rnd = generate(model, prompts, M, drafter=make_heads('randomised', model, None), k=K_MAX)
    mean = lambda st: sum(st['accept_lengths']) / len(st['accept_lengths'])  # noqa: E731
    assert mean(st_tr) > 3.0, st_tr
    assert st_tr['calls'] < M // 2
    assert mean(st_rnd) < 2.0, st_rnd
    # trained heads also see partial blocks (the random-prompt row): both branches get exercised
    assert K_MAX in st_tr['accept_lengths'] and min(st_tr['accept_lengths']) < K_MAX


# ----------------------------------------------------------------------------- 1. exactness

@pytest.mark.parametrize('kind', ['untrained', 'randomised', 'trained'])
@pytest.mark.parametrize('k', range(2, K_MAX + 1))
def test_exact_mode_equals_plain_greedy(model, trained, prompts, greedy_ref, kind, k):
    heads = make_heads(kind, model, trained[1], seed=k)
    out, stats = generate(model, prompts, M, drafter=heads, k=k, accept='exact')
    assert out.shape == (prompts.size(0), T0 + M)
    assert torch.equal(out, greedy_ref[:, :T0 + M])
    taus = stats['accept_lengths']
    assert all(1 <= t <= k for t in taus)
    # every row's steps tile all but the last of its M new tokens (the last call's bonus, written
    # without a step): the last step may overshoot by at most k-1
    assert prompts.size(0) * (M - 1) <= sum(taus) <= prompts.size(0) * (M - 1 + k - 1)
    assert len(stats['accept_rate']) == k - 1
    # acceptance is prefix-closed: position j+1 is never accepted more often than position j
    rates = stats['accept_rate']
    assert all(a >= b - 1e-12 for a, b in zip(rates, rates[1:]))


@pytest.mark.parametrize('kind', ['randomised', 'trained'])
def test_exact_mode_at_full_context(model, trained, kind):
    """T0 + m == block_size: the last blocks' drafts overrun the position table (clamped)."""
    heads = make_heads(kind, model, trained[1], seed=3)
    g = torch.Generator().manual_seed(7)
    bs = model.config.block_size
    prompt = torch.randint(0, V, (2, 20), generator=g)
    out, stats = generate(model, prompt, bs - 20, drafter=heads, k=K_MAX)
    assert torch.equal(out, naive_greedy(model, prompt, bs - 20))


def test_dblast_greedy_equals_plain_greedy_whichever_branch_is_drawn(model, prompts, greedy_ref):
    """MATH.md §5: at T = 0 DBlast still draws its branch from pi' (its drafts change with the
    generator), and exact verification keeps plain greedy decoding's output, seed after seed."""
    torch.manual_seed(0)
    d = DBlastDrafter(model.config, 4, 4, sample_drafts=False).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # branches that differ from one another
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    h = torch.randn(6, model.config.n_embd, dtype=torch.float64, generator=g)
    bonus = torch.randint(V, (6,), generator=g)
    drafts = [d.draft(h, bonus, model, 4, 0.0, torch.Generator().manual_seed(s))[0] for s in (1, 2)]
    assert not torch.equal(*drafts)
    for seed in (1, 2):
        out, stats = generate(model, prompts, M, drafter=d, k=4, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(out, greedy_ref[:, :T0 + M])
        assert max(stats['accept_lengths']) > 1     # some drafts were accepted


# ----------------------------------------------------------------------------- 2. oracle drafter

@pytest.mark.parametrize('k,m', [(2, 12), (4, 24), (4, 27), (5, 23), (8, 32), (8, 35), (3, 1)])
def test_oracle_drafter_accepts_every_block(model, prompts, greedy_ref, k, m):
    oracle = Oracle(greedy_ref, T0, T0 + m, K_MAX)
    out, stats = generate(model, prompts, m, drafter=oracle, k=k)
    assert torch.equal(out, greedy_ref[:, :T0 + m])
    steps = math.ceil((m - 1) / k)              # the last token is the last call's bonus: no call of its own
    assert stats['calls'] == steps + 1 == math.ceil((m - 1) / k) + 1
    # where k does not divide m - 1 (4, 27) the last step accepts drafts past the end: tau counts them
    assert stats['accept_lengths'] == [k] * (steps * prompts.size(0))
    assert stats['accept_rate'] == [1.0] * (k - 1) * (steps > 0)
    assert stats['mean_tau'] == k or steps == 0
    assert stats['tokens'] == m * prompts.size(0) and stats['tokens_per_call'] == m * prompts.size(0) / (steps + 1)
    assert oracle.n_calls == steps + 1          # prefill + one merged propose per step


# ----------------------------------------------------------------------------- 3. lossy modes

def test_topk_full_vocabulary_accepts_every_draft(model, prompts):
    k, m = 5, 23
    heads = make_heads('randomised', model, None, seed=11)
    _, st_exact = generate(model, prompts, m, drafter=heads, k=k)
    assert min(st_exact['accept_lengths']) == 1     # the drafts really are (often) wrong
    out, stats = generate(model, prompts, m, drafter=heads, k=k, accept=f'topk:{V}')
    steps = math.ceil((m - 1) / k)
    assert stats['accept_lengths'] == [k] * (steps * prompts.size(0))
    assert stats['calls'] == steps + 1
    assert stats['accept_rate'] == [1.0] * (k - 1)
    for b in range(prompts.size(0)):
        replay(model, heads, out[b:b + 1], stats['accept_lengths'][b::prompts.size(0)], T0, k, 'topk', V)


@pytest.mark.parametrize('k,l', [(4, 2), (6, 3), (6, 6), (4, 4)])
def test_minblock_commits_at_least_l_tokens(model, prompts, k, l):
    m = 31
    heads = make_heads('randomised', model, None, seed=20 + l)
    for b in range(prompts.size(0)):
        row = prompts[b:b + 1]
        out, stats = generate(model, row, m, drafter=heads, k=k, accept=f'minblock:{l}')
        taus = stats['accept_lengths']
        left = m - 1                    # the last token is the last call's bonus, written without a step
        for tau in taus:
            if left >= l:
                assert tau >= min(l, k), (taus, l)
            left -= tau
        assert left <= 0 and left + taus[-1] > 0
        assert stats['calls'] == len(taus) + 1
        # everything that is not one of the first l-1 drafts of a step is exact greedy
        replay(model, heads, out, taus, T0, k, 'minblock', l)


@pytest.mark.parametrize('n', [1, 3])
def test_topk_small_commits_only_topk_tokens(model, prompts, n):
    """topk:1 is exact greedy; topk:3 commits only tokens in the target's top 3."""
    k, m = 6, 30
    heads = make_heads('randomised', model, None, seed=30 + n)
    row = prompts[2:3]
    out, stats = generate(model, row, m, drafter=heads, k=k, accept=f'topk:{n}')
    replay(model, heads, out, stats['accept_lengths'], T0, k, 'topk', n)
    if n == 1:
        ref, st_exact = generate(model, row, m, drafter=heads, k=k)
        assert torch.equal(out, ref)
        assert stats['accept_lengths'] == st_exact['accept_lengths']


@pytest.mark.parametrize('kind', ['randomised', 'trained'])
def test_exact_mode_replays_merged_step_rules(model, trained, prompts, kind):
    """Single row, exact mode: every step follows MATH.md §2, the merged step (propose from
    H_{n_acc})."""
    k = 6
    heads = make_heads(kind, model, trained[1], seed=41)
    for b in range(prompts.size(0)):
        out, stats = generate(model, prompts[b:b + 1], M, drafter=heads, k=k)
        replay(model, heads, out, stats['accept_lengths'], T0, k, 'exact', 0)


@pytest.mark.parametrize('drafter', [None, 'trained', 'randomised'])
def test_a_tiny_temperature_is_the_greedy_limit(model, trained, prompts, greedy_ref, drafter):
    """Sampling at T = 1e-320 is greedy decoding, not an overflow: logits / T would be +-inf and
    softmax NaN; shifted by their maximum first (model.tempered) they give the one-hot limit."""
    heads = None if drafter is None else make_heads(drafter, model, trained[1])
    for heads_sampled in (False, True) if heads is not None else (None,):
        if heads is not None:
            heads.sample_drafts = heads_sampled
        out, _ = generate(model, prompts, M, drafter=heads, temperature=1e-320,
                          generator=torch.Generator().manual_seed(0))
        assert torch.equal(out, greedy_ref[:, :T0 + M])


# ----------------------------------------------------------------------------- 4. bad arguments

@pytest.mark.parametrize('kw,match', [
    (dict(k=K_MAX + 1), r'k=9.*k <= 8'),
    (dict(k=1), r'k >= 2'),
    (dict(k=-3), r'k >= 2'),
    (dict(accept='topk:3', temperature=0.7), r'lossy'),
    (dict(accept='minblock:2', temperature=1.0), r'lossy'),
    (dict(accept='topk'), r"topk:N"),
    (dict(accept='topk:0'), r"N >= 1"),
    (dict(accept='topk:x'), r"accept="),
    (dict(accept='minblock:'), r"accept="),
    (dict(accept='exact:2'), r"accept="),
    (dict(accept='greedy'), r"accept="),
    (dict(temperature=-0.5), r'temperature'),
    (dict(max_new_tokens=0), r'max_new_tokens'),
    (dict(max_new_tokens=200), r'context'),
])
def test_bad_input_raises(model, trained, kw, match):
    kw = dict(kw)
    m = kw.pop('max_new_tokens', 8)
    prompt = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(BadInput, match=match):
        generate(model, prompt, m, drafter=trained[1], **kw)


def test_bad_input_k_zero_with_drafter(model, trained):
    with pytest.raises(BadInput, match=r'k >= 2'):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 8, drafter=trained[1], k=0)


def test_bad_input_topk_larger_than_vocab(model, trained):
    with pytest.raises(BadInput, match=r'topk'):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 8, drafter=trained[1], k=4,
                 accept=f'topk:{V + 1}')


# (what generate() is given, what the one line must say): every argument, as a Python caller gets
# it wrong. A 1-D prompt is refused, not taken as one row: the output's shape is (B, T) either way,
# and a guess would hide a batch flattened by mistake.
BAD_CALLS = [
    ('1-D prompt', dict(prompt=torch.tensor([3, 4, 5])),
     r"prompt has shape \(3,\); want \(B, T\).*prompt\[None\] is one row of 3"),
    ('3-D prompt', dict(prompt=torch.zeros(1, 2, 3, dtype=torch.long)), r"shape \(1, 2, 3\); want \(B, T\)"),
    ('list prompt', dict(prompt=[[3, 4, 5]]), r"prompt is list .*want a tensor of token ids \(B, T\)"),
    ('float prompt', dict(prompt=torch.tensor([[3.0, 4.0]])), r"prompt is a torch.float32 tensor; want integer"),
    ('bool prompt', dict(prompt=torch.tensor([[True]])), r"torch.bool tensor"),
    ('empty row', dict(prompt=torch.zeros(1, 0, dtype=torch.long)), r"prompt is empty \(shape \(1, 0\)\)"),
    ('no rows', dict(prompt=torch.zeros(0, 4, dtype=torch.long)), r"prompt is empty \(shape \(0, 4\)\)"),
    ('id past the vocabulary', dict(prompt=torch.tensor([[1, V]])), rf"token id {V}; .*ids 0..{V - 1}"),
    ('negative id', dict(prompt=torch.tensor([[-1, 2]])), r"token id -1"),
    ('max_new_tokens float', dict(max_new_tokens=2.5), r"max_new_tokens=2.5: want a whole number >= 1"),
    ('max_new_tokens bool', dict(max_new_tokens=True), r"max_new_tokens=True"),
    ('temperature text', dict(temperature='hot'), r"temperature='hot': want a number >= 0"),
    ('temperature nan', dict(temperature=float('nan')), r"temperature"),
    ('accept not text', dict(accept=3), r"accept=3: want a rule's name"),
    ('k without a drafter', dict(k=8), r"k=8 means nothing without a drafter"),
    ('k=1 without a drafter', dict(k=1), r"k=1 means nothing without a drafter"),
    ('accept without a drafter', dict(accept='topk:2'), r"accept='topk:2' means nothing without a drafter"),
    ('paths without a drafter', dict(paths=2), r"paths=2: several paths need a drafter \(drafter=...\)"),
    ('paths zero', dict(paths=0), r"paths=0: drafted paths per call"),
    ('paths text', dict(paths='4'), r"paths='4': drafted paths per call"),
    ('generator not one', dict(generator=0), r"generator is int 0; want a torch.Generator"),
    ('compile not a bool', dict(compile='yes'), r"compile='yes': want True or False"),
    ('threads zero', dict(threads=0), r"threads=0: want 'auto', None"),
    ('model not a GPT', dict(model='out/ckpt.pt'), r"model is str 'out/ckpt.pt'; want a model.GPT"),
    ('drafter not one', dict(drafter='heads'), r"drafter is str 'heads'; want a drafter"),
    ('paths one past the most', dict(drafter=BlockHeads(GPTConfig(**CFG), 4).double(), temperature=1.0, paths=65),
     r"paths=65: drafted paths per call"),
    ('prompt on another device', dict(prompt=torch.zeros(1, 4, dtype=torch.long, device='meta')), r"prompt .*meta"),
    ('drafter on another device', dict(drafter=BlockHeads(GPTConfig(**CFG), 4).to('meta')), r"drafter .*meta"),
]


@pytest.mark.parametrize('case', BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_every_bad_argument_is_one_line_naming_it(model, case):
    """generate() checks its arguments as generate.py checks its flags: each bad one is one
    BadInput naming the argument, what was given and what is allowed, before any work."""
    _, kw, match = case
    call = {**dict(model=model, prompt=torch.zeros(1, 4, dtype=torch.long), max_new_tokens=4), **kw}
    with pytest.raises(BadInput, match=match) as e:
        generate(call.pop('model'), call.pop('prompt'), call.pop('max_new_tokens'), **call)
    assert '\n' not in str(e.value)


def test_a_prompt_of_int32_ids_is_taken(model, greedy_ref, prompts):
    """Any integer dtype is token ids: an int32 prompt decodes as its int64 self."""
    out, _ = generate(model, prompts.int(), 6)
    assert out.dtype == torch.long and torch.equal(out, greedy_ref[:, :T0 + 6])


def test_flags_that_mean_nothing_with_a_drafter_are_refused(model, trained):
    """The drafter's own word (heads.Drafter.meaningless): several paths of argmax drafts are all the
    same path (BPD heads under greedy, or not sampled; a K = 1 drafter, i.i.d. or one per branch;
    Z_T = 0), refused; DBlast's argmax paths, which differ by branch, are not. A mixture told to
    verify against itself while it draws one path per branch is refused at any paths (MATH.md §9:
    they are not its samples)."""
    heads = trained[1]
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(BadInput, match=r"paths=4 means nothing here: drafted by argmax"):
        generate(model, prompt, 8, drafter=heads, paths=4)
    heads.sample_drafts = False
    try:
        with pytest.raises(BadInput, match=r"paths=2 means nothing here"):
            generate(model, prompt, 8, drafter=heads, temperature=1.0, paths=2)
    finally:
        heads.sample_drafts = True
    generate(model, prompt, 8, drafter=heads, temperature=1.0, paths=2)          # sampled: paths differ
    k1 = DBlastDrafter(model.config, 4, 1).double().eval()
    with pytest.raises(BadInput, match=r"paths=3 means nothing here: drafted by argmax from its one branch"):
        generate(model, prompt, 8, drafter=k1, paths=3)
    k1.paths_from, k1.verify = 'branches', 'branch'          # one path per branch, of one branch
    with pytest.raises(BadInput, match=r"paths=3 means nothing here: drafted by argmax from its one branch"):
        generate(model, prompt, 8, drafter=k1, paths=3)
    generate(model, prompt, 8, drafter=k1, temperature=1.0, paths=3)             # sampled: paths differ
    k4 = DBlastDrafter(model.config, 4, 4).double().eval()
    generate(model, prompt, 8, drafter=k4, paths=3)                              # greedy branches differ
    k4.zt = 0.0
    with pytest.raises(BadInput, match=r"the top branch alone \(Z_T = 0\)"):
        generate(model, prompt, 8, drafter=k4, paths=3)
    k4.zt, k4.paths_from = 1.0, 'branches'
    for paths in (1, 3):
        with pytest.raises(BadInput, match=r"verify='mixture' means nothing here: with paths_from='branches'"):
            generate(model, prompt, 8, drafter=k4, temperature=1.0, paths=paths)
    k4.verify = 'branch'
    generate(model, prompt, 8, drafter=k4, temperature=1.0, paths=3)
    generate(model, prompt, 8, drafter=k4, paths=3)                              # one per branch, greedy


def test_minblock_past_k_is_refused(model, trained):
    """minblock:N with N > k would take every draft and still fall short of N: refused; N = k takes
    every draft, as the rule says."""
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(BadInput, match=r"accept='minblock:5' at k=4: a step commits at most k = 4 tokens"):
        generate(model, prompt, 8, drafter=trained[1], k=4, accept='minblock:5')
    _, stats = generate(model, prompt, 9, drafter=trained[1], k=4, accept='minblock:4')
    assert stats['accept_lengths'] == [4, 4]


def test_threads_are_the_scripts_for_the_call_and_the_callers_after(model, prompts, monkeypatch):
    """threads='auto' decodes a small model on one thread and gives the caller back their own
    setting; None leaves it; a number is that many for the call."""
    seen = []
    real = decode.decode_loop
    monkeypatch.setattr(decode, 'decode_loop', lambda *a: seen.append(torch.get_num_threads()) or real(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for threads in ('auto', None, 3):
            generate(model, prompts, 2, threads=threads)
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2, 3]


# ----------------------------------------------------------------------------- 5. load_drafter

def heads_ckpt(heads, model_for_fp, config):
    return dict(kind='heads', drafter=heads.state_dict(), k=heads.k, d_hidden=heads.d_hidden,
                model_args=vars(config), base_fingerprint=model_for_fp.fingerprint())


def test_load_drafter_checks_fingerprint(model, trained, prompts, tmp_path):
    heads = trained[1]
    torch.manual_seed(123)
    other = GPT(GPTConfig(**CFG)).double()
    assert other.fingerprint() != model.fingerprint()
    path = str(tmp_path / 'heads_other.pt')
    save_checkpoint(heads_ckpt(heads, other, model.config), path)
    with pytest.raises(BadInput, match='fingerprint'):
        load_drafter(path, model)

    path = str(tmp_path / 'heads.pt')
    save_checkpoint(heads_ckpt(heads, model, model.config), path)
    loaded = load_drafter(path, model)
    assert isinstance(loaded, BlockHeads) and loaded.k == K_MAX
    assert loaded.c_fc.weight.dtype == torch.float64 and not loaded.training
    with torch.no_grad():
        h = model.hidden(prompts)[:, -1]
    bonus = model.lm_head(h).argmax(-1)
    for k in (2, 5, K_MAX):
        d0, q0 = heads.draft(h, bonus, model, k)
        d1, q1 = loaded.draft(h, bonus, model, k)
        assert q0 is None and q1 is None
        assert d0.shape == (prompts.size(0), k - 1)
        assert torch.equal(d0, d1)
    a, sa = generate(model, prompts, M, drafter=heads, k=6)
    b, sb = generate(model, prompts, M, drafter=loaded, k=6)
    assert torch.equal(a, b) and sa == sb


def test_load_drafter_rejects_non_drafter_and_missing(model, tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    save_checkpoint(dict(model=model.state_dict(), model_args=vars(model.config)), path)
    with pytest.raises(BadInput, match='not a drafter'):
        load_drafter(path, model)
    with pytest.raises(BadInput, match='not found'):
        load_drafter(str(tmp_path / 'nope.pt'), model)


# ----------------------------------------------------------------------------- 6. rows of a batch

def per_row_taus(taus, B, m):
    """Split stats['accept_lengths'] (step-major, active rows only) into each row's sequence: a row
    is active while it has committed fewer than m new tokens. Checks the list is consumed exactly."""
    rows, done, it = [[] for _ in range(B)], [0] * B, iter(taus)
    while any(d < m - 1 for d in done):   # the loop ends when every row lacks at most its last bonus
        for b in range(B):
            if done[b] < m:
                t = next(it)
                rows[b].append(t)
                done[b] += t
    assert next(it, None) is None, "accept_lengths has entries for finished rows"
    return rows


@pytest.mark.parametrize('kind', ['randomised', 'trained'])
def test_rows_advance_independently(model, trained, data, kind):
    heads = make_heads(kind, model, trained[1], seed=50)
    g = torch.Generator().manual_seed(4)
    stream = torch.from_numpy(data.astype(np.int64))
    prompts = torch.stack([stream[0:T0], torch.randint(0, V, (T0,), generator=g),
                           stream[77:77 + T0], torch.randint(0, V, (T0,), generator=g)])
    k, m = 5, 30
    out, stats = generate(model, prompts, m, drafter=heads, k=k)
    rows = per_row_taus(stats['accept_lengths'], 4, m)
    assert len({tuple(r) for r in rows}) > 1, "rows advanced in lockstep: the test proves nothing"
    assert stats['calls'] == 1 + max(len(r) for r in rows)
    for b in range(4):
        alone, st_alone = generate(model, prompts[b:b + 1], m)
        assert torch.equal(out[b:b + 1], alone), f"row {b}"
        # the row's own run with the same heads takes the same steps as inside the batch, where a row
        # that lacks only its last bonus takes one more while another row is behind
        _, st_b = generate(model, prompts[b:b + 1], m, drafter=heads, k=k)
        alone_taus = st_b['accept_lengths']
        assert rows[b][:len(alone_taus)] == alone_taus and len(rows[b]) - len(alone_taus) in (0, 1), f"row {b}"


def test_rows_advance_independently_mixed_oracle(model, prompts, greedy_ref):
    """Row 1 gets a wrong first draft every step (tau = 1), rows 0 and 2 the oracle (tau = k):
    they finish at very different steps and each still produces its own greedy output."""
    k, m = 4, 18
    oracle = Oracle(greedy_ref, T0, T0 + m, K_MAX, bad_rows=[1])
    out, stats = generate(model, prompts, m, drafter=oracle, k=k)
    assert torch.equal(out, greedy_ref[:, :T0 + m])
    fast = math.ceil((m - 1) / k)
    assert stats['calls'] == m                           # the slow row sets the pace: a call a token
    taus = stats['accept_lengths']
    # step-major, active rows only: [k, 1, k] for the first `fast` steps, then row 1 alone
    assert taus == [k, 1, k] * fast + [1] * (m - 1 - fast)
    rates = stats['accept_rate']
    assert rates[0] == pytest.approx(2 * fast / len(taus))


def test_merged_step_inactive_rows_do_not_advance(model, prompts):
    """merged_step: a row marked inactive keeps its cache length; active rows advance by tau."""
    heads = BlockHeads(model.config, 4).double()
    B = prompts.size(0)
    cache = model.new_cache(B, T0 + 16)
    h = model.forward_cached(prompts, cache)[:, -1]
    cache.commit(T0)
    bonus = model.lm_head(h).argmax(-1)
    drafts, _ = heads.draft(h, bonus, model, 4)
    block = torch.cat([bonus[:, None], drafts], 1)
    active = torch.tensor([True, False, True])
    text = Text(torch.full((B, T0 + 8), -1), torch.full((B,), T0))
    n_acc, nxt, q = merged_step(model, heads, cache, text, block, None, active)
    assert q is None and nxt.shape == (B, 4)
    assert torch.equal(text.tokens[:, T0:T0 + 4], block)   # one path: the block is written, n_acc + 1 of it committed
    want = torch.full((B,), T0) + (n_acc + 1) * active
    assert torch.equal(cache.lengths, want)


# ----------------------------------------------------------------------------- 7. the CLI
# Every case runs generate.py's main in this process (conftest.cli), through the run_script a real
# run goes through; tests/test_cli.py pins the exit code and stderr of a real `python generate.py`.

@pytest.fixture
def decode_cli():
    def run(ckpt, *extra):
        return Proc(*run_main('generate.py', ['--ckpt', ckpt, '--device', 'cpu', '--max-new-tokens', '4', *extra]))
    return run


@pytest.fixture(scope='module')
def good_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp('ckpts')
    m = tiny_model(seed=3, vocab_size=256, block_size=64, n_layer=1, n_embd=16,
                   dtype=torch.float32)
    path = d / 'good.pt'
    save_checkpoint(dict(model=m.state_dict(), model_args=vars(m.config)), str(path))
    return path


def test_decode_cli_works_on_a_good_checkpoint(good_ckpt, decode_cli):
    """The control for the error cases below: the same checkpoint and flags succeed."""
    proc = decode_cli(good_ckpt, '--prompt', 'def ', '--temperature', '0.5', '--seed', '1')
    assert proc.returncode == 0, proc.stderr
    assert 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stdout.startswith('def ')
    assert '4 calls' in proc.stdout                  # 4 tokens, the prefill's bonus the first


def test_decode_missing_checkpoint(tmp_path, decode_cli):
    proc = decode_cli(tmp_path / 'nope.pt', '--prompt', 'x')
    assert proc.returncode == 2
    assert_clean_error(proc, 'not found')


def test_decode_corrupt_checkpoint(tmp_path, decode_cli):
    bad = tmp_path / 'garbage.pt'
    bad.write_bytes(os.urandom(2000))
    assert_clean_error(decode_cli(bad, '--prompt', 'x'), str(bad))


def test_decode_truncated_checkpoint(tmp_path, good_ckpt, decode_cli):
    bad = tmp_path / 'truncated.pt'
    data = good_ckpt.read_bytes()
    bad.write_bytes(data[:len(data) // 2])
    assert_clean_error(decode_cli(bad, '--prompt', 'x'), 'unreadable')


def test_decode_config_does_not_fit_weights(tmp_path, good_ckpt, decode_cli):
    ck = torch.load(good_ckpt, weights_only=False)
    ck['model_args'] = dict(ck['model_args'], n_embd=32)
    bad = tmp_path / 'mismatch.pt'
    torch.save(ck, bad)
    assert_clean_error(decode_cli(bad, '--prompt', 'x'), 'do not fit')


@pytest.mark.parametrize('extra, needles', [
    (['--prompt', ''], ['empty']),
    (['--prompt', 'def f(x):', '--max-new-tokens', '60'], ['64']),   # 9 + 60 > block_size 64
    (['--prompt', 'x', '--temperature=-0.5'], ['temperature']),
], ids=['empty-prompt', 'beyond-context', 'negative-temperature'])
def test_decode_bad_arguments(good_ckpt, decode_cli, extra, needles):
    proc = decode_cli(good_ckpt, *extra)
    assert proc.returncode == 2
    assert_clean_error(proc, *needles)


# ----------------------------------------------------------------------------- 8. the README's example

def test_the_readme_python_example_runs_as_pasted(tmp_path, corpus_file, capsys):
    """After `python train.py` (here at tiny sizes, into tmp_path/out), the README's Python block
    runs top to bottom from that folder: it loads the target and both drafters, encodes a prompt
    with the checkpoint's vocabulary, generates and decodes the text."""
    readme = open(os.path.join(ROOT, 'README.md')).read()
    code = readme.split('this block runs as pasted', 1)[1].split('```python\n', 1)[1].split('```', 1)[0]
    tiny = ['--device', 'cpu', '--data', corpus_file, '--n-layer', '1', '--n-head', '2', '--n-embd', '16',
            '--block-size', '160', '--max-iters', '10', '--batch-size', '4', '--eval-iters', '1', '--warmup-iters', '2',
            '--heads-iters', '4', '--distill-samples', '4', '--dblast-iters', '4', '--dblast-samples', '4',
            '--dblast-eval-samples', '2', '--no-demo']
    exit_code, _, err = run_main('train.py', tiny, cwd=tmp_path)
    assert exit_code == 0, err[-2000:]
    home = os.getcwd()
    os.chdir(tmp_path)
    try:
        capsys.readouterr()
        exec(compile(code, 'README.md', 'exec'), {'__name__': '__main__'})
    finally:
        os.chdir(home)
    printed = capsys.readouterr().out
    assert printed.startswith('def ') and ' calls; tau per step: [' in printed


# --------------------------------------------------------------------------- precision

def test_pick_dtype_auto_is_bf16_only_for_training_on_a_cuda_device_that_has_it(monkeypatch):
    assert pick_dtype('auto', 'cpu') == pick_dtype('auto', 'cpu', training=True) == 'float32'
    assert pick_dtype('bfloat16', 'cpu') == 'bfloat16'                    # CPU autocast
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: True)
    assert pick_dtype('auto', 'cuda:0', training=True) == 'bfloat16'
    assert pick_dtype('auto', 'cuda:0') == 'float32'                      # decoding: float32 unless asked
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: False)   # e.g. a V100
    assert pick_dtype('auto', 'cuda', training=True) == 'float32'
    for device in ('cuda', 'mps'):
        with pytest.raises(BadInput, match=r'--dtype bfloat16: not supported on'):
            pick_dtype('bfloat16', device)


def test_precision_sets_autocast_and_tf32_and_restores_them():
    before = torch.get_float32_matmul_precision()
    with Precision('float32', 'cuda', tf32=True):          # the flags are global: no GPU needed
        assert torch.get_float32_matmul_precision() == 'high'
        with Precision('float32', 'cuda'):                 # decoding inside a training step's TF32
            assert torch.get_float32_matmul_precision() == 'highest'
        assert torch.get_float32_matmul_precision() == 'high'
    assert torch.get_float32_matmul_precision() == before
    with Precision('float32', 'cpu', tf32=True):           # CPU kernels are left alone
        assert torch.get_float32_matmul_precision() == before
    p = Precision('bfloat16', 'cpu')
    for _ in range(2):                                     # re-entrant
        with p:
            assert torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.bfloat16
        assert not torch.is_autocast_enabled('cpu')
    assert str(p) == 'bfloat16 autocast' and str(Precision('float32', 'cuda', True)) == 'float32 + TF32'


def test_kv_cache_is_in_the_compute_dtype_under_autocast():
    """Under bf16 autocast the keys and values are bf16: a float32 cache would convert every layer's
    whole buffers at every step. Decoding runs, writes bf16 and commits what a float32 run commits."""
    model = tiny_model(seed=3, std=0.3, dtype=torch.float32)
    heads = randomise(BlockHeads(model.config, 4), 1, std=0.05).float().eval()
    prompt = torch.randint(64, (2, 6), generator=torch.Generator().manual_seed(0))
    assert model.new_cache(2, 16).k.dtype == torch.float32
    with Precision('bfloat16', 'cpu'):
        cache = model.new_cache(2, 16)
        assert cache.k.dtype == cache.v.dtype == torch.bfloat16
        assert static_cache(model, 2, 4).k.dtype == torch.bfloat16
        out, stats = generate(model, prompt, 20, drafter=heads, k=4)
    assert static_cache(model, 2, 4).k.dtype == torch.float32              # one cache per compute dtype
    # the same tokens as float32 decoding (this seed has no near-tie that bf16 rounds the other way):
    # a bf16 cache that lost what was written in it does not
    assert torch.equal(out, generate(model, prompt, 20, drafter=heads, k=4)[0])
    assert max(stats['accept_lengths']) > 1


def test_decode_cli_runs_a_draft_model_prompt_lookup_and_both(good_ckpt, decode_cli, tmp_path):
    """generate.py --draft-model (any target checkpoint of the vocabulary: here the target itself)
    and --lookup, alone, together (one path each) and each growing a tree (--nodes): exact greedy
    decoding. A draft model of another vocabulary is one line naming it."""
    for extra in (['--draft-model', str(good_ckpt)], ['--lookup', '2'], ['--draft-model', str(good_ckpt), '--lookup', '1'],
                  ['--draft-model', str(good_ckpt), '--nodes', '6'], ['--lookup', '2', '--nodes', '6']):
        proc = decode_cli(good_ckpt, '--prompt', 'def ', '--k', '3', *extra)
        assert proc.returncode == 0, proc.stderr
        assert 'same as plain greedy decoding: 4/4 tokens' in proc.stdout, proc.stdout
    other = tiny_model(seed=4, vocab_size=128, block_size=64, n_layer=1, n_embd=16, dtype=torch.float32)
    save_checkpoint(dict(model=other.state_dict(), model_args=vars(other.config)), str(tmp_path / 'other.pt'))
    proc = decode_cli(good_ckpt, '--draft-model', str(tmp_path / 'other.pt'))
    assert proc.returncode == 2 and proc.stderr.count('\n') == 1, proc.stderr
    assert "vocabulary has 128 ids, the target's 256" in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------- what docstrings say, pinned

def test_greedy_bpd_leaves_the_generator_unused():
    """decode.generate: 'where nothing is drawn, as in greedy decoding with BPD heads, [the generator]
    is not used' (eager; compile=True draws one seed from it: runner.global_rng_from)."""
    model = tiny_model(dtype=torch.float32)
    heads = BlockHeads(model.config, 4).eval()
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    generate(model, torch.randint(64, (2, 5), generator=torch.Generator().manual_seed(1)), 12,
             drafter=heads, k=4, generator=g)
    assert torch.equal(g.get_state(), before)
