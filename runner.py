"""
The runner: what generate(compile=True) adds so that the host does not hold the device back.
decode.py's loop is the algorithm and reads the same either way; this file is machinery.

A decoding step of this project's targets is a few dozen kernels. On a GPU each runs for a few
microseconds, and launching it from Python costs more, so a step run op by op leaves the GPU idle
most of the time (gpu_check.py's part j measures it). Three things take the host out of the step:

  static buffers      the KV cache and the loop's state (decode.Decoding) are allocated once per
                      shape and kept on the model, so every step reads and writes the same
                      addresses and a graph recorded once stays valid
  a compiled step     torch.compile (inductor) makes the step one graph of fused kernels
  several steps a     the loop knows how many steps it needs whatever they accept (decode_loop),
  host call           so it runs them in units: on CUDA a unit is n calls of the compiled step
                      captured by hand as one CUDA graph (capture) and replayed with one launch; a
                      CPU has no graphs to replay, so there UNIT steps are compiled as one graph,
                      whose kernels one C++ function calls (CPU_OPTIONS)

The host reads the device once per batch of needed steps (how far the slowest row is) and at
the end (the steps run, and their taus for the stats). Random draws inside a graph come from the
device's global RNG, forked and seeded from the caller's generator for the length of one
generate() (global_rng_from): a torch.Generator handed to a compiled function splits its graph at
every draw.
"""
import math
from contextlib import contextmanager

import torch

from heads import Drafter

# Steps per host call: on CUDA, graphs of 1, 2, 4 .. UNIT['cuda'] steps (capture is cheap, so the
# steps needed are run exactly); on a CPU one compiled unit, whose compile time grows with it and
# whose steps past the last one needed are spent for nothing: UNIT['cpu'] steps with a drafter,
# UNIT['cpu plain'] for plain decoding, whose steps each commit one token, so that only its last
# unit runs past the end. On the README's 2-core Xeon (scratch scripts, cold compiles, just before
# af5c5e3 made these the settings) a tiny target's (measure.TINY_TARGET) plain unit of 8 compiled
# in 24 s and ran at 29 us a step, one of 4 at 37 us; with the CPU preset's shapes, 221 us against
# 237. With a drafter a unit of 8 compiled in 45 s against 22 at those shapes, and each read of the
# device rounds the steps it asks for up to a whole unit.
UNIT = {'cuda': 16, 'cpu': 4, 'cpu plain': 8}
# How CUDA runs a unit: 'captured' (the compiled step, captured by hand), 'captured-eager' (the eager
# step, captured by hand: no compile), or 'reduce-overhead' (torch.compile's own CUDA graphs of the
# unit). On one H200 'captured' took 536 us a plain call of the GPU preset's target, 'captured-eager'
# 671, with torch's fused attention in the cached forward (README, "One GPU", at 22d3d40); gpu_check.py's
# part j measures all three.
CUDA_MODE = 'captured'

# torch.compile's backend: None is inductor; the tests trace with 'aot_eager' (dynamo's graphs and
# AOT autograd's functionalization without code generation: seconds instead of a C++ compile)
BACKEND = None
# Inductor's settings on a CPU: its kernels called from one C++ function (cpp_wrapper) rather than
# one Python call each. On the README's 2-core Xeon, in one run of both, it took a tiny target's
# compiled step from 52 to 39 us (k = 8: 134 to 93; past generate's fixed costs, measure.call_costs),
# and in another a unit of 4 steps compiled cold in 22 s with it, 23 s without. A computation of more
# than 8 ops is kept in a buffer rather than written again into each kernel that reads it
# (realize_opcount_threshold; inductor's default on a CPU is 50): the loop's state passes from step to step
# through chains of small ops, and inlined, every step's kernels grew with the steps before it. A
# tiny target's plain unit of 8 steps compiled cold in 131 s without it, 24 s with it.
CPU_OPTIONS = {'cpp_wrapper': True, 'realize_opcount_threshold': 8}


# ----------------------------------------------------------------------------- compiling

