"""
What a first run on one GPU has to show, in parts a-l: every stage trains (eager, and compiled
with --parts b), compiled decoding compiles and captures once and skips no CUDA graph, its greedy
tokens match eager ones, seeds reproduce, no host sync inside a step, the memory decoding adds, the
speed tables (eager and compiled float32, eager bfloat16), token trees against paths, what the
loop's few host syncs save, and where a target call's time goes (each way of running the steps:
wall time, GPU busy time, kernels and launches per call); with --parts l, what inductor's
coordinate-descent tuning changes in a compiled call.

    python gpu_check.py --device cuda               # -> bench/gpu/parts.jsonl and gpu_check.json
    python gpu_check.py --device cuda --trained out  # on train.py's checkpoints in out/ (no part a)
    python gpu_check.py --device cuda --parts a,h,b  # chosen parts, in this order (b and l only when asked)
    python gpu_check.py --quick                      # the same at tiny sizes, on any machine (a CPU)

Each part prints as it runs and is recorded (status pass / fail / skipped, and its figures) the
moment it ends: rewritten into OUT/gpu_check.json and written to OUT/parts.jsonl, a line a part,
so a check killed in any part keeps every part before it. A run starts both afresh: its first
record replaces what an earlier run left in them, and every record names its run (commit and start
time), so the two files always hold the same run. A part that crashes or runs past its time limit
fails, and the parts after it still run; the exit status is 1, naming the failed parts.

Part a (and b, in --ckpt-dir + _compiled) trains afresh into --ckpt-dir: a folder holding another
run's checkpoints (a ckpt.pt made with other sizes, data or training, or drafters part a does not
train, which a new target would leave trained for the old one) is refused before any work.
"""
import os
import signal
import sys

if __name__ == '__main__' and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ctrl-C while the imports below load (seconds on a busy machine): the one line cli.run_script
    # prints later too, not a traceback from inside torch's import
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write('\ninterrupted\n'), os._exit(130)))

import argparse
import functools
import gc
import json
import threading
import time
import traceback
from contextlib import contextmanager
from unittest import mock

import torch

import decode
import model
import runner
import train
from bench import (LOOKUP_K, LOOKUP_NGRAM, SAMPLED_TREES, TREE_OF, dblast_tag, fitted, heads_tag, settle, speed_table,
                   trainings)
from cli import (ArgumentParser, BadInput, Precision, check_compiler, first_line, intra_op_threads, pick_dtype,
                 run_script)
from data import check_out_dir, load_checkpoint, load_target
from drafters import PromptLookup, load_drafter
from measure import (Bench, call_costs, command_line, common_flags, device_name, identical, md_table, meta, parse_list,
                     prepare, runner_settings, sync, timed, train_args, ways_of_calling, write_json, write_text)

PLAIN, HEADS, SAMPLED = 'plain greedy', 'BPD heads greedy, k=8', 'DBlast K=4 sampling'
TRAINED = ('ckpt.pt', 'heads.pt', 'dblast_K4.pt', 'dblast_K1.pt')   # what --trained reads of train.py's folder
NEAR_TIE = 1e-3   # logits: compiled kernels sum in another order, so a tie this close may break either way


def compiled_dir(args):
    return args.ckpt_dir.rstrip('/') + '_compiled'


# the parts that run inductor's compiled steps on a CPU (k compiles on CUDA only)
COMPILING = set('bcdehijl')
# what makes the target part a trains, as train.py records it (ckpt.pt's 'config'): its sizes, data
# and training; a ckpt.pt recording other values is another run's
TARGET_FLAGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'dropout', 'bias', 'data', 'seed', 'max_iters', 'lr',
                'batch_size')


def check_ckpt_dir(args, folder, part):
    """Before any work: `folder`, where `part` (a, or b) trains a new target and its drafters, holds
    no other run's checkpoints: a ckpt.pt made with other flags (TARGET_FLAGS; bench.py refuses one
    of other sizes), which the part would replace, or checkpoints the part does not train (a
    train.py run's, bench's other drafters), which its new target would leave trained for the old
    one. One line saying what and what to do. A folder of an earlier check with the same flags is
    taken: the part trains the same target again."""
    path = os.path.join(folder, 'ckpt.pt')
    if not os.path.exists(path):
        return
    trained_there = all(os.path.isfile(os.path.join(folder, n)) for n in TRAINED)
    todo = (f"use another --ckpt-dir, or remove {folder}"
            + (f" (or check that run's checkpoints: --trained {folder})" if trained_there else ''))
    try:
        config = load_checkpoint(path).get('config') or {}
    except BadInput as e:
        raise BadInput(f"--ckpt-dir {folder}: part {part} would replace its ckpt.pt, which cannot be read ({e}); "
                       f"{todo}") from None
    want = vars(train.parse_args(train_args(args, 'base')))
    odd = [key for key in TARGET_FLAGS if config.get(key) != want[key]]
    if odd:
        said = ', '.join(f"{key}={config.get(key)} (this run: {want[key]})" for key in odd)
        raise BadInput(f"--ckpt-dir {folder}: its ckpt.pt was made by another run ({said}), which part {part} would "
                       f"replace with a target of its own: {todo}")
    ours = {f'{name}.pt' for name, _ in trainings(args, resume=False)}
    others = sorted(n for n in os.listdir(folder) if n.endswith('.pt') and n not in ours)
    if others:
        raise BadInput(f"--ckpt-dir {folder}: it holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}, "
                       f"which part {part} does not train: its new ckpt.pt would leave them trained for the old "
                       f"target: {todo}")


def with_(args, **changes):
    return argparse.Namespace(**{**vars(args), **changes})


def measured(device, fn):
    """(fn(), its seconds, the memory it added at its peak over what was allocated before it, in
    MiB: CUDA only, else None). Weights, drafters, static caches and graphs already resident are
    not counted; what fn leaves allocated is."""
    cuda = torch.device(device).type == 'cuda'
    if cuda:   # what the last stage left for the collector is not this one's
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0, (torch.cuda.max_memory_allocated() - resident) / 2 ** 20 if cuda else None


class Check:
    """What the parts share: the flags, device and prompts, one Bench per way of decoding, and the
    target and drafters (part a's, or with --trained train.py's; loaded on first use, so a part
    after a failed part a fails by itself, naming the missing checkpoint)."""

    def __init__(self, args, device, prompts, val):
        self.args, self.device, self.cuda = args, device, torch.device(device).type == 'cuda'
        self.f32, self.bf16 = Precision('float32', device), Precision('bfloat16', device)
        self.eager = Bench(with_(args, compile=False), device, prompts, val, self.f32)
        self.compiled = Bench(with_(args, compile=True), device, prompts, val, self.f32)
        self.eager_bf16 = Bench(with_(args, compile=False), device, prompts, val, self.bf16)

    def path(self, name):
        return os.path.join(self.args.trained or self.args.ckpt_dir, name)

    @functools.cached_property
    def base(self):
        return load_target(self.path('ckpt.pt'), self.device)

    @functools.cached_property
    def drafters(self):
        """(heads, K = 1, K = 4, the temperature the DBlast drafters were trained at, their k)."""
        if self.args.trained:
            heads, k4, k1 = (load_drafter(self.path(n), self.base) for n in TRAINED[1:])
            T = load_checkpoint(self.path(TRAINED[2]))['temperature']
        else:
            T = 1.0
            heads = load_drafter(self.path(f"heads{heads_tag(False, True)}.pt"), self.base)
            k4, k1 = (load_drafter(self.path(f"dblast_K{K}{dblast_tag(T, loss)}.pt"), self.base)
                      for K, loss in ((4, 'al'), (1, 'nll')))
        return heads, k1, k4, T, k4.k

    @functools.cached_property
    def configs(self):   # name -> decode_all's arguments
        heads, _, k4, T, k = self.drafters
        return {PLAIN: {}, HEADS: dict(drafter=heads, k=8), SAMPLED: dict(drafter=k4, k=k, temperature=T)}


def part_train(c, compile=False):
    """a / b: every stage the speed table needs, one train.main call each, fresh (a check measures
    training, so nothing is resumed): its seconds and peak memory. b: with --compile, elsewhere."""
    if c.args.trained:
        return dict(skipped=f"trained by train.py: its checkpoints in {c.args.trained} (--trained)")
    if compile and c.args.quick and not c.cuda:
        return dict(skipped="inductor's C++ compile of four training steps takes minutes on a CPU (24 s for "
                            "one, cold, on the README's 2-core AMD EPYC); run it on CUDA, or without --quick")
    args = with_(c.args, ckpt_dir=compiled_dir(c.args)) if compile else c.args
    stages = []
    for name, argv in trainings(args, resume=False):
        try:
            _, seconds, mib = measured(c.device, lambda: train.main(argv + ['--compile'] * compile))
        except KeyboardInterrupt:   # train.py's line would name --resume: a check trains afresh each time
            raise KeyboardInterrupt('interrupted') from None
        stages.append(dict(stage=name, seconds=seconds, added_memory_mib=mib))
    return dict(ok=True, ckpt_dir=args.ckpt_dir, rows=stages)


def compile_counts():
    """(graphs dynamo has compiled, CUDA graphs inductor skipped) so far in this process. Read
    through torch's attribute, so that importing this script does not load dynamo."""
    counters = torch._dynamo.utils.counters
    return counters['stats']['unique_graphs'], counters['inductor']['cudagraph_skips']


def part_recompiles(c):
    """c: compiled decoding with dynamo's recompile and CUDA-graph logs on: after a warm-up call (it
    compiles and captures, unless part h did already), the same call again must compile no new
    graph, capture no new CUDA graph and, on CUDA, skip none (a skipped one runs without graphs,
    silently slower)."""
    rows, captures, real_capture = [], [0], runner.capture

    def counted(*a, **kw):
        captures[0] += 1
        return real_capture(*a, **kw)
    torch._logging.set_logs(recompiles=True, cudagraphs=True)
    try:
        with mock.patch.object(runner, 'capture', counted):
            for name, kw in c.configs.items():
                before = compile_counts() + (captures[0],)
                c.compiled.decode_all(c.base, **kw)
                warm = compile_counts() + (captures[0],)
                c.compiled.decode_all(c.base, **kw)
                after = compile_counts() + (captures[0],)
                rows.append(dict(config=name, warmup_graphs=warm[0] - before[0], new_graphs=after[0] - warm[0],
                                 new_captures=after[2] - warm[2], cudagraph_skips=after[1] - before[1]))
    finally:   # the user's own settings again (TORCH_LOGS), not the defaults
        torch._logging.set_logs()
        torch._logging._init_logs()
    return dict(ok=all(r['new_graphs'] == r['new_captures'] == r['cudagraph_skips'] == 0 for r in rows), rows=rows)


def part_compiled_tokens(c):
    """d: compiled greedy tokens against eager ones. Passes where they are identical, or where each
    row's first difference is a near-tie of the target's logits (rounding, MATH.md §2)."""
    T0, rows = c.eager.prompts.size(1), []
    for name in (PLAIN, HEADS):
        eager, compiled = (b.decode_all(c.base, **c.configs[name])[0] for b in (c.eager, c.compiled))
        rows.append(dict(config=name, identical_tokens=identical(compiled, eager, T0),
                         gaps_where_they_part=divergence_gaps(c.base, eager, compiled, T0)))
    return dict(ok=all(g < NEAR_TIE for r in rows for g in r['gaps_where_they_part']), near_tie=NEAR_TIE, rows=rows)


@torch.no_grad()
def divergence_gaps(target, a, b, T0):
    """For each row where a and b differ after the prompt: the gap between the target's logits of
    their two tokens at the first position they differ."""
    gaps = []
    for row in (a[:, T0:] != b[:, T0:]).any(-1).nonzero().flatten().tolist():
        j = T0 + int((a[row, T0:] != b[row, T0:]).nonzero()[0])
        logits = target(a[row:row + 1, :j])[0][0, -1].float()
        gaps.append(abs(float(logits[a[row, j]] - logits[b[row, j]])))
    return gaps


def part_seeds(c):
    """e: sampling with a seeded torch.Generator, eager and compiled: the same seed gives the same
    tokens, another seed other tokens."""
    rows = []
    for mode, b in (('eager', c.eager), ('compiled', c.compiled)):
        first, again, other = (b.decode_all(c.base, seed=s, **c.configs[SAMPLED])[0] for s in (0, 0, 1))
        rows.append(dict(config=SAMPLED, mode=mode, same_seed_same_tokens=torch.equal(first, again),
                         other_seed_other_tokens=not torch.equal(first, other)))
    return dict(ok=all(r['same_seed_same_tokens'] and r['other_seed_other_tokens'] for r in rows), rows=rows)


