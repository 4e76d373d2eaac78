"""Exercise 7's checks: a drafter of your own behind the drafter contract (README.md). They are the
contract's conformance checks: any drafter, the project's own included, should pass them."""
import os
import types
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

import decode
import train
from dblast import anchors
from exercises import harness
from heads import Drafter
from model import GPT, GPTConfig

NAMES = ('MyDrafter',)


def make(impl, config, k=4, seed=0, std=None):
    """A MyDrafter in float64, its weights redrawn at `std` when given (varied, confident drafts)."""
    torch.manual_seed(seed)
    d = impl.MyDrafter(config, k)
    return harness.peaky(d, std, seed) if std else d.double().eval()


def test_the_contract(impl):
    """The contract. drafts (N, k-1) long tokens for every k up to drafter.k; under sampling Q is
    (N, k-1, V), non-negative, sums to 1 and gives the drafts mass; the generator decides the
    draws; argmax drafting (sample_drafts False) is deterministic, with Q None or one-hot.
    Hint: heads.BlockHeads.draft is a complete example of the contract."""
    model = harness.tiny_target()
    d = make(impl, model.config, 4, std=0.3)
    assert isinstance(d, Drafter) and d.k == 4, "MyDrafter should be a heads.Drafter with .k = 4"
    N, V = 50, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    h, bonus = torch.randn(N, model.config.n_embd, generator=g, dtype=torch.float64), torch.randint(V, (N,), generator=g)
    for k in (2, 4):
        drafts, _ = d.draft(h, bonus, model, k, 0.0, g)
        assert drafts.shape == (N, k - 1) and drafts.dtype == torch.long, \
            f"k={k}: drafts should be (N, k-1) = {(N, k - 1)} long, got {tuple(drafts.shape)} {drafts.dtype}"
        assert ((drafts >= 0) & (drafts < V)).all(), "drafts must be tokens 0..V-1"
    d.sample_drafts = True
    drafts, Q = d.draft(h, bonus, model, 4, 1.2, torch.Generator().manual_seed(1))
    assert Q is not None and Q.shape == (N, 3, V), f"under sampling Q should be (N, k-1, V) = {(N, 3, V)}"
    assert (Q >= 0).all() and torch.allclose(Q.sum(-1).double(), torch.ones(N, 3, dtype=torch.float64)), \
        "each row of Q should be a distribution (non-negative, summing to 1)"
    assert (Q.gather(-1, drafts.unsqueeze(-1)) > 0).all(), "a draft has no mass under Q: it was not drawn from Q"
    again, _ = d.draft(h, bonus, model, 4, 1.2, torch.Generator().manual_seed(1))
    assert torch.equal(drafts, again), "the same generator seed gave other drafts: draw from `generator`"
    d.sample_drafts = False
    a1, Q1 = d.draft(h, bonus, model, 4, 1.2, torch.Generator().manual_seed(1))
    a2, _ = d.draft(h, bonus, model, 4, 1.2, torch.Generator().manual_seed(2))
    assert torch.equal(a1, a2), "argmax drafting (sample_drafts False) should not depend on the draws"
    assert Q1 is None or torch.equal(Q1, F.one_hot(a1, V).to(Q1.dtype)), "argmax drafts: Q should be None or one-hot"


def test_no_host_sync(impl):
    """No host sync in draft. Hint: model.sample draws by inverse CDF without a sync;
    torch.multinomial may sync on a GPU."""
    model = harness.tiny_target()
    d = make(impl, model.config, 4, std=0.3)
    h, bonus = torch.randn(8, model.config.n_embd, dtype=torch.float64), torch.randint(32, (8,))
    with harness.HostSyncs() as syncs:
        d.draft(h, bonus, model, 4, 1.0, torch.Generator().manual_seed(0))
        d.draft(h, bonus, model, 4, 0.0, None)
    assert not syncs.seen, f"host syncs: {', '.join(sorted(set(syncs.seen)))}"


def test_greedy_output_is_plain_greedy(impl):
    """Greedy output is plain greedy's. Decoding with your (untrained) drafter at k = 2..4 gives
    plain greedy decoding's tokens (float64)."""
    model = harness.tiny_target()
    prompts = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(3))
    ref = harness.plain_greedy(model, prompts, 30)
    for k in (2, 4):
        out, _ = decode.generate(model, prompts, 30, drafter=make(impl, model.config, 4, std=0.3), k=k)
        assert torch.equal(out, ref), f"k={k}: the output differs from plain greedy decoding"


