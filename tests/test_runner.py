"""The runner (runner.py): generate(compile=True) runs the loop's steps in units of several steps a
host call, on static buffers, and gives what the eager loop gives.

On the CPU the units run as Python here (runner.compiled replaced by a counter: no tracing, no
compile), so that every configuration is checked in milliseconds: test_compiled.py traces and
compiles the same steps. On CUDA (skipped without a GPU) the hand-captured CUDA graphs are
replayed and counted, and their sampling is checked for losslessness."""
import pytest
import torch

import decode
import runner
import verification
from conftest import V8, V8_PROMPT, peaky, tiny_model
from dblast import DBlastDrafter
from drafters import DraftModel, MixedPaths, PromptLookup
from decode import generate
from heads import BlockHeads
from model import GPT, GPTConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CFG = GPTConfig(block_size=96, vocab_size=64, n_layer=2, n_head=2, n_embd=32)


def target(device='cpu', dtype=torch.float64):
    return peaky(GPT(CFG), 0.3, 0).to(device, dtype).eval()


def drafter_of(kind, device='cpu', dtype=torch.float64):
    """'heads' (argmax drafts) | 'heads-sampled' | 'dblast' (K = 4, sampled, mixture) | 'dblast-branches'."""
    if kind is None:
        return None
    if kind == 'draft-model':        # a draft model of one layer, with its own KV cache
        return DraftModel(peaky(GPT(GPTConfig(block_size=96, vocab_size=64, n_layer=1, n_head=2, n_embd=16)), 0.3, 2),
                          k=4).to(device, dtype).eval()
    if kind == 'lookup':
        return PromptLookup(2, 4)
    if kind == 'heads+lookup':
        return MixedPaths([drafter_of('heads-sampled', device, dtype), PromptLookup(1, 4)])
    if kind.startswith('heads'):
        d = peaky(BlockHeads(CFG, 4, sample_drafts=kind == 'heads-sampled'), 0.2, 1)
    else:
        d = peaky(DBlastDrafter(CFG, 4, 4, verify='branch' if kind == 'dblast-branches' else 'mixture',
                                paths_from='branches' if kind == 'dblast-branches' else 'iid'), 0.2, 1)
    return d.to(device, dtype).eval()


# (drafter, temperature, accept, paths, nodes): plain decoding, every greedy rule, sampled and
# argmax drafts, the mixture, several paths of each kind, the drafters that read the text (a draft
# model, prompt lookup, a mix), token trees greedy and sampled
CONFIGS = [(None, 0.0, 'exact', 1), (None, 1.0, 'exact', 1), ('heads', 0.0, 'exact', 1), ('heads', 0.0, 'topk:3', 1),
           ('heads', 0.0, 'minblock:2', 1), ('heads', 1.0, 'exact', 1), ('heads-sampled', 1.0, 'exact', 1),
           ('dblast', 0.0, 'exact', 1), ('dblast', 1.5, 'exact', 1), ('dblast', 0.0, 'topk:2', 3),
           ('heads-sampled', 1.0, 'exact', 2), ('dblast', 1.5, 'exact', 4), ('dblast-branches', 1.0, 'exact', 4),
           ('draft-model', 0.0, 'exact', 1), ('draft-model', 1.5, 'exact', 2), ('lookup', 0.0, 'exact', 1),
           ('heads+lookup', 1.0, 'exact', 2)]
CONFIGS = [c + (None,) for c in CONFIGS] + [('heads', 0.0, 'exact', 1, 12), ('dblast', 1.5, 'exact', 1, 20),
                                            ('lookup', 0.0, 'exact', 1, 12), ('draft-model', 1.5, 'exact', 1, 12)]


@pytest.fixture
def counted(monkeypatch):
    """runner.compiled replaced by a counter (the unit runs as Python), decode.advance and
    decode.tokens_behind counted: -> dict of lists: 'units' (each call of a compiled unit), 'steps',
    'behind' (each read of the device)."""
    seen = dict(units=[], steps=[], behind=[])

    def fake_compiled(fn, *how, **options):
        def unit(*a):
            seen['units'].append(fn)
            return fn(*a)
        return unit
    real_advance, real_behind = decode.advance, decode.tokens_behind
    monkeypatch.setattr(runner, 'compiled', fake_compiled)
    monkeypatch.setattr(decode, 'advance', lambda *a: seen['steps'].append(1) or real_advance(*a))
    monkeypatch.setattr(decode, 'tokens_behind',
                        lambda *a: seen['behind'].append(real_behind(*a)) or seen['behind'][-1])
    return seen


def test_units_are_powers_of_two_largest_first():
    assert runner.units(13, 8) == [8, 4, 1] and runner.units(0, 16) == [] and runner.units(40, 16) == [16, 16, 8]
    for n in range(70):
        sizes = runner.units(n, 16)
        assert sum(sizes) == n and sizes == sorted(sizes, reverse=True) and all(s in (1, 2, 4, 8, 16) for s in sizes)