@contextmanager
def steps_in_sync_debug():
    """While inside, every decode.advance (a merged step and the loop's bookkeeping) runs under
    torch.cuda.set_sync_debug_mode('error'): only the step, since generate's loop syncs now and then
    by design (how far is the slowest row?). Yields a list holding the number of steps run."""
    step, calls = decode.advance, [0]

    def guarded(*a, **kw):
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode('error')
        calls[0] += 1
        try:
            return step(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(before)
    with mock.patch.object(decode, 'advance', guarded):
        yield calls


def part_sync_debug(c):
    """f (CUDA): eager decoding in float32 and in bfloat16 with no host sync inside a step."""
    if not c.cuda:
        return dict(skipped='no CUDA')
    rows = []
    for precision in (c.f32, c.bf16):
        for name, kw in c.configs.items():
            error = None
            with precision, steps_in_sync_debug() as steps:
                try:
                    c.eager.decode_all(c.base, **kw)
                except RuntimeError as e:   # what sync debug mode 'error' raises
                    error = first_line(e, limit=300)
            rows.append(dict(precision=str(precision), config=name, steps=steps[0], error=error))
    return dict(ok=all(r['error'] is None for r in rows), rows=rows)


def part_decode_memory(c):
    """g (CUDA): the memory decoding adds at its peak over what is resident (weights, drafters, static
    caches, graphs), every configuration, eager and compiled (each run once before it is measured,
    so a first call's caches and graphs count as resident), beside the weights'."""
    if not c.cuda:
        return dict(skipped='no CUDA')
    rows = []
    for name, kw in c.configs.items():
        for mode, b in (('eager', c.eager), ('compiled', c.compiled)):
            b.decode_all(c.base, **kw)
            rows.append(dict(config=name, mode=mode,
                             added_memory_mib=measured(c.device, lambda: b.decode_all(c.base, **kw))[2]))
    weights = sum(p.numel() * p.element_size() for p in c.base.parameters()) / 2 ** 20
    return dict(ok=True, weights_mib=weights, rows=rows)


def part_speed(c):
    """h: the speed table, eager then compiled in float32, then eager in bfloat16 (it prints its rows)."""
    tables = {}
    for b in (c.eager, c.compiled, c.eager_bf16):
        res = {}
        with b.precision:
            speed_table(b, c.base, b.args, res, drafters=c.drafters[:4])
        tables[f"{res['speed']['mode']}, {res['speed']['precision']}"] = res['speed']
    return dict(ok=True, tables=tables)


def part_host_syncs(c):
    """i: what the loop's few host syncs save. Plain and BPD decoding, eager and compiled, timed
    interleaved as generate runs (it reads the device once per batch of steps, those needed whatever
    they accept) and with a read every step (tokens_behind capped at 1 token)."""
    real = decode.tokens_behind
    every_step = lambda n_out, total: min(real(n_out, total), 1)       # noqa: E731  'not done yet', each step
    rows = []
    for mode, b in (('eager', c.eager), ('compiled', c.compiled)):
        for name in (PLAIN, HEADS):
            def per_step():
                with mock.patch.object(decode, 'tokens_behind', every_step):
                    return b.decode_all(c.base, **c.configs[name])
            (few, each), _ = timed([lambda: b.decode_all(c.base, **c.configs[name]), per_step], c.args.repeats,
                                   c.device)
            rows.append(dict(config=name, mode=mode, seconds=few, seconds_sync_every_step=each, ratio=each / few))
    return dict(ok=True, rows=rows)


def part_calls(c):
    """j: what a target call costs, on the check's target: for each way of running the steps
    (measure.ways_of_calling: eager, compiled one step a host call, compiled in units, and on CUDA
    the eager step captured by hand and torch.compile's CUDA graphs), plain greedy and BPD heads at
    k = 8, the prompts one at a time: wall time per call (CUDA-synchronised; the best of
    max(2, --repeats) runs; and past the fixed costs of each generate(), us_per_further_call), the
    first call's seconds (compiling and capturing, unless an earlier part, h in the default order,
    compiled that configuration already), and on CUDA the GPU's busy time, kernels and
    launches per call (the profiler), and the GPU time of a step of the captured unit replayed back
    to back (CUDA events; graph_us). On CUDA also the compiled units with TF32 matmuls and in bf16
    autocast, where the products of a k-token call run on tensor cores."""
    rows = []
    for way, (compile, setting) in ways_of_calling(c.device).items():
        for name in (PLAIN, HEADS):
            kw = c.configs[name]
            with runner_settings(c.device, **setting):
                r = first_call_and_costs(c, compile=compile, **kw)
                if c.cuda and compile and setting.get('mode') is None:
                    r['graph_us'] = replayed_step_us(c.base, kw.get('k') or 1, runner.UNIT['cuda'])
            rows.append(dict(way=way, config=name, **r))
    if c.cuda:   # is a wider call free on tensor cores? float32 8-row products run on CUDA cores
        for precision in (Precision('float32', c.device, tf32=True), Precision('bfloat16', c.device)):
            for name in (PLAIN, HEADS):
                with precision:
                    r = costs(c, compile=True, **c.configs[name])
                rows.append(dict(way=f"compiled, {runner.UNIT['cuda']} steps a host call, {precision}", config=name,
                                 **r))
    return dict(ok=True, rows=rows, attention=attention_kernels(c) if c.cuda else None)


def costs(c, **kw):
    """What a call costs while c.eager.decode_all(c.base, **kw) decodes the prompts (measure.call_costs,
    the best of max(2, --repeats) runs), and past the prefill and set-up of each generate()
    (us_per_further_call), against the same decoding with a quarter of the new tokens."""
    return call_costs(lambda: c.eager.decode_all(c.base, **kw), c.device, max(2, c.args.repeats),
                      lambda: c.eager.decode_all(c.base, max_new=max(1, c.args.max_new // 4), **kw))


def first_call_and_costs(c, **kw):
    """costs, after the first decode of the configuration, timed (first_call_s: compiling and
    capturing)."""
    t0 = time.perf_counter()
    c.eager.decode_all(c.base, **kw)
    sync(c.device)
    return dict(first_call_s=time.perf_counter() - t0, **costs(c, **kw))


def attention_kernels(c):
    """The cached attention's kernels, plain greedy and BPD k = 8 (the eager step captured by hand:
    no compile, the GPU's time alone): the manual attention a compiled step runs
    (model.manual_attention) against torch's fused F.scaled_dot_product_attention, the eager one."""
    def fused(q, K, V, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    rows = []
    for name, attend in (('manual (model.manual_attention)', model.manual_attention),
                         ('fused (F.scaled_dot_product_attention)', fused)):
        for config in (PLAIN, HEADS):
            c.base.__dict__.pop('_static_loops', None)     # recapture: a graph holds the kernels it recorded
            with runner_settings(c.device, mode='captured-eager'), mock.patch.object(model, 'cached_attention', attend):
                r = call_costs(lambda: c.eager.decode_all(c.base, compile=True, **c.configs[config]), c.device, 2)
            rows.append(dict(attention=name, config=config, **r))
    c.base.__dict__.pop('_static_loops', None)
    return rows


def replayed_step_us(target, k, unit, replays=20):
    """The GPU's own time for one step: the last captured unit of `unit` steps of the loop at block
    size k, replayed back to back (CUDA events; nothing of the host between the replays). Its
    decode has ended, so every step it runs is one no row needs: it commits nothing."""
    graphs = [kept[('steps', unit)] for key, kept in target.__dict__.get('_static_loops', {}).items()
              if key[0][0] == k and ('steps', unit) in kept]
    if not graphs:
        return None
    graph, start, end = graphs[-1], torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * unit)


def part_trees(c):
    """k: token trees against one path and several (MATH.md §10), compiled on CUDA (eager on a CPU,
    where a wider block is not free anyway): BPD heads greedy at k = 8 with 1 path and trees of 8, 32
    and 64 nodes; the DBlast K = 4 drafter sampling at its own temperature with 1 path, 8 paths and a
    tree of 24 nodes (as many drafted tokens), and a sampled tree (bench's SAMPLED_TREES[1]); prompt
    lookup greedy (bench table 9's: a 2-gram, 10 drafts) with 1 path and a tree of 16. tau, calls,
    speedup over plain decoding, timed interleaved with it."""
    heads, _, k4, T, kd = c.drafters
    b, rows = c.compiled if c.cuda else c.eager, []
    sampled = fitted(SAMPLED_TREES[1], kd)
    for name, d, k, temperature, shapes in (   # each shape (paths, nodes, a sampled tree's widths)
            ('BPD heads', heads, 8, 0.0, [(1, None, None), (1, 8, None), (1, 32, None), (1, 64, None)]),
            ('DBlast K=4', k4, kd, T, [(1, None, None), (8, None, None), (1, 24, None), (1, None, sampled)]),
            ('prompt lookup', PromptLookup(LOOKUP_NGRAM, LOOKUP_K), LOOKUP_K, 0.0,
             [(1, None, None), (1, TREE_OF, None)])):
        for paths, nodes, branching in shapes:
            r, _, _ = b.row(c.base, d, k, temperature=temperature, paths=paths, nodes=nodes, branching=branching)
            rows.append(dict(drafter=name, T=temperature, paths=paths, nodes=nodes, branching=branching, tau=r['tau'],
                             calls=r['calls'], speedup=r['speedup'], seconds=r['seconds']))
    return dict(ok=True, rows=rows)


def part_tuned(c):
    """l (only when asked: how long it compiles is unmeasured): the compiled units with inductor's
    coordinate-descent tuning (gpt-fast's setting) against the same units without it, plain greedy
    and BPD heads at k = 8, the prompts one at a time: the first call's seconds (compiling, tuning,
    capturing), wall and GPU time, kernels per call. With it, on CUDA, inductor writes a matrix
    product with one row as a reduction, which it can fuse with the kernels around it, and tunes
    each kernel's launch shape by timing it; a plain call's products have one row."""
    rows = []
    for tuned in (False, True):
        for name in (PLAIN, HEADS):
            c.base.__dict__.pop('_static_loops', None)      # compile and capture anew under this setting:
            torch._dynamo.reset()                           # dynamo's guards do not look at inductor's config
            with torch._inductor.config.patch(coordinate_descent_tuning=tuned):
                r = first_call_and_costs(c, compile=True, **c.configs[name])
            rows.append(dict(coordinate_descent_tuning=tuned, config=name, **r))
    c.base.__dict__.pop('_static_loops', None)
    return dict(ok=True, rows=rows)


# key -> (title, part, time limit in seconds). A limit is a minute at least and above the README's
# estimate of the part on one H200, cold: a part past its limit fails, and the next one runs.
PARTS = {'a': ('every stage trained eager: seconds, memory added', part_train, 200),
         'b': ('every stage trained with --compile', functools.partial(part_train, compile=True), 200),
         'c': ('compiled decoding: a second call compiles and captures nothing, skips no CUDA graph', part_recompiles,
               120),
         'd': ('compiled against eager greedy tokens', part_compiled_tokens, 60),
         'e': ('seeded sampling: same seed same tokens, other seed other tokens', part_seeds, 60),
         'f': ('no host sync inside an eager step, float32 and bfloat16 (CUDA)', part_sync_debug, 60),
         'g': ('memory decoding adds (CUDA)', part_decode_memory, 60),
         'h': ('speed tables: eager and compiled float32, eager bfloat16', part_speed, 200),
         'i': ("the loop's host syncs: as they are against one every step", part_host_syncs, 60),
         'j': ("what a target call costs, each way of running the steps", part_calls, 300),
         'k': ('token trees against one path and several, compiled on CUDA', part_trees, 200),
         'l': ("compiled with inductor's coordinate-descent tuning, against without", part_tuned, 300)}
# the speed figures early; b (compiled training, the slowest) and l (tuning, of unmeasured length) when asked
PART_ORDER = 'a,h,k,j,c,d,e,f,g,i'


def gpu_check(args, device, prompts, val):
    intra_op_threads(args.threads, small=True)   # the GPU preset's model (10.75M) decodes small on a CPU
    c = Check(args, device, prompts, val)
    saved = runner.BACKEND
    backend = ('inductor, the compiled step captured by hand as CUDA graphs of up to '
               f"{runner.UNIT['cuda']} steps" if c.cuda else
               f"inductor, units of {runner.UNIT['cpu plain']} steps (plain decoding) or {runner.UNIT['cpu']}")
    if args.quick and not c.cuda:   # inductor's C++ codegen would cost seconds per graph on a small CPU
        runner.BACKEND = 'aot_eager'
        backend = "aot_eager (CPU under --quick: dynamo's graphs, guards and recompiles, no codegen)"
    report = dict(meta=meta(args, device, 'float32; bfloat16 autocast where a part says so'),
                  started=time.strftime('%Y-%m-%dT%H:%M:%S%z'), compiled_decoding=backend, trained=args.trained)
    try:
        run_parts(c, [(key, *PARTS[key]) for key in args.parts], report, os.path.join(args.out, 'gpu_check.json'))
    finally:   # this process may decode compiled again (the tests do)
        runner.BACKEND = saved


class PartTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds):
    """Raise PartTimeout inside the block after `seconds` (SIGALRM, where this process can: the main
    thread of a POSIX process). A hang inside one native call (a CUDA sync) ends when that call
    returns; a hang in Python code ends on time."""
    if not hasattr(signal, 'setitimer') or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise PartTimeout(f"over its time limit of {seconds} s")
    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def run_parts(c, parts, report, path):
    """Each part (key, title, function, time limit) in order, in float32 (training enters train.py's
    own precision inside): printed, then recorded the moment it ends, as one line of parts.jsonl
    beside `path` (flushed to disk) and in the summary JSON at `path` (rewritten), so that a check
    killed in any part keeps every part before it. The run's first record starts parts.jsonl
    afresh (an earlier run's lines would sit beside this run's, which the summary alone holds), and
    every record names the run: its commit and start time (report's meta and 'started'). A part
    that crashes or runs past its limit fails, and the next one runs. Then SystemExit naming the
    failed parts, if any."""
    report['parts'] = {}
    lines = os.path.join(os.path.dirname(path), 'parts.jsonl')
    run = dict(commit=(report.get('meta') or {}).get('git_commit') or None,
               run_started=report.setdefault('started', time.strftime('%Y-%m-%dT%H:%M:%S%z')))
    for key, title, part, limit in parts:
        print(f"\n## {key}. {title}\n", flush=True)
        t0, before = time.perf_counter(), compile_counts()
        try:
            with Precision('float32', c.device), time_limit(limit):
                res = part(c)
        except Exception as e:   # a crash or the time limit fails this part; the next ones still run
            traceback.print_exc()
            res = dict(ok=False, error=f'{type(e).__name__}: {first_line(e, limit=300)}')
        status = 'skipped' if 'skipped' in res else 'pass' if res.pop('ok') else 'fail'
        after = compile_counts()
        record = dict(part=key, title=title, status=status, seconds=time.perf_counter() - t0, time_limit=limit,
                      graphs_compiled=after[0] - before[0], cudagraph_skips=after[1] - before[1],
                      **run, **versions(c.device), **res)
        first = not report['parts']
        report['parts'][key] = record
        report['failed'] = [k for k, p in report['parts'].items() if p['status'] == 'fail']
        write_json(report, path)                  # first the summary, so that a record in parts.jsonl
        if first:                                 # means the summary holds it too
            write_text(json.dumps(record) + '\n', lines)
        else:
            try:
                with open(lines, 'a') as f:
                    f.write(json.dumps(record) + '\n')
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise BadInput(f"cannot write the part's record to {lines} ({e.strerror or e}); {path} holds it")
        if res.get('rows'):   # rows may differ in what they hold: one column per key of any row
            cols = list(dict.fromkeys(col for r in res['rows'] for col in r))
            print(md_table(cols, [[short(r[col]) if col in r else '' for col in cols] for r in res['rows']]))
        note = res.get('skipped') or res.get('error')
        print(f"{key}: {status}{': ' + note if note else ''} ({record['seconds']:.1f}s)", flush=True)
    print(f"\ngpu check -> {path} and {lines}: " + ', '.join(f"{k} {p['status']}" for k, p in report['parts'].items()))
    if report['failed']:
        raise SystemExit(f"gpu check: failed parts {', '.join(report['failed'])} (see {path})")


def versions(device):
    """What every record of the check names: torch, CUDA, the device and the precision it decodes at."""
    return dict(torch=torch.__version__, cuda=torch.version.cuda, device=str(device), device_name=device_name(device),
                dtype='float32; bfloat16 autocast where the part says so')


def short(v):
    return f'{v:.3g}' if isinstance(v, float) else v


# train.py's GPU preset model on CUDA (its CPU one elsewhere), its target trained as train.py
# trains it (600 steps gave a target whose continuations loop: every draft accepted, tau 8.0 at
# k = 8, which says nothing about drafting), the drafters shorter; with --quick, tiny shapes and a
# handful of steps, prompts and tokens, so that it runs on a CPU in seconds
PRESET = dict(max_iters=3000, heads_iters=1500, dblast_iters=1000, distill_samples=1024, dblast_samples=1024,
              dblast_eval_samples=16, n_prompts=4, max_new=128, repeats=2, eval_samples=16, speed_ks='8')
QUICK = dict(n_layer=1, n_head=2, n_embd=16, block_size=64, batch_size=4, max_iters=20, heads_iters=4,
             dblast_iters=4, distill_samples=4, dblast_samples=4, dblast_eval_samples=4, n_prompts=2,
             max_new=16, repeats=1, eval_samples=4, speed_ks='8')


def check_trained(folder, prompts, val):
    """--trained's checkpoints against what the parts ask of them, before any part runs: a target
    that has every id of --data's prompts, and BPD heads for the blocks of 8 the parts decode."""
    target = load_target(os.path.join(folder, 'ckpt.pt'))
    top, V = max(int(prompts.max()), int(val.max())), target.config.vocab_size
    if top >= V:
        raise BadInput(f"--trained {folder}: its target has {V} token ids (0..{V - 1}), and --data's held-out text "
                       f"holds id {top}: give the --data that run was trained on")
    heads = load_drafter(os.path.join(folder, 'heads.pt'), target)
    if getattr(heads, 'k', 0) < 8 or not hasattr(heads, 'head_logits'):
        raise BadInput(f"--trained {folder}: its heads.pt is not BPD heads for blocks of 8 (k = "
                       f"{getattr(heads, 'k', None)}), which the parts decode with: train them with train.py --k 8")


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--quick', action='store_true', help='tiny sizes, seconds on a CPU')
    ap.add_argument('--parts', default=PART_ORDER, help=f"which parts, in which order, from {','.join(PARTS)} "
                                                        f"(default {PART_ORDER}; b, compiled training, and l, "
                                                        f"tuned compiling, when asked)")
    ap.add_argument('--trained', default=None, metavar='DIR',
                    help=f"check train.py's checkpoints in DIR ({', '.join(TRAINED)}) instead of training in part a")
    common_flags(ap, 'bench/gpu')
    args = ap.parse_args(argv)
    args.command = command_line('gpu_check.py', argv)
    args.tables, args.compile = 'speed', False   # the trainings part a runs are the speed table's
    device = settle(args, QUICK if args.quick else PRESET)
    args.parts = parse_list('--parts', args.parts, str, lambda p: p in PARTS, f"from {','.join(PARTS)}")
    pick_dtype('bfloat16', device)               # part h decodes in bfloat16 too
    for _, argv in trainings(args):              # part b's flags
        train.parse_args(argv + ['--compile'])
    if args.trained:
        missing = [n for n in TRAINED if not os.path.isfile(os.path.join(args.trained, n))]
        if missing:
            raise BadInput(f"--trained {args.trained}: no {missing[0]} there; want the folder of a finished "
                           f"`python train.py` ({', '.join(TRAINED)})")
    if set(args.parts) & COMPILING and not args.quick:   # --quick on a CPU compiles with aot_eager: no C++
        check_compiler(device)
    if not args.trained:   # b is skipped on a CPU under --quick (part_train)
        for part, folder in (('a', args.ckpt_dir), ('b', compiled_dir(args))):
            if part in args.parts and not (part == 'b' and args.quick and torch.device(device).type != 'cuda'):
                check_ckpt_dir(args, folder, part)
    prompts, val = prepare(args, device)
    if args.trained:
        check_trained(args.trained, prompts, val)
    check_out_dir(compiled_dir(args), '--ckpt-dir (+ _compiled)')
    gpu_check(args, device, prompts, val)


if __name__ == '__main__':
    run_script(main, 'interrupted: every part that ended is in parts.jsonl and gpu_check.json')