def test_sampling_is_lossless(impl):
    """Sampling is lossless. With sampled drafts (T = 1.3) and argmax drafts (T = 0.8), every
    3-token continuation of the 8-token world comes out with the target's probability
    (chi-square, 20,000 samples). Hint: Q must be exactly what the drafts were drawn from, at the
    same temperature: softmax(logits / T), not softmax(logits)."""
    model = harness.target8()
    for sample_drafts, T in ((True, 1.3), (False, 0.8)):
        d = make(impl, model.config, 4, seed=1, std=0.3)
        d.sample_drafts = sample_drafts
        harness.assert_lossless(model, d, T, what=f"{'sampled' if sample_drafts else 'argmax'} drafts, T={T}: ")


class Uniform(Drafter):
    """The baseline to beat: drafts drawn uniformly, Q uniform."""

    def __init__(self, V, k):
        super().__init__()
        self.V, self.k = V, k

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        Q = torch.full((h.size(0), k - 1, self.V), 1.0 / self.V, dtype=h.dtype)
        return decode.sample(Q, generator), Q


@lru_cache
def periodic_world():
    """A target trained on a periodic stream (period 23 over 32 tokens, 150 steps) and 64 of its
    samples at T = 1: a target with a lot a drafter can learn."""
    period = np.random.default_rng(0).integers(0, 32, size=23)
    stream = np.tile(period, 300).astype(np.uint8)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=32, n_layer=2, n_head=2, n_embd=32))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.from_numpy(stream.astype(np.int64))
    for _ in range(150):
        ix = torch.randint(len(data) - 65, (16,), generator=g)
        x = torch.stack([data[i:i + 65] for i in ix.tolist()])
        loss = model(x[:, :-1], x[:, 1:])[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    rt = types.SimpleNamespace(device='cpu', kind='cpu', master=False)   # no progress bar
    return model, train.dblast_data(rt, model, stream, 64, 1.0, 1, 'samples'), stream


def test_training_beats_a_uniform_drafter(impl):
    """Training beats a uniform drafter. Trained by its loss for 200 steps on 64 samples of a
    target that learnt a periodic stream, your drafter's decoded tau at T = 1 (k = 4) is well
    above a uniform drafter's. Hint: if the loss goes down but tau does not rise, check that the
    loss trains what draft proposes: the same positions (x[:, i] is the token i+1 after the
    bonus) and the same temperature."""
    model, samples, stream = periodic_world()
    torch.manual_seed(0)
    d = impl.MyDrafter(model.config, 4)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    lo, hi = samples.positions(4)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        rows, pos = torch.randint(len(samples.seqs), (64,), generator=g), torch.randint(lo, hi, (64,), generator=g)
        h, bonus, x, _ = anchors(samples, 4, rows, pos)
        loss = d.loss(h, bonus, model, x, 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    d.eval()
    prompts = torch.from_numpy(np.stack([stream[i:i + 16] for i in range(0, 160, 10)]).astype(np.int64))
    taus = {}
    for name, drafter in (('yours', d), ('uniform', Uniform(32, 4))):
        _, stats = decode.generate(model, prompts, 40, drafter=drafter, k=4, temperature=1.0,
                                   generator=torch.Generator().manual_seed(2))
        taus[name] = sum(stats['accept_lengths']) / len(stats['accept_lengths'])
    assert taus['yours'] > taus['uniform'] + 1.0, \
        f"trained, your drafter's tau is {taus['yours']:.2f}, a uniform drafter's {taus['uniform']:.2f}"


def try_it(impl, tryout):
    """Your drafter trained on train.py's target samples at T = 1.5 (the ones its dblast stage made
    and cached in out/data), then decoded at T = 1.5 and greedily, next to the independent K = 1
    drafter train.py trained on the same samples."""
    T, k, steps = 1.5, 4, 1000
    rt = types.SimpleNamespace(device=tryout.args.device, kind=tryout.args.device, master=True)
    samples = train.dblast_data(rt, tryout.model, tryout.train, 1024, T, 1337 + 1, 'target samples at T=1.5',
                                os.path.join(tryout.args.out_dir, 'data'))
    torch.manual_seed(0)
    d = impl.MyDrafter(tryout.model.config, k).to(tryout.args.device)
    opt = torch.optim.Adam(d.parameters(), lr=3e-3)
    lo, hi = samples.positions(k)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        rows, pos = torch.randint(len(samples.seqs), (128,), generator=g), torch.randint(lo, hi, (128,), generator=g)
        h, bonus, x, _ = anchors(samples, k, rows.to(samples.seqs.device), pos.to(samples.seqs.device))
        loss = d.loss(h, bonus, tryout.model, x, T)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"training your drafter: step {step + 1}/{steps}, loss {loss.item():.3f}")
    d.eval()
    baseline = tryout.drafter('dblast_K1.pt')
    rows = [tryout.row('independent K=1 (train.py)', False, T, drafter=baseline, k=k),
            tryout.row('yours', False, T, drafter=d, k=k),
            tryout.row('independent K=1 (train.py)', False, 0.0, drafter=baseline, k=k),
            tryout.row('yours', False, 0.0, drafter=d, k=k)]
    tryout.table(rows)
