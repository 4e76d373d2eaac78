"""
The loop every training stage of train.py runs, and what it runs on: the Runtime (device, the
DDP process group torchrun starts, precision, seeds), AdamW with warm-up and cosine decay,
progress readable on a terminal and in a log file, periodic atomic checkpoints, --resume (each
stage's checkpoint checked against this run's flags before any step), and train.py's command line
(every flag once, in FLAGS; the presets' values stay in train.py).

A reader of the training objectives needs none of it: train.py says what each stage learns, and
from what data; this file, how any stage is stepped. The loop is nanoGPT's (AdamW, warm-up then
cosine decay, gradient clipping, DDP), written once for every stage.
"""
import argparse
import gc
import math
import os
import re
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from cli import (DTYPES, ArgumentParser, BadInput, CoreWatch, Precision, check_number, first_line, free_cores,
                 pick_device, pick_dtype)
from data import check_finite, is_whole, load_checkpoint
from dblast import LOSSES


# ----------------------------------------------------------------------------- the runtime

class Runtime:
    """Device, precision, randomness and the DDP process group (torchrun sets RANK / WORLD_SIZE)."""

    def __init__(self, device=None, seed=1337, dtype='float32'):
        self.ddp = int(os.environ.get('RANK', -1)) != -1
        if self.ddp:
            self.rank = int(os.environ['RANK'])
            self.world = int(os.environ['WORLD_SIZE'])
            local = int(os.environ.get('LOCAL_RANK', 0))
            use_cuda = torch.cuda.is_available() and device != 'cpu'
            # device_id binds NCCL to this rank's GPU at once (no guessing at the first collective)
            dist.init_process_group(backend='nccl' if use_cuda else 'gloo',
                                    **(dict(device_id=torch.device('cuda', local)) if use_cuda else {}))
            self.device = f'cuda:{local}' if use_cuda else 'cpu'
            if use_cuda:
                torch.cuda.set_device(self.device)
        else:
            self.rank, self.world = 0, 1
            self.device = pick_device(device)
        self.master = self.rank == 0
        self.kind = torch.device(self.device).type
        # training steps: `dtype` (bf16 by autocast) and, on CUDA, TF32 for what stays float32.
        # What feeds or judges decoding (the target's data for the drafters, their evaluation, the
        # demos) runs at decoding's float32 instead, so drafters learn from and are judged on the
        # numbers decoding will show them (decoding_precision).
        self.precision = Precision(dtype, self.device, tf32=self.kind == 'cuda')
        torch.manual_seed(seed + self.rank)
        # batch sampling, per rank: `gen` draws corpus windows (the text stays on the host), `dgen`
        # draws indices into what lives on the device, there, so no step waits on a host copy
        self.gen = torch.Generator().manual_seed(seed + self.rank)
        self.dgen = self.gen if self.kind == 'cpu' else torch.Generator(self.device).manual_seed(seed + self.rank)

    def to_device(self, batch):
        """A host batch to the device without a stall: pinned, then copied asynchronously (a copy
        from pageable memory waits for the device's queue to drain first)."""
        if self.kind == 'cuda':
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def all_finite(self, loss):
        """Whether the loss is finite on every rank, decided together: a rank that raised alone
        would leave the others waiting in their next all-reduce until the NCCL timeout."""
        bad = (~torch.isfinite(loss.detach())).float()
        if self.ddp:
            dist.all_reduce(bad)
        return not bool(bad)

    def rng_states(self):
        """Every rank's RNG states (batch sampler and torch), so a resumed DDP run gives each
        rank its own stream back."""
        mine = (self.gen.get_state(), torch.get_rng_state(), self.dgen.get_state().cpu())
        states = [mine]
        if self.ddp:
            states = [None] * self.world
            dist.all_gather_object(states, mine)
        return dict(gen=[s[0] for s in states], torch=[s[1] for s in states], dgen=[s[2] for s in states])

    def print(self, *a):
        if self.master:   # one write, newline included: under torchrun the ranks share one pipe
            tqdm.write(' '.join(str(x) for x in a) + '\n', end='')

    def all_done(self):
        """Wait for every rank at the end of a run. Gloo's worker threads can still hold work from
        the last collectives (DDP's reducer, the checkpoint's all_gather): torn down by the
        interpreter at exit, that was an intermittent SIGABRT ("terminate called without an active
        exception"). Release the work and wait for every rank, so that close() destroys the group
        while Python is fully alive."""
        if self.ddp:
            gc.collect()
            dist.barrier()

    def close(self):
        """The process group, destroyed (whether or not the run succeeded)."""
        if self.ddp and dist.is_initialized():
            dist.destroy_process_group()


