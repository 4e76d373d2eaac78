"""
How bench.py and gpu_check.py measure: the flags they share and the train.py command line at their
sizes, the held-out prompts, interleaved timing, `Bench` (every prompt decoded one way, timed
against plain decoding; the exact expected-tau evaluator on held-out samples), the profiler's
regions of a decoding step, and the files a run writes (results.json, RESULTS.md) under the commit,
command, machine and torch that made them. What is measured, and why, is bench.py's.
"""
import functools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import types
from contextlib import ExitStack, contextmanager
from unittest import mock

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import decode
import runner
import train
import verification
from cli import BadInput, write_atomically
from data import PROMPT_LEN, check_out_dir, heldout_prompts, load_dataset, newline_id
from dblast import expected_tau
from decode import generate
from generate import merged_stats
from model import GPT, GPTConfig, KVCache


# ----------------------------------------------------------------------------- flags and folders

SIZES = ('n_prompts', 'max_new', 'repeats', 'eval_samples', 'n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size',
         'dblast_eval_samples', 'max_iters', 'heads_iters', 'dblast_iters', 'distill_samples', 'dblast_samples')


def common_flags(ap, out):
    """The flags bench.py and gpu_check.py share: where, what, how big. `out`: the default folder."""
    ap.add_argument('--device', default=None)
    ap.add_argument('--data', default=None, help='corpus (default: the stdlib .py files)')
    ap.add_argument('--out', default=out, help=f'folder for the results (default: {out})')
    ap.add_argument('--ckpt-dir', default=None, help='checkpoints (default: OUT/ckpt)')
    ap.add_argument('--seed', type=int, default=1337)
    ap.add_argument('--threads', type=int, default=None,
                    help='CPU threads for decoding, and for the training it runs (default: 1 for decoding a small model, '
                         'else the cores not busy)')
    ap.add_argument('--dblast-k', type=int, default=4)
    ap.add_argument('--speed-ks', default=None, help="the speed table's block sizes, comma-separated (default 2,4,6,8,10; "
                                                          "gpu_check.py: 8)")
    ap.add_argument('--batch', type=int, default=1,
                    help='prompts per generate() call (1: per-request latency, as in the papers)')
    for name in SIZES:
        ap.add_argument('--' + name.replace('_', '-'), type=int, default=None)


def train_args(args, stage, *extra, resume=True):
    """train.py argv for one stage at the bench's sizes (only that stage's flags: train.py refuses
    flags that mean nothing for the stages it runs). resume: skip what is already trained."""
    a = ['--out-dir', args.ckpt_dir, '--no-demo', '--seed', str(args.seed), '--stages', stage] + ['--resume'] * resume
    if args.device:
        a += ['--device', args.device]
    if args.threads:
        a += ['--threads', str(args.threads)]
    if args.data:
        a += ['--data', args.data]
    flags = {'base': ('n_layer', 'n_head', 'n_embd', 'block_size', 'max_iters'),
             'heads': ('heads_iters', 'distill_samples'),
             'dblast': ('dblast_iters', 'dblast_samples', 'dblast_eval_samples'),
             'draft': ('distill_samples',)}[stage] + ('batch_size',)
    for flag in flags:
        v = getattr(args, flag)
        if v is not None:
            a += ['--' + flag.replace('_', '-'), str(v)]
    return a + list(extra)


def prepare(args, device):
    """After every flag is checked: the folders, and the held-out prompts every row decodes with
    the held-out text they come from."""
    check_out_dir(args.out, '--out')
    check_out_dir(args.ckpt_dir, '--ckpt-dir')
    ds = load_dataset(args.data, os.path.join(args.ckpt_dir, 'data'))
    if len(ds.val) < PROMPT_LEN + args.n_prompts + 1:
        raise BadInput(f"--n-prompts {args.n_prompts}: the held-out text is too short for that many prompts")
    return heldout_prompts(ds.val, args.n_prompts, PROMPT_LEN, newline_id(ds.vocab)).to(device), ds.val


# ----------------------------------------------------------------------------- timing, Bench

def sync(device):
    if str(device).startswith('cuda'):
        torch.cuda.synchronize()