def compiled(fn, mode=None, options=None):
    """fn under torch.compile with static shapes, inductor given `options` (a dict of its config).
    Each k, temperature, acceptance rule and drafter class is a graph of its own; a sweep such as
    bench.py's needs a few dozen, past dynamo's default limit of 8, after which it would run eager
    with no more than a logged warning."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    how = dict(mode=mode, dynamic=False)
    if BACKEND is not None:
        how['backend'] = BACKEND            # `options` are inductor's: another backend takes none
    elif options:
        how['options'] = options
    return torch.compile(fn, **how)


def repeated(step, n):
    """The unit of n steps: step(*args) n times, unrolled when compiled."""
    def unit(*args):
        for _ in range(n):
            step(*args)
    return unit


# ----------------------------------------------------------------------------- CUDA graphs by hand

@torch.no_grad()
def capture(fn, n, state, device):
    """A CUDA graph of n calls of fn(), captured by hand: one replay() launches every kernel of
    the n calls, with no Python between them. fn reads and writes only tensors whose addresses
    stay put (the graph replays the same addresses); what it allocates lives in the graph's own
    memory pool.

    Capture records kernels without running them. Before it fn runs once on a side stream (the
    first call compiles, autotunes and allocates, none of which a graph can hold); that call
    changes `state` (the tensors fn mutates), so they are saved first and put back after, and the
    RNG is forked around it, so the warm-up uses none of the caller's random draws."""
    saved = [t.clone() for t in state]
    with torch.random.fork_rng(devices=[device]):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
    for t, s in zip(state, saved):
        t.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):     # random draws: the global CUDA generator, registered with it
        for _ in range(n):
            fn()
    return graph


def unit_for(device, plain):
    """Steps one host call runs on `device` (UNIT): plain decoding (plain=True) or with a drafter."""
    kind = torch.device(device).type
    return UNIT.get(f'{kind} plain', UNIT[kind]) if plain else UNIT[kind]


def largest_unit():
    """The most steps one host call runs, on any device: how far past the last needed step a loop
    can go."""
    return max(UNIT.values())