@pytest.mark.parametrize('kind,temperature,accept,paths,nodes', CONFIGS)
def test_every_configuration_runs_in_units_of_steps(kind, temperature, accept, paths, nodes, counted):
    """The host launches a unit of UNIT steps, never a lone step: for each read of the device, the
    ceil(ceil(behind / k) / UNIT) units that cover the steps needed whatever they accept, and
    nothing else. The tokens, calls and taus of the eager loop, although the last unit runs past
    the last step any row needed (batch of 3 rows, each accepting its own number); sampling, from
    the same global seed (both draw from the global RNG without a generator), the same draws."""
    model, drafter = target(), drafter_of(kind)
    prompt = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(1))
    k = 1 if drafter is None else 4
    kw = dict(drafter=drafter, k=None if drafter is None else 4, temperature=temperature, accept=accept, paths=paths,
              nodes=nodes)
    torch.manual_seed(0)
    out, stats = generate(model, prompt, 29, compile=True, **kw)
    unit = runner.unit_for('cpu', drafter is None)
    want = sum(-(-(-(-b // k)) // unit) for b in counted['behind'] if b > 0)
    assert len(counted['units']) == want > 0 and len(counted['steps']) == unit * want
    assert stats['calls'] - 1 <= len(counted['steps']) < stats['calls'] - 1 + unit
    torch.manual_seed(0)
    eager, eager_stats = generate(model, prompt, 29, **kw)
    assert torch.equal(out, eager)
    assert (stats['calls'], stats['accept_lengths']) == (eager_stats['calls'], eager_stats['accept_lengths'])


def test_buffers_are_reused_and_hold_nothing_of_the_last_call(counted):
    """One configuration keeps one set of buffers on the model: a second call with other prompts and
    another length reuses them, and gives what a fresh eager loop gives."""
    model, heads = target(), drafter_of('heads')
    g = torch.Generator().manual_seed(3)
    for T0, m in ((6, 40), (9, 11), (6, 40)):
        prompt = torch.randint(64, (2, T0), generator=g)
        out, stats = generate(model, prompt, m, drafter=heads, k=4, compile=True)
        eager, eager_stats = generate(model, prompt, m, drafter=heads, k=4)
        assert torch.equal(out, eager) and stats == eager_stats
    assert len(model._static_loops) == 1


def test_a_model_moved_or_drafter_changed_records_anew(counted):
    """Graphs replay the addresses and kernels they recorded: a model moved to another dtype (new
    weights), a drafter given another setting, decoding under autocast (another cache) or with TF32
    matmuls (cli.Precision's tf32: other kernels) is a configuration of its own, not the old one's."""
    model, dblast = target(dtype=torch.float32), drafter_of('dblast', dtype=torch.float32)
    prompt = torch.randint(64, (2, 6), generator=torch.Generator().manual_seed(4))
    generate(model, prompt, 20, drafter=dblast, k=4, compile=True)
    model.double()
    dblast.double()
    out, _ = generate(model, prompt, 20, drafter=dblast, k=4, compile=True)
    assert torch.equal(out, generate(model, prompt, 20, drafter=dblast, k=4)[0])
    generate(model, prompt, 20, drafter=dblast, k=4, temperature=1.0, compile=True)
    dblast.zt = 0.0                                        # a setting of the drafter alone, at the same T
    generate(model, prompt, 20, drafter=dblast, k=4, temperature=1.0, compile=True)
    assert len(model._static_loops) == 4
    with torch.autocast('cpu', dtype=torch.bfloat16):   # another compute dtype: another cache, its own loop
        generate(model, prompt, 20, drafter=dblast, k=4, temperature=1.0, compile=True)
    assert len(model._static_loops) == 5
    mixed = MixedPaths([dblast, PromptLookup(2, 4)])       # a setting of a drafter inside another
    generate(model, prompt, 20, drafter=mixed, k=4, temperature=1.0, paths=2, compile=True)
    dblast.zt = 1.0
    generate(model, prompt, 20, drafter=mixed, k=4, temperature=1.0, paths=2, compile=True)
    assert len(model._static_loops) == 7
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision('high' if before == 'highest' else 'highest')
        generate(model, prompt, 20, drafter=mixed, k=4, temperature=1.0, paths=2, compile=True)
    finally:
        torch.set_float32_matmul_precision(before)
    assert len(model._static_loops) == 8


def test_the_state_a_graph_mutates_has_static_addresses(counted):
    """torch.compile's CUDA graphs ('reduce-overhead') silently skip a graph whose mutated inputs
    are not static: every buffer of the loop's state and cache is marked static."""
    model, heads = target(), drafter_of('heads-sampled')
    generate(model, torch.zeros(1, 4, dtype=torch.long), 8, drafter=heads, k=4, temperature=1.0, compile=True)
    (kept,) = model._static_loops.values()
    cache = next(iter(model._static_caches.values()))
    tensors = [t for t in kept['state'] if t is not None] + [cache.k, cache.v, cache.lengths]
    assert all(getattr(t, '_dynamo_static_input_type', None) is not None for t in tensors)


@pytest.mark.parametrize('nodes', [None, 6])
def test_a_step_no_row_needs_commits_nothing(nodes):
    """advance with every row done: the cache lengths, the committed output, n_out, taus and each
    row's pending block (and token tree) stay as they were; only the step count moves (a unit may
    run past the last needed step)."""
    model, heads = target(), drafter_of('heads')
    prompt = torch.randint(64, (2, 5), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(2, 40)
    block, Q, tree = decode.first_block(model, heads, cache, prompt, 0.0, None, 1, 4, nodes)
    d = decode.Decoding.like(block, Q, tree, 30, 20)
    d.restart(block, Q, tree, prompt)
    d.total.fill_(6)                     # each row lacks only its pending bonus: no step is needed
    kept = lambda: (d.block, d.out[:, :5], d.n_out, d.taus, cache.lengths) + ((d.tree,) if nodes else ())  # noqa: E731
    before = [t.clone() for t in kept()]
    decode.advance(model, heads, cache, d, 0.0, (verification.exact, None), None, 1, 4, nodes)
    assert all(torch.equal(a, b) for a, b in zip(before, kept()))
    assert int(d.t) == 1


# ----------------------------------------------------------------------------- CUDA: graphs captured by hand

@cuda
@pytest.mark.parametrize('mode', ['captured', 'captured-eager'])
@pytest.mark.parametrize('kind,temperature,accept,paths,nodes', [c for c in CONFIGS if c[1] == 0.0])
def test_cuda_graphs_replay_exactly_the_steps_needed(kind, temperature, accept, paths, nodes, mode, monkeypatch):
    """On CUDA a read of the device is followed by one replay per unit of units(ceil(behind / k)),
    and the prefill by one: the greedy tokens are the eager loop's."""
    monkeypatch.setattr(runner, 'CUDA_MODE', mode)
    replays, real = [], torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, 'replay', lambda self: replays.append(1) or real(self))
    behind, real_behind = [], decode.tokens_behind
    monkeypatch.setattr(decode, 'tokens_behind', lambda *a: behind.append(real_behind(*a)) or behind[-1])
    model, drafter = target('cuda'), drafter_of(kind, 'cuda')
    prompt = torch.randint(64, (3, 5), device='cuda', generator=torch.Generator('cuda').manual_seed(1))
    k = 1 if drafter is None else 4
    kw = dict(drafter=drafter, k=None if drafter is None else 4, accept=accept, paths=paths, nodes=nodes)
    for _ in range(2):   # the first call captures
        replays.clear(), behind.clear()
        out, stats = generate(model, prompt, 29, compile=True, **kw)
    want = 1 + sum(len(runner.units(-(-b // k), runner.UNIT['cuda'])) for b in behind if b > 0)
    assert len(replays) == want
    eager, eager_stats = generate(model, prompt, 29, **kw)
    assert torch.equal(out, eager) and stats['accept_lengths'] == eager_stats['accept_lengths']


@cuda
@pytest.mark.parametrize('mode', ['captured', 'captured-eager'])
def test_cuda_graph_sampling_is_lossless(mode, monkeypatch):
    """Random draws inside a replayed graph are new at every replay and follow the seed: the
    3-token continuations of DBlast speculative sampling through the captured loop follow the
    target's exact distribution (test_sampling's chi-square), and a seed reproduces its tokens."""
    from test_sampling import chi_square, continuation_probs, make_drafter
    monkeypatch.setattr(runner, 'CUDA_MODE', mode)
    model = peaky(GPT(V8), 0.3, 0).float().cuda()
    drafter = make_drafter('K4-sampled-mixture-zt1').cuda()
    n = 20000

    def counts(seed):
        g = torch.Generator('cuda').manual_seed(seed)
        out, _ = generate(model, V8_PROMPT.cuda().expand(n, -1), 3, drafter=drafter, k=4, temperature=1.5,
                          generator=g, compile=True)
        codes = (out[:, V8_PROMPT.size(1):].cpu() * torch.tensor([64, 8, 1])).sum(-1)
        return torch.bincount(codes, minlength=512).double()
    first = counts(0)
    stat, crit = chi_square(first, continuation_probs(1.5), n)
    assert stat < crit, f"captured sampling ({mode}): chi2 {stat:.1f} >= {crit:.1f}"
    assert torch.equal(counts(0), first) and not torch.equal(counts(1), first)


# ----------------------------------------------------------------------------- what docstrings say, pinned

def test_static_cache_is_shared_by_plain_decoding_and_one_path_blocks_up_to_k32():
    """runner.static_cache: block_size + room rounded up to a multiple of 64, so for a context that
    is a multiple of 64 plain decoding (room 2) and every one-path block up to k = 32 (room 2k, as
    decode_loop computes it) get the same buffers; k = 33 gets others."""
    model = tiny_model(block_size=64, dtype=torch.float32)
    room = lambda k: k + 1 + (k - 1)                                     # noqa: E731  decode_loop's, paths=1
    plain = runner.static_cache(model, 1, 2)
    assert all(runner.static_cache(model, 1, room(k)) is plain for k in range(2, 33))
    assert runner.static_cache(model, 1, room(33)) is not plain