def timed(fns, repeats, device, warmup=True, stat=statistics.median):
    """Median wall-clock seconds of each fn over `repeats` rounds (or another `stat` of them: min
    for the best), after one warm-up round (needed to compile, and on a GPU; on the CPU in eager
    mode a first decode costs no more than the next). The fns run interleaved, round after round,
    so a busy spell on a shared machine hits them alike and their ratio stays fair. Returns (the
    stat of each, each fn's last result)."""
    results = [fn() for fn in fns] if warmup else [None] * len(fns)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            results[i] = fn()
            sync(device)
            times[i].append(time.perf_counter() - t0)
    return [stat(t) for t in times], results


# the ways of drafting that table 3 compares -> (sample_drafts, verify): the drafter contract's one
# setting, and what a mixture verifies against (for one branch, as BPD heads and K = 1 have, both
# are the same)
DRAFTING = {'sampled': (True, 'mixture'), 'argmax': (False, 'mixture'),
            'sampled, branch-cond.': (True, 'branch'), 'greedy, branch-cond.': (False, 'branch'),
            'greedy, mixture': (False, 'mixture'), 'sampled, mixture': (True, 'mixture')}


class Bench:
    """Decodes the prompts with args.compile; `precision` (cli.Precision) is what the caller
    enters around the tables (named in their headings), not entered here."""

    def __init__(self, args, device, prompts, val, precision):
        self.args, self.device, self.prompts, self.val = args, device, prompts, val
        self.precision = precision
        self.plain_runs = {}   # (target id, temperature) -> plain decoding's (out, stats)
        self.heldout = {}      # temperature -> held-out target samples for the evaluator

    def decode_all(self, model, drafter=None, k=None, temperature=0.0, accept='exact', seed=0, compile=None, paths=1,
                   nodes=None, max_new=None, branching=None):
        """Every prompt, --batch rows per generate() call (default 1: per-request latency, as the
        papers measure), compiled as --compile says unless `compile` is given, --max-new tokens
        each unless `max_new` is. Returns outputs and the calls' stats merged."""
        compile = self.args.compile if compile is None else compile
        g = torch.Generator(device=self.device).manual_seed(seed)
        runs = [generate(model, chunk, max_new or self.args.max_new, drafter=drafter, k=k, temperature=temperature, accept=accept,
                         generator=g, compile=compile, paths=paths, nodes=nodes, threads=None,   # bench's threads
                         branching=branching)
                for chunk in self.prompts.split(self.args.batch)]
        return torch.cat([out for out, _ in runs]), merged_stats([s for _, s in runs])

    def expected_tau(self, model, drafter, T, way, zt=1.0):
        """Expected tau of `drafter` drafting `way` (a DRAFTING key) at temperature T, exactly,
        on held-out target samples (made once per T and cached on disk)."""
        if T not in self.heldout:
            # made at decoding's float32 whatever the table's precision (train.dblast_data)
            rt = types.SimpleNamespace(device=self.device, kind=torch.device(self.device).type, master=True)
            self.heldout[T] = train.dblast_data(rt, model, self.val, self.args.eval_samples, T, self.args.seed + 2,
                                                f'held-out samples at T={T}', os.path.join(self.args.ckpt_dir, 'data'))
        sample_drafts, verify = DRAFTING[way]
        return expected_tau(drafter, model, self.heldout[T], self.args.dblast_k, T, sample_drafts, verify, zt)

    def plain(self, model, temperature):
        """Plain decoding's output and stats (the reference each row is compared with)."""
        key = (id(model), temperature)
        if key not in self.plain_runs:
            self.plain_runs[key] = self.decode_all(model, temperature=temperature)
        return self.plain_runs[key]

    def row(self, model, drafter, k, temperature=0.0, accept='exact', against_eager=False, paths=1, nodes=None,
            branching=None):
        """tau, acceptance per position, calls and speedup over plain decoding, timed together.
        against_eager (with --compile): the eager runs of both are timed in the same rounds too, so
        that what compiling gains is a ratio inside one run (eager_seconds, plain_eager_seconds)."""
        fns = [lambda: self.decode_all(model, drafter, k, temperature, accept, paths=paths, nodes=nodes,
                                       branching=branching),
               lambda: self.decode_all(model, temperature=temperature)]
        if against_eager and self.args.compile:
            fns += [lambda: self.decode_all(model, drafter, k, temperature, accept, compile=False, paths=paths,
                                            nodes=nodes, branching=branching),
                    lambda: self.decode_all(model, temperature=temperature, compile=False)]
        times, results = timed(fns, self.args.repeats, self.device, warmup=self.args.compile or str(self.device) != 'cpu')
        (dt, dt0), ((out, stats), (base_out, base_stats)) = times[:2], results[:2]
        r = dict(k=k, tau=stats['mean_tau'], accept_rate=[round(a, 4) for a in stats['accept_rate']],
                 calls=stats['calls'], plain_calls=base_stats['calls'], seconds=dt, plain_seconds=dt0,
                 speedup=dt0 / dt)
        if len(times) == 4:
            r.update(eager_seconds=times[2], plain_eager_seconds=times[3])
        return r, out, base_out


def identical(out, ref, T0):
    """Share of the generated tokens (after the T0-token prompts) equal to ref's."""
    return float((out[:, T0:] == ref[:, T0:]).float().mean())


@torch.no_grad()
def output_nll(model, out, T0):
    """Mean NLL (nats/token) the model gives the generated part of `out`."""
    logits, _ = model(out[:, :-1])
    lp = F.log_softmax(logits.float(), -1).gather(-1, out[:, 1:, None]).squeeze(-1)
    return float(-lp[:, T0 - 1:].mean())


@torch.no_grad()
def forward_ratio(model, k, device, B, ctx=96, repeats=200):
    """t(k-token cached forward) / t(1-token cached forward), B rows at a context of ctx tokens
    (about the middle of a bench decode)."""
    cache = model.new_cache(B, ctx + k)
    cache.lengths.fill_(ctx)

    blocks = [torch.zeros(B, n, dtype=torch.long, device=device) for n in (1, k)]
    (t1, tk), _ = timed([lambda: model.forward_cached(blocks[0], cache),
                         lambda: model.forward_cached(blocks[1], cache)], repeats, device)
    return tk / t1


@torch.no_grad()
def tree_ratio(model, paths, k, device, B, ctx=96, repeats=200):
    """t(tree block of 1 + paths(k-1) tokens) / t(k-token block), cached forwards of B rows at a
    context of ctx tokens: what verifying several paths costs over one."""
    cache = model.new_cache(B, ctx + 1 + paths * (k - 1))
    cache.lengths.fill_(ctx)
    tree = verification.tree_layout(paths, k - 1, device)
    blocks = [torch.zeros(B, n, dtype=torch.long, device=device) for n in (k, 1 + paths * (k - 1))]
    (tk, tn), _ = timed([lambda: model.forward_cached(blocks[0], cache),
                         lambda: model.forward_cached(blocks[1], cache, tree)], repeats, device)
    return tn / tk


@torch.no_grad()
def token_tree_ratio(model, nodes, k, device, B, ctx=96, repeats=200):
    """t(token-tree block of 1 + nodes tokens) / t(k-token block), cached forwards of B rows at a
    context of ctx tokens: what verifying a tree costs over one path (the tree's shape does not
    change the work: every node below the bonus here)."""
    cache = model.new_cache(B, ctx + 1 + nodes)
    cache.lengths.fill_(ctx)
    tree = torch.zeros(B, 2, 1 + nodes, dtype=torch.long, device=device)
    tree[:, 1, 1:] = 1
    attend = verification.tree_attend(tree, k - 1)
    blocks = [torch.zeros(B, n, dtype=torch.long, device=device) for n in (k, 1 + nodes)]
    (tk, tn), _ = timed([lambda: model.forward_cached(blocks[0], cache),
                         lambda: model.forward_cached(blocks[1], cache, attend)], repeats, device)
    return tn / tk


# ----------------------------------------------------------------------------- where a step's time goes

@contextmanager
def step_regions():
    """While inside, the pieces of a decoding step run inside named profiler regions ('step.*'),
    attached from outside so that decode.py and verification.py carry no profiling code: the
    target's forward, the verification, the cache, the drafting, and the loop's read from the
    device. A region entered inside one of the same name (the tree's greedy verification calls
    verify_greedy) is not counted twice."""
    inside = set()

    def region(name, fn):
        @functools.wraps(fn)
        def timed_fn(*a, **kw):
            if name in inside:
                return fn(*a, **kw)
            inside.add(name)
            try:
                with torch.profiler.record_function('step.' + name):
                    return fn(*a, **kw)
            finally:
                inside.discard(name)
        return timed_fn
    pieces = [(GPT, 'forward_cached', 'target_forward'), (KVCache, 'commit', 'cache'), (KVCache, 'keep_path', 'cache'),
              (decode, 'propose', 'draft'), (decode, 'tokens_behind', 'host_sync')]
    pieces += [(verification, f, 'verify') for f in ('verify_greedy', 'verify_sampled', 'verify_tree_greedy',
                                                     'verify_tree_sampled')]
    with ExitStack() as stack:
        for owner, attr, name in pieces:
            stack.enter_context(mock.patch.object(owner, attr, region(name, getattr(owner, attr))))
        yield


def profiled(device):
    """torch's profiler for `device`: its CPU activity, and on CUDA its kernels too. Elsewhere the
    lines its backend (kineto) writes to stderr at each use (profiler_start, profiler_stop, and in
    a CUDA build on a machine without a GPU, 'gpuGetDeviceCount failed') are silenced: they fell
    between the rows of bench's printed tables. KINETO_LOG_LEVEL 6 is past its highest level (5);
    a value the user set stays. On CUDA they stay too: they say when the GPU's kernels cannot be
    read (CUPTI's permissions). Each profiler here runs once, so acc_events (keep the events of
    several runs) changes nothing but torch 2.11's warning, at every start without it, that they
    are not kept."""
    cuda = torch.device(device).type == 'cuda'
    if not cuda:
        os.environ.setdefault('KINETO_LOG_LEVEL', '6')
    return profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda, acc_events=True)


def time_split(run, device):
    """Share of run()'s time in each named region of the step (step_regions), by the profiler."""
    cuda = str(device).startswith('cuda')
    run()  # warm-up
    with step_regions(), profiled(device) as prof:
        t0 = time.perf_counter()
        run()
        sync(device)
        total = (time.perf_counter() - t0) * 1e6
    split = {name: us / total for name, us in step_times(prof.key_averages(), cuda).items()}
    split['other (python, prefill)'] = max(0.0, 1 - sum(split.values()))
    return split


def step_times(events, cuda):
    """Microseconds in each 'step.*' region of the profiler's key_averages() rows. On CUDA a region
    has two rows: the record_function range on the CPU side and a GPU-side user annotation
    (device_type CUDA); only the CPU-side one is read, whatever the order. Its time on CUDA is the
    device time of the kernels launched inside it, except for the host sync, which is the host's
    waiting (CPU time); on a CPU, CPU time."""
    split = {}
    for ev in events:
        if ev.key.startswith('step.') and ev.device_type == torch.autograd.DeviceType.CPU:
            split[ev.key[5:]] = ev.device_time_total if cuda and ev.key != 'step.host_sync' else ev.cpu_time_total
    return split


# ----------------------------------------------------------------------------- what a target call costs

# A target that computes next to nothing (1 layer, width 16, bytes): its time per call is the host's
# cost of a call, which the GPU preset's target pays on a GPU too (README, "One GPU")
TINY_TARGET = GPTConfig(block_size=512, vocab_size=256, n_layer=1, n_head=2, n_embd=16)
# what the profiler names a host's launch of work on the GPU: a kernel, a copy or fill, a graph's replay
LAUNCHES = ('cudaLaunchKernel', 'cudaLaunchKernelExC', 'cuLaunchKernel', 'cuLaunchKernelEx', 'cudaGraphLaunch',
            'cudaMemcpyAsync', 'cudaMemsetAsync')


def ways_of_calling(device):
    """The ways a decoding step can be run, for the 'calls' table: name -> (compile, the runner's
    settings for runner_settings). Eager; compiled with one step a host call; compiled in units of
    runner.unit_for's steps (generate(compile=True)); on CUDA also the unit as the eager step captured by
    hand, and one step a host call as torch.compile's own CUDA graphs."""
    plain, drafted = runner.unit_for(device, True), runner.unit_for(device, False)
    unit = drafted if plain == drafted else f"{plain} (plain) or {drafted}"
    ways = {'eager': (False, {}), 'compiled, 1 step a host call': (True, dict(unit=1)),
            f'compiled, {unit} steps a host call': (True, {})}
    if torch.device(device).type == 'cuda':
        ways[f'eager step captured by hand, {unit} steps a host call'] = (True, dict(mode='captured-eager'))
        # one step a host call: its unit is unrolled into one graph, and compiling n steps takes n
        # times one step's
        ways["torch.compile's CUDA graphs, 1 step a host call"] = (True, dict(mode='reduce-overhead', unit=1))
    return ways


@contextmanager
def runner_settings(device, unit=None, mode=None):
    """While inside, runner.py runs `unit` steps a host call on `device`'s kind, and CUDA units
    as `mode` (runner.CUDA_MODE)."""
    with ExitStack() as stack:
        if unit is not None:
            kind = torch.device(device).type       # plain decoding's unit too, where it has its own
            stack.enter_context(mock.patch.dict(runner.UNIT, {key: unit for key in runner.UNIT
                                                              if key.split()[0] == kind}))
        if mode is not None:
            stack.enter_context(mock.patch.object(runner, 'CUDA_MODE', mode))
        yield


def call_costs(decode_once, device, repeats, decode_shorter=None):
    """What one target call costs while decode_once() (-> generate's output and stats) decodes: the
    wall time per call, the best of `repeats` runs after a warm-up (timed; the host's cost, where the
    device computes next to nothing), and from one profiled run: on CUDA the GPU's busy time per
    call (its kernels' durations, summed), kernels and host launches per call (a CUDA graph's replay
    is one launch) and the kernels that take the most of it (top_kernels: name, us per call); on a
    CPU the operations per call (top-level aten operators, and inductor's kernels where it compiled
    with their profiling on).

    With decode_shorter (the same decoding, fewer new tokens) also the cost of one more call, the
    prefill and what a generate() call does once left out (us_per_further_call): the difference of
    the two best times over the difference of their calls (the two timed interleaved). A block of k
    makes fewer calls, so the fixed costs weigh more in its us_per_call than in plain decoding's."""
    cuda = torch.device(device).type == 'cuda'
    bests, results = timed([decode_once] + [decode_shorter] * (decode_shorter is not None), repeats, device, stat=min)
    best, stats = bests[0], results[0][1]
    calls = stats['calls']
    with profiled(device) as prof:
        decode_once()
        sync(device)
    events = prof.events()
    r = dict(us_per_call=best / calls * 1e6, tokens_per_s=stats['tokens'] / best, calls=calls, tau=stats['mean_tau'])
    if decode_shorter is not None:
        best_short, short = bests[1], results[1][1]
        if short['calls'] >= calls:
            raise ValueError(f"the shorter decoding makes {short['calls']} calls, not fewer than {calls}")
        r['us_per_further_call'] = (best - best_short) / (calls - short['calls']) * 1e6
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name = {}
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
        r.update(gpu_busy_us_per_call=sum(by_name.values()), kernels_per_call=len(kernels) / calls,
                 launches_per_call=sum(e.name in LAUNCHES for e in events) / calls,
                 top_kernels=[(n[:90], us) for n, us in sorted(by_name.items(), key=lambda x: -x[1])[:8]])
    else:
        top = [e for e in events if e.name.startswith('graph_') or (
            e.name.startswith('aten::') and not (e.cpu_parent and e.cpu_parent.name.startswith('aten::')))]
        r['ops_per_call'] = len(top) / calls
    return r


# ----------------------------------------------------------------------------- what a run writes

def md_row(cells):
    return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def md_table(headers, rows):
    return '\n'.join([md_row(headers), '|' + '---|' * len(headers)] + [md_row(r) for r in rows])


def write_json(obj, path):
    write_text(json.dumps(obj, indent=1), path)


def write_text(text, path):
    """Atomically (cli.write_atomically): a reader never sees half a file, and an interrupted or
    failed write leaves no temporary file."""
    def write(tmp):
        with open(tmp, 'w') as f:
            f.write(text)
    write_atomically(path, write, 'results file')


class Tee:
    """stdout that is also kept: the tables as printed, for RESULTS.md."""

    def __init__(self, stream):
        self.stream, self.parts = stream, []

    def write(self, text):
        self.parts.append(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def text(self):
        return ''.join(self.parts)


def results_md(meta, tables):
    """RESULTS.md: the tables as this run printed them, under what made them."""
    return (f"# Results\n\nMade by `{meta['command']}` at commit {meta['git_commit'][:7] or 'unknown'} on "
            f"{meta['machine']} ({meta['device_name']}, {meta['cpu_count']} cores, {meta['threads']} threads), torch "
            f"{meta['torch']}, decoding in {meta['precision']}; {meta['seconds']:.0f} s in all. Written by bench.py "
            f"with results.json beside it; not edited by hand.\n{tables}")


def device_name(device):
    if torch.device(device).type == 'cuda':
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def command_line(script, argv):
    """How a run was started, as its results record it: `python script flags` (argv None: this
    process's own flags)."""
    return shlex.join(['python', script] + (sys.argv[1:] if argv is None else [str(a) for a in argv]))


def meta(args, device, precision):
    """What made a run's figures: args.command (command_line), the commit, machine, torch, threads."""
    try:
        commit = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ''
    return dict(command=args.command, machine=platform.platform(), device=device,
                device_name=device_name(device), cpu_count=os.cpu_count(), torch=torch.__version__, git_commit=commit,
                threads=torch.get_num_threads(), precision=precision, args=vars(args))


def parse_list(flag, text, cast, ok, allowed):
    """A comma-separated flag: each item cast and ok(item), else one line saying what is allowed."""
    try:
        items = [cast(x.strip()) for x in text.split(',')]
    except ValueError:
        items = []
    if not items or not all(ok(x) for x in items) or len(set(items)) < len(items):
        raise BadInput(f"{flag} {text!r}: comma-separated, each once, {allowed}")
    return items


# ----------------------------------------------------------------------------- a peer: Hugging Face

def to_hf(model):
    """The target as transformers' GPT2LMHeadModel, the same function (an optional peer for bench.py:
    None where transformers is not installed). GPT-2's Conv1D keeps its weights as (in, out), nn.Linear's
    transposed; the GELU is the exact (erf) one, as model.MLP's; a target without biases gets zeros."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    c = model.config
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                    n_layer=c.n_layer, n_head=c.n_head, activation_function='gelu', resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, bos_token_id=None,
                                    eos_token_id=None, pad_token_id=None, tie_word_embeddings=True))
    weights = {n: t.t() if n.endswith(('c_attn.weight', 'c_proj.weight', 'c_fc.weight')) else t
               for n, t in model.state_dict().items()}
    own = hf.state_dict()
    weights.update({n: torch.zeros_like(t) for n, t in own.items() if n.endswith('.bias') and n not in weights})
    hf.load_state_dict({n: weights[n] for n in own if n in weights}, strict=False)
    return hf.to(model.lm_head.weight.device, model.lm_head.weight.dtype).eval()


def hf_generate(hf, prompt, max_new, temperature=0.0, seed=0, **how):
    """transformers' generate on prompt (1, T0): greedy or sampled at T (top-k and top-p off, as
    here), exactly max_new tokens; how: prompt_lookup_num_tokens= / max_matching_ngram_size=, or
    assistant_model=. Returns (out, the target's forward calls)."""
    calls = [0]
    hook = hf.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = hf.generate(prompt, max_new_tokens=max_new, min_new_tokens=max_new, **sampling, **how)
    finally:
        hook.remove()
    return out, calls[0]


def hf_assistant(draft, k):
    """A draft model as transformers' assistant_model drafting k-1 tokens a call, as DraftModel does
    (its default schedule changes the number with what was accepted)."""
    hf = to_hf(draft)
    hf.generation_config.num_assistant_tokens = k - 1
    hf.generation_config.num_assistant_tokens_schedule = 'constant'
    hf.generation_config.assistant_confidence_threshold = 0.0
    return hf