# ----------------------------------------------------------------------------- progress

# A bar redraws itself with '\r' at every update: on a terminal that is one line, in a file or a
# pipe every update stays (hundreds a stage). Away from a terminal a bar is drawn at its start, at
# most every FILE_BAR_SECONDS after that, and at its end, each time on a line of its own.
FILE_BAR_SECONDS = 15


CURSOR_MOVE = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')   # a terminal's escape: cursor up, clear line


class Lines:
    """A bar's stream away from a terminal. tqdm redraws with '\r' and ends the line only when the
    bar closes: in a log file a whole stage is one line, which `tail` and log viewers show only at
    its end (its first draw, 0%, until then). Here each redraw is a line of its own, and the blank
    redraws tqdm makes to clear a bar before a message are left out, as are the cursor moves it
    makes to draw a bar inside another (the target's samples made inside a DBlast stage): in a
    file they are bytes a reader sees as '^[[A' lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        for line in CURSOR_MOVE.sub('', text).replace('\r', '\n').split('\n'):
            if line.strip():
                self.stream.write(line.rstrip() + '\n')

    def flush(self):
        self.stream.flush()


def progress(iterable, **kw):
    """tqdm, readable in a log file too: as it is on a terminal; elsewhere (stderr not a tty) a line
    at most every FILE_BAR_SECONDS seconds (Lines), without resizing to a terminal's width, and every
    bar's last state kept: a bar that a terminal erases when it ends (leave=False) would otherwise
    leave its first line, 0%, as the last word in a log."""
    if sys.stderr.isatty():
        return tqdm(iterable, dynamic_ncols=True, **kw)
    return tqdm(iterable, file=Lines(sys.stderr), mininterval=FILE_BAR_SECONDS, maxinterval=FILE_BAR_SECONDS,
                **{**kw, 'leave': True})


# ----------------------------------------------------------------------------- the loop

# how often a stage without --threads on a CPU looks at the cores other processes keep busy
FOLLOW_SECONDS = 10


def follow_load(rt, every=FOLLOW_SECONDS):
    """Without --threads, a run on a CPU takes its threads from the cores free when it starts
    (cli.intra_op_threads). A process started later then shares those cores, and on 2 cores two
    threads beside it wait for each other at every operation: the CPU preset's target went from 8
    steps a second to 1.2 (README, "Threads"). The check this returns, called at the loop's
    reads of the loss, measures the cores other processes kept busy over the last `every` seconds
    (cli.CoreWatch, without sleeping) and sets torch's threads to the cores left, up again when they
    free, with a line each time."""
    cores = os.cpu_count() or 1
    watch, since = CoreWatch(cores), time.perf_counter()

    def check():
        nonlocal since
        if time.perf_counter() - since < every:
            return
        since = time.perf_counter()
        busy = watch.busy()
        if busy is None:           # no /proc/stat: the threads stay as they are
            return
        want, have = free_cores(cores, busy), torch.get_num_threads()
        if want != have:
            torch.set_num_threads(want)
            rt.print(f"CPU threads: {have} -> {want} (other processes keep {busy:.1f} of {cores} cores busy)")
    return check


def lr_at(it, lr, warmup, total):
    """Linear warmup, then cosine decay to lr/10."""
    if it < warmup:
        return lr * (it + 1) / warmup
    ratio = min(1.0, (it - warmup) / max(1, total - warmup))
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - lr / 10)


def make_optimizer(module, lr, weight_decay, device_kind):
    """AdamW; decay only matrices (not biases, LayerNorm weights)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device_kind == 'cuda')


def train_loop(rt, args, name, objective, batch_fn, iters, lr, save, resume=None, evaluate=None,
               tokens_per_step=0, eval_name='held-out loss'):
    """The loop every stage shares: AdamW, warmup + cosine, clipping, tqdm, periodic atomic
    checkpoints. objective(*batch) -> loss trains whatever parameters require grad.
    evaluate(step) -> a float, printed as `eval_name` every eval_interval steps and at the end.
    save(optimizer_state, iter_num, rng_states) writes the stage's checkpoint (rank 0 only).
    Without --threads on a CPU, the threads follow the cores other processes leave (follow_load)."""
    model = objective
    if rt.ddp:
        model = DDP(objective, device_ids=[int(rt.device.split(':')[1])] if rt.kind == 'cuda' else None)
    opt = make_optimizer(objective, lr, args.weight_decay, rt.kind)
    start = 0
    if resume is not None:
        restore(rt, opt, resume, name)
        start = resume['iter_num']
        changed = changed_flags(resume.get('config'), vars(args))
        if changed:
            rt.print(f"{name}: resumed at step {start} of a run made with {changed}; the steps after it follow this "
                     f"run's flags")
    step = torch.compile(model) if args.compile else model
    follow = follow_load(rt) if args.threads is None and rt.kind == 'cpu' and not rt.ddp else None
    bar = progress(range(start, iters), desc=name, disable=not rt.master, initial=start, total=iters)
    t0, loss_val = time.perf_counter(), float('nan')
    with rt.precision.matmuls():   # TF32 for the training steps (CUDA); evaluations enter their own
        for it in bar:
            for g in opt.param_groups:
                g['lr'] = lr_at(it, lr, min(args.warmup_iters, iters // 10), iters)   # warm-up: a tenth at most
            batch = batch_fn()
            with rt.precision.autocast():
                loss = step(*batch)
            loss.backward()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(objective.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if it % 10 == 0 or it == iters - 1:
                if not rt.all_finite(loss):
                    raise BadInput(f"{name}: the loss became non-finite ({loss.item()} here) at step {it + 1}; stopped, "
                                   f"and the stage's checkpoint was left as it was (lower the learning rate or check "
                                   f"the data)")
                loss_val = loss.item()
                if follow is not None:
                    follow()
                dt = time.perf_counter() - t0
                t0 = time.perf_counter()
                tps = tokens_per_step * rt.world * (10 if it > start else 1) / max(dt, 1e-9)
                bar.set_postfix(loss=f'{loss_val:.3f}', lr=f'{opt.param_groups[0]["lr"]:.1e}',
                                **({'tok/s': f'{tps:.0f}'} if tokens_per_step else {}),
                                refresh=sys.stderr.isatty())   # in a file: the bar's own pace
            done = it + 1 == iters
            if evaluate is not None and ((it + 1) % args.eval_interval == 0 or done):
                rt.print(f"{name} step {it + 1}: train loss {loss_val:.4f}, {eval_name} {evaluate(it + 1):.4f}")
            if (it + 1) % args.ckpt_interval == 0 or done:
                # never replace a checkpoint with a worse one: non-finite weights stop the stage here
                check_finite(objective, f"{name}: training at step {it + 1} (checkpoint left as it was)")
                rng = rt.rng_states()   # collective under DDP: every rank takes part
                if rt.master:
                    save(opt.state_dict(), it + 1, rng)
    bar.close()
    return loss_val


# ----------------------------------------------------------------------------- resume

# flags that change nothing a stage learns: a resumed run may give others without a note
UNLEARNT = ('resume', 'out_dir', 'stages', 'threads', 'device', 'compile', 'no_demo', 'eval_interval', 'eval_iters',
            'ckpt_interval', 'preset')


def changed_flags(made_with, now):
    """The flags of a checkpoint's run (its config) that this run gives otherwise, as one phrase
    ('--lr 0.003, --seed 1': the checkpoint's values), '' where none is."""
    if not isinstance(made_with, dict):
        return ''
    return ', '.join(f"--{key.replace('_', '-')} {made_with[key]}" for key in sorted(now)
                     if key in made_with and key not in UNLEARNT and made_with[key] != now[key])


def restore(rt, opt, resume, name):
    """The optimizer's and the RNGs' states of a resumed stage, each checked against what this run
    holds before any step: one line if they do not fit, the checkpoint left as it was."""
    state = resume['optimizer']
    params = [p for g in opt.param_groups for p in g['params']]
    fits = [len(g['params']) for g in state['param_groups']] == [len(g['params']) for g in opt.param_groups] and all(
        is_whole(i, 0, len(params) - 1) and all(not isinstance(t, torch.Tensor) or t.dim() == 0
                                                 or t.shape == params[i].shape for t in st.values())
        for i, st in state['state'].items())
    if not fits:
        raise BadInput(f"--resume: {name}: the optimizer state in its checkpoint does not fit its weights; retrain "
                       f"the stage (without --resume) or use another --out-dir")
    try:
        opt.load_state_dict(state)
        gens = resume['rng']['gen']      # one batch-sampling state per rank
        if len(gens) == rt.world:
            rt.gen.set_state(gens[rt.rank])
            torch.set_rng_state(resume['rng']['torch'][rt.rank])
            if rt.dgen is not rt.gen and 'dgen' in resume['rng']:
                rt.dgen.set_state(resume['rng']['dgen'][rt.rank])
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BadInput(f"--resume: {name}: its checkpoint's optimizer or RNG state cannot be restored "
                       f"({first_line(e, type(e).__name__)}); retrain the stage or use another --out-dir")


class Mismatch(BadInput):
    """--resume found a checkpoint made with other settings: `path`, the field `key`, what it holds
    (`have`) and what this run needs (`want`). The message names train.py's flags; bench.py, which
    trains through train.py, names its own."""

    def __init__(self, path, key, have, want, flag):
        self.path, self.key, self.have, self.want = path, key, have, want
        super().__init__(f"--resume: {path} was made with {flag} ({key}={have}, this run: {want}); "
                         f"use the same flags or another --out-dir")


# what a resumed stage needs from its checkpoint, beyond the fields that must match
RESUMABLE = ('optimizer', 'iter_num', 'rng')


def resume_state(args, path, expect, weights='drafter', model_flags='--n-layer, ...'):
    """The checkpoint to resume from (None: start fresh). `expect`: fields that must match; every
    field a resume reads must be there (load_checkpoint has checked the types of those present).
    model_flags: the flags that make `model_args`, for the message when they differ."""
    if not args.resume or not os.path.exists(path):
        return None
    ckpt = load_checkpoint(path)
    flags = dict(model_args=f'other model flags ({model_flags})', trained_from='another target',
                 base_fingerprint='another target', joint='another --joint/--frozen', loss='another --dblast-loss',
                 K='another --branches', k='another --k' if 'K' not in expect else 'another --dblast-k')
    for key, want in expect.items():
        if ckpt.get(key) != want:
            raise Mismatch(path, key, ckpt.get(key), want, flags.get(key, 'another --' + key.replace('_', '-')))
    missing = [key for key in (weights,) + RESUMABLE if key not in ckpt]
    if missing:
        raise BadInput(f"--resume: {path} has no {missing[0]!r}, so it cannot be resumed; train the stage again "
                       f"without --resume, or use another --out-dir")
    return ckpt


def load_weights(module, weights, path):
    """A resumed module's weights, or one line naming the first that does not fit it."""
    want = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    held = {n: tuple(t.shape) for n, t in weights.items()}
    odd = sorted(set(want) ^ set(held)) or [n for n in want if want[n] != held[n]]
    if odd:
        raise BadInput(f"--resume: {path}: its weights do not fit this run's model ({odd[0]}: "
                       f"{held.get(odd[0], 'missing')}, want {want.get(odd[0], 'none')}); use the same flags or "
                       f"another --out-dir")
    module.load_state_dict(weights)


# ----------------------------------------------------------------------------- the command line

POS, GE0, GT0 = dict(lo=1), dict(lo=0.0), dict(lo=0.0, open_lo=True)
# Every flag of train.py, once: (name, the stage it belongs to (None: any run), type, default, the
# bounds check_number holds it to, help). A default of None is the preset's for a key of train.PRESETS,
# and its help says what it is for the others (--d-hidden: n_embd).
# type: int, float, str, a tuple of choices, bool (--x / --no-x), 'switch' (--x) or 'frozen|joint'.
# A stage's flag given when that stage does not run is refused.
FLAGS = [
    ('data', None, str, None, None, 'text file or folder of text files (default: the stdlib .py files), '
                                    'or a nanoGPT dataset folder (train.bin, val.bin, meta.pkl)'),
    ('meta', None, str, None, None, "nanoGPT meta.pkl of the target (default: the dataset's, or where "
                                    "nanoGPT's sample.py looks)"),
    ('out_dir', None, str, 'out', None, 'checkpoints, and the cached corpus and target samples'),
    ('stages', None, str, 'base,heads,dblast', None, 'comma list of base, heads, dblast, draft'),
    ('preset', None, ('auto', 'cpu', 'quick', 'gpu'), 'auto', None, 'defaults by device (quick: a small target '
                                                                 'in minutes on a CPU, for `python -m exercises try`)'),
    ('device', None, str, None, None, 'cpu | cuda | mps (default: best available)'),
    ('compile', None, 'switch', False, None, 'torch.compile the training step'),
    ('dtype', None, DTYPES, 'auto', None, 'training precision (auto: bfloat16 autocast on a CUDA device that '
                                          'supports it, else float32; bfloat16 runs on a CPU too; on CUDA the '
                                          'training steps let float32 matmuls use TF32). The data the target makes '
                                          'for the drafters, their evaluation and the demos run in float32 without '
                                          'TF32, as decoding does'),
    ('resume', None, 'switch', False, None, 'continue interrupted stages, skip finished ones'),
    ('seed', None, int, 1337, dict(lo=0, hi=2 ** 63 - 1), None),
    ('threads', None, int, None, dict(lo=1, hi=1024), "CPU threads (default: the cores not already busy, from "
                                                      "/proc/stat over 0.2 s, and read again every 10 s as a "
                                                      "stage trains)"),
    ('tag', None, str, '', None, 'suffix of the drafter checkpoint names (heads{tag}.pt, dblast_K4{tag}.pt)'),
    ('batch_size', None, int, None, POS, None),
    ('warmup_iters', None, int, None, dict(lo=0), None),
    ('eval_interval', None, int, None, POS, None),
    ('weight_decay', None, float, 0.1, GE0, None),
    ('grad_clip', None, float, 1.0, GE0, '0 = no clipping'),
    ('ckpt_interval', None, int, 250, POS, None),
    ('d_hidden', None, int, None, POS, "the drafters' hidden width per head (default: n_embd)"),
    ('no_demo', None, 'switch', False, None, 'skip the closing demos'),
    ('n_layer', 'base', int, None, POS, None),
    ('n_head', 'base', int, None, POS, None),
    ('n_embd', 'base', int, None, POS, None),
    ('block_size', 'base', int, None, dict(lo=2), 'the context, in tokens'),
    ('dropout', 'base', float, 0.0, dict(lo=0.0, hi=1.0, open_hi=True), None),
    ('bias', 'base', bool, True, None, None),
    ('max_iters', 'base', int, None, POS, None),
    ('lr', 'base', float, None, GT0, None),
    ('eval_iters', 'base', int, None, POS, None),
    ('k', 'heads', int, 8, dict(lo=2, hi=64), 'block size: 1 bonus + k-1 drafted tokens'),
    ('joint', 'heads', 'frozen|joint', False, None, None),
    ('loss', 'heads', ('random-offset', 'full'), 'random-offset', None, None),
    ('distill', ('heads', 'draft'), bool, True, None, "train on the target's own greedy continuations (default "
                                                      "on)"),
    ('heads_iters', 'heads', int, None, POS, None),
    ('heads_lr', 'heads', float, None, GT0, None),
    ('distill_samples', ('heads', 'draft'), int, None, POS, None),
    ('draft_layers', 'draft', int, 1, POS, "the draft model's layers"),
    ('draft_embd', 'draft', int, None, POS, "the draft model's width (default: half the target's)"),
    ('draft_iters', 'draft', int, None, POS, None),
    ('draft_lr', 'draft', float, None, GT0, None),
    ('branches', 'dblast', int, 4, dict(lo=1, hi=256), 'K, the latent branches of the DBlast mixture (the K=1 '
                                                         'baseline is trained too)'),
    ('dblast_k', 'dblast', int, 4, dict(lo=2, hi=64), 'block size of the DBlast drafters'),
    ('dblast_loss', 'dblast', LOSSES, 'al', None, "al: acceptance-length surrogate on the mixture's "
                                                  "conditionals (default); al-branch: on branch-conditional "
                                                  "acceptance (ablation); nll: mixture NLL"),
    ('baseline_loss', 'dblast', LOSSES + ('none',), 'nll', None, 'loss of the K=1 baseline (default nll: the '
                                                                  'independent drafter DBlast compares with; '
                                                                  'none: no baseline)'),
    ('tau_threshold', 'dblast', float, 0.01, dict(lo=0.0, hi=1.0), 'AL surrogate threshold eta: keep prefixes with '
                                                                   'a_j >= log eta'),
    ('nll_weight', 'dblast', float, 0.2, GE0, 'weight of the mixture NLL added to the AL loss (keeps every '
                                              'branch learning)'),
    ('temperature', 'dblast', float, 1.5, GT0, 'sampling temperature of the training blocks'),
    ('dblast_iters', 'dblast', int, None, POS, None),
    ('dblast_lr', 'dblast', float, 3e-3, GT0, None),
    ('dblast_samples', 'dblast', int, None, POS, 'target samples to train on'),
    ('dblast_eval_samples', 'dblast', int, None, POS, 'held-out target samples for the expected-tau evaluation'),
]
STAGES = ('base', 'heads', 'dblast', 'draft')


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """--help as written, each flag's default added where its help does not give it (a switch's
    False, None and '' are no defaults to show)."""
    def _get_help_string(self, action):
        d = action.default
        shown = d is not None and d is not False and d != '' and d is not argparse.SUPPRESS
        return action.help + (' (default: %(default)s)' if shown and '(default' not in action.help else '')


def build_parser(presets, description):
    """train.py's parser: FLAGS in a group per stage, each default shown, by preset where presets
    (train.PRESETS) hold it."""
    ap = ArgumentParser(description=description, formatter_class=HelpWithDefaults)
    groups = {None: ap, 'base': ap.add_argument_group('base stage (the target)'),
              'heads': ap.add_argument_group('heads stage (BPD heads)'),
              'dblast': ap.add_argument_group('dblast stage (DBlast drafters)'),
              'draft': ap.add_argument_group('draft stage (a small draft model; --distill applies too)')}
    for name, stage, typ, default, _, text in FLAGS:
        g, flag = groups[stage if stage is None or isinstance(stage, str) else stage[0]], '--' + name.replace('_', '-')
        if default is None and name in presets['cpu']:   # each preset's value, as --preset picks them
            by_preset = ', '.join(f"{preset} {values[name]:g}" for preset, values in presets.items())
            text = f"{text + ' ' if text else ''}(default by --preset: {by_preset})"
        elif not text and default is not None and default is not False:
            text = '(default: %(default)s)'          # argparse shows no help, nor a default, for a flag without help
        if typ == 'frozen|joint':
            mode = g.add_mutually_exclusive_group()
            mode.add_argument('--frozen', dest='joint', action='store_false', help='train only the heads (default)')
            mode.add_argument('--joint', dest='joint', action='store_true', help='fine-tune the target too')
            g.set_defaults(joint=False)
        elif typ == 'switch':
            g.add_argument(flag, action='store_true', help=text)
        elif typ is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif isinstance(typ, tuple):
            g.add_argument(flag, choices=typ, default=default, help=text)
        else:
            g.add_argument(flag, type=typ, default=default, help=text)
    return ap


def parse_flags(argv, presets, description):
    """The flags, with the preset's defaults (presets[--preset]) filled in, every one checked before
    any work."""
    ap = build_parser(presets, description)
    for a in (sys.argv[1:] if argv is None else argv):   # renamed: --K and --k were one key apart
        if a == '--K' or a.startswith('--K='):
            raise BadInput("--K is now --branches (K, the DBlast mixture's branches; --k is the heads' block size)")
    # argparse fills in a default only where the namespace has no value yet: so every flag still
    # holding this marker afterwards was not given
    unset = object()
    dests = {a.dest for a in ap._actions} - {'help'}
    args = ap.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(dests, unset)))
    given = {dest for dest in dests if getattr(args, dest) is not unset}
    for dest in dests - given:
        setattr(args, dest, ap.get_default(dest))
    args.stages = [s.strip() for s in args.stages.split(',') if s.strip()]
    if set(args.stages) - set(STAGES) or not args.stages:
        raise BadInput(f"--stages {','.join(args.stages) or repr('')}: allowed: {', '.join(STAGES)} (comma list)")
    for name, stage, *_ in FLAGS:
        stages = (stage,) if isinstance(stage, str) else stage or ()
        if name in given and stages and not set(stages) & set(args.stages):
            raise BadInput(f"--{name.replace('_', '-')} means nothing here: it applies to the {' and '.join(stages)} "
                           f"stage{'s' * (len(stages) > 1)}, which --stages {','.join(args.stages)} does not run")
    device = pick_device(args.device)
    args.dtype = pick_dtype(args.dtype, device, training=True)
    preset = args.preset
    if preset == 'auto':
        preset = 'gpu' if torch.device(device).type == 'cuda' else 'cpu'
    for key, v in presets[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, v)
    args.preset = preset
    for name, _, _, _, bounds, _ in FLAGS:
        if bounds is not None and getattr(args, name) is not None:   # --d-hidden may stay None (n_embd)
            check_number('--' + name.replace('_', '-'), getattr(args, name), **bounds)
    if args.n_embd % args.n_head:
        raise BadInput(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    if not args.tag.replace('_', '').replace('-', '').replace('.', '').isalnum() and args.tag:
        raise BadInput(f"--tag {args.tag!r}: use letters, digits, '.', '_' and '-' (it names files)")
    if 'tag' in given and args.stages == ['base']:   # what only drafters have
        raise BadInput("--tag means nothing here: it names the drafters' files (--stages heads, dblast or draft), "
                       "which --stages base does not train")
    if 'd_hidden' in given and not {'heads', 'dblast'} & set(args.stages):
        raise BadInput(f"--d-hidden means nothing here: it sizes the block head of --stages heads or dblast, which "
                       f"--stages {','.join(args.stages)} does not train")
    if args.meta and 'base' in args.stages:
        raise BadInput("--meta means nothing with the base stage: the target's vocabulary is its data's (bytes for "
                       "text, a nanoGPT folder's own meta.pkl); it applies to --stages heads,dblast on a target "
                       "that records none")
    if args.meta and not os.path.isfile(args.meta):
        raise BadInput(f"--meta {args.meta}: no such file")
    return args