def units(n, largest):
    """n steps as units of 1, 2, 4 .. largest steps, largest first (n = 13, largest 8: 8, 4, 1)."""
    sizes = []
    for s in (2 ** i for i in range(int(math.log2(largest)), -1, -1)):
        sizes += [s] * (n // s)
        n %= s
    return sizes


# ----------------------------------------------------------------------------- the loop, compiled

class Compiled:
    """generate's loop (decode.decode_loop) on static buffers, compiled, several steps a host call.

    start(prompt, total) runs the prefill and returns the loop's state (decode.Decoding), kept on
    the model for this configuration; steps(n) runs n more steps: exactly n with CUDA graphs
    captured by hand, otherwise whole units (unit_for's steps on a CPU; a step that no row needs
    any more commits nothing: decode.advance).

    prefill(cache, drafter_state, prompt) -> (block, Q, tree) and step(cache, drafter_state, state)
    are decode's, this call's settings bound; new_state(block, Q, tree) allocates the loop's state,
    drafter_state() the drafter's own (a draft model's cache; None for most). A drafter's state is
    not restored after capture's warm-up step: it must be rebuilt from the text at every step, as a
    draft model's catch-up window does (drafters.DraftModel). `key` names every setting they bind: the first
    call with a key keeps them, its compiled functions and its graphs, and later calls with that key
    reuse them (a graph replays what it recorded). The runner adds to the key the drafter's own
    settings (settings), the static cache (one per batch size and compute dtype), the addresses of
    the model's and the drafter's weights (a model moved or reloaded records anew) and the matmuls'
    precision (numerics: a CUDA graph replays the kernels it recorded, TF32 or not)."""

    def __init__(self, model, drafter, B, room, key, prefill, step, new_state, drafter_state):
        self.device = model.lm_head.weight.device
        self.cuda = self.device.type == 'cuda'
        self.mode = CUDA_MODE if self.cuda else 'cpu'
        self.unit = unit_for(self.device, drafter is None)
        self.cache = static_cache(model, B, room)
        weights = tuple(t.data_ptr() for m in (model, drafter) if isinstance(m, torch.nn.Module)
                        for t in list(m.parameters()) + list(m.buffers()))
        full = (key, settings(drafter), id(drafter), id(self.cache), weights, numerics(), self.mode, self.unit, BACKEND)
        self.kept = kept = model.__dict__.setdefault('_static_loops', {}).setdefault(full, {})
        if not kept:   # the first call of this configuration: learn its shapes from a prefill
            own = drafter_state()
            with torch.random.fork_rng(devices=[self.device] if self.cuda else []):
                self.cache.lengths.zero_()
                state = new_state(*prefill(self.cache, own, torch.zeros(B, 1, dtype=torch.long, device=self.device)))
            for t in list(state) + tensors_of(own):   # fixed addresses, for torch.compile's CUDA graphs
                if t is not None:
                    torch._dynamo.mark_static_address(t)
            kept.update(state=state, drafter_state=own, prefill=prefill, step=step)
            if not self.cuda or self.mode == 'reduce-overhead':
                kept['unit'] = compiled(repeated(step, self.unit), 'reduce-overhead' if self.cuda else None,
                                        None if self.cuda else CPU_OPTIONS)
            elif self.mode == 'captured':
                kept['step'] = compiled(step)
        self.state, self.drafter_state = kept['state'], kept['drafter_state']
        self.tensors = [t for t in self.state if t is not None] + [self.cache.lengths]   # what a step changes

    def start(self, prompt, total):
        d, cache, prefill = self.state, self.cache, self.kept['prefill']
        d.total.fill_(total)
        if 'unit' in self.kept:   # a CPU, or torch.compile's CUDA graphs: the prefill runs as it is
            cache.lengths.zero_()
            d.restart(*prefill(cache, self.drafter_state, prompt), prompt)
            return d
        buf = self.kept.setdefault(('prompt', tuple(prompt.shape)), torch.empty_like(prompt))
        buf.copy_(prompt)

        def prefill_into_state():
            cache.lengths.zero_()
            d.restart(*prefill(cache, self.drafter_state, buf), buf)
        self.replay(('prefill', tuple(prompt.shape)), prefill_into_state, 1)
        return d

    def steps(self, n):
        args = (self.cache, self.drafter_state, self.state)
        if 'unit' in self.kept:
            for _ in range(-(-n // self.unit)):
                if self.cuda:   # a new step for torch.compile's CUDA graphs: the last one's outputs may go
                    torch.compiler.cudagraph_mark_step_begin()
                self.kept['unit'](*args)
            return
        step = self.kept['step']
        for size in units(n, self.unit):
            self.replay(('steps', size), lambda: step(*args), size)

    def replay(self, key, fn, n):
        if key not in self.kept:
            self.kept[key] = capture(fn, n, self.tensors, self.device)
        self.kept[key].replay()


def settings(drafter):
    """A drafter's own settings (its plain attributes: sample_drafts, verify, zt ..), and those of
    the drafters inside it (drafters.MixedPaths'): what a compiled loop records with its graphs
    besides the weights."""
    if drafter is None:
        return ()
    parts = drafter.named_modules() if isinstance(drafter, torch.nn.Module) else [('', drafter)]
    return tuple((where, n, v) for where, part in parts if part is drafter or isinstance(part, Drafter)
                 for n, v in sorted(vars(part).items()) if isinstance(v, (bool, int, float, str)))


def numerics():
    """The global settings that choose a matmul's kernels: float32's precision (TF32 or not:
    cli.Precision sets it) and the reduced-precision reductions of half types. A CUDA graph
    captured by hand replays the kernels it recorded whatever these say now."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)


def tensors_of(state):
    """The tensors of a drafter's state: a tensor, a list or tuple of states, or an object's
    tensor attributes (a KVCache)."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (list, tuple)):
        return [t for s in state for t in tensors_of(s)]
    return [t for v in vars(state).values() if isinstance(v, torch.Tensor) for t in [v]] if state is not None else []


def static_cache(model, B, room):
    """As gpt-fast does: a KV cache sized by the context rather than the request, kept on the model
    and reused across calls, so shapes and buffer addresses never change and the graphs are
    recorded once. The context and the spare room past it (`room`, decode_loop's) are rounded up
    to a multiple of 64, so for a context that is a multiple of 64 (every preset's) plain decoding
    and every one-path block up to k = 32 share the same buffers, as bench.py's interleaved timing
    needs. One cache per batch size and compute dtype."""
    max_len = -(-(model.config.block_size + room) // 64) * 64
    key = (B, max_len, model.compute_dtype(), model.lm_head.weight.device)
    caches = model.__dict__.setdefault('_static_caches', {})   # a plain attribute, not a buffer
    if key not in caches:
        cache = caches[key] = model.new_cache(B, max_len)
        for buf in (cache.k, cache.v, cache.lengths, cache.layers, cache.rows):   # fixed addresses for CUDA graphs
            torch._dynamo.mark_static_address(buf)
    cache = caches[key]
    cache.lengths.zero_()
    return cache


@contextmanager
def global_rng_from(generator, device):
    """The compiled step draws its random numbers from the global RNG of `device`: for the length
    of one generate() it is forked, seeded from `generator`, and restored afterwards, so the
    caller's global state is untouched and the same generator seed gives the same output. Inside
    a CUDA graph the draws follow the generator's seed and offset at each replay."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(2 ** 62, (), generator=generator, device=generator.device))
    cuda = device.type == 'cuda'
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield
