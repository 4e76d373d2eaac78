"""
train.py, generate.py and bench.py given bad input, the way a user gives it: every row of CASES is one
command line and what it must do.

  refused      exit code 2; stderr has exactly one line starting with `error:` (no argparse usage
               dump), that line names the flag or file the user gave (and none the script lacks),
               and there is no Traceback; no checkpoint (*.pt) in the out folder changed, and no
               new one appeared
  accepted     exit code 0, no Traceback, no `error:` line (e.g. a FIFO in a data folder is skipped)
  interrupted  Ctrl-C (SIGINT) while it works: exit code 130, no Traceback, and a last line that
               says what to do next; the checkpoint written so far still loads

Whatever a case does, it leaves no half-written file (*.tmp) in its folder or the shared run. The
classes of hostile input each have their rows: numbers and bounds, choices and names, flags that
mean nothing in the mode given, files and folders (FIFOs, unreadable, a folder or a read-only file
where a checkpoint goes, nanoGPT folders missing a split or with an odd byte count), crafted
checkpoints (a field of the wrong type or range, a config that does not fit the weights it comes
with, a pickle that would run code), and Ctrl-C.

Most cases run in this process, through the same `main(argv)` and `run_script` a script runs
(stdout and stderr captured, CUDA hidden, the RNGs and working directory restored afterwards): an
exception that escapes would be a traceback in a real run, and is reported as one. Real processes
(`process=True`) are kept for what only they show: Ctrl-C, the exit code and stderr end to end
(one case a script), and FIFOs, where a regression would hang (a process gets TIMEOUT seconds;
running out of time fails its case). A crafted pickle (a checkpoint or meta.pkl whose unpickling
would create a marker file) must be refused without running: the marker file must not exist
afterwards, whichever process would have run it.

How it runs: one tiny training run (ckpt.pt, heads.pt, dblast_K4.pt, dblast_K1.pt) and the crafted
files are made once for the module (the `paths` fixture); the `results` fixture then runs every
selected case, the real processes two at a time beside the in-process ones, and stores what each
did; each case is its own test id that asserts on its stored result. Cases that could write get
their own folder: a fresh copy of the trained run ('copy') or an empty folder ('fresh'); the others
may only read the shared trained run, whose checkpoints are checked after every case and at the end.

    python -m pytest -q tests/test_cli.py                 # everything
    python -m pytest -q tests/test_cli.py -k decode       # only generate.py's cases (only they run)
"""
import hashlib
import os
import pickle
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from bench import main as bench_main
from conftest import ROOT, corpus_text, in_process, sigint_at_default
from data import Vocab
from generate import colour_blocks, merged_stats
from generate import main as generate_main
from model import GPT, GPTConfig
from train import main as train_main

pytestmark = pytest.mark.slow   # every case: the quick tier keeps the scripts' own tests of bad input

TIMEOUT = 90          # seconds any one process may take; more is a hang
WORKERS = 2           # real processes at a time (beside the in-process cases)
MAINS = {'train.py': train_main, 'generate.py': generate_main, 'bench.py': bench_main}
IS_ROOT = hasattr(os, 'geteuid') and os.geteuid() == 0


# ----------------------------------------------------------------------------- the table

@dataclass
class Case:
    id: str
    argv: list                      # the script and its flags; '{name}' is filled in from the paths
    code: int = 2                   # 2 refused, 0 accepted, 130 interrupted
    needles: tuple = ()             # what the error line (130: the last line) must contain
    out: str = 'run'                # the folder whose checkpoints are watched: 'run' (the shared trained
                                    # run, only read), 'copy' (a fresh copy of it), 'fresh' (an empty one)
    prepare: Optional[Callable] = None      # prepare(paths): sets up the case's folder before the run
    marker: Optional[str] = None            # a crafted pickle's payload would create this file
    within: float = TIMEOUT                 # seconds the answer must come within
    interrupt: Optional[Callable] = None    # interrupt(proc, paths): waits until the process is under
                                            # way; then Ctrl-C (SIGINT) is sent
    only_line: bool = False                 # stderr holds nothing but the final line
    output_has: Optional[str] = None        # stdout + stderr must contain this
    after: Optional[Callable] = None        # after(paths): more checks once the process is done
    needs_non_root: bool = False            # permission bits mean nothing to root
    process: bool = False                   # run as a real process (see the module's docstring)
    not_in: tuple = ()                      # what the error line must not say (flags the script lacks)

    def __post_init__(self):   # what only a real process shows
        fifo = any('fifo' in a for a in self.argv if isinstance(a, str))
        self.process = self.process or bool(self.interrupt) or fifo

    def __repr__(self):
        return f"Case({self.id!r})"


def refused(id, argv, *needles, **kw):
    return Case(id, argv, 2, needles, **kw)


def accepted(id, argv, **kw):
    return Case(id, argv, 0, **kw)


# train.py at tiny sizes. Only the flags of the stages it runs are given (it refuses the others);
# a case's own flags come last and win (argparse keeps the last value of a flag).
COMMON = ['--device', 'cpu', '--no-demo', '--data', '{corpus}', '--batch-size', '4', '--eval-interval', '1000',
          '--warmup-iters', '2']
STAGE_FLAGS = {
    'base': ['--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64', '--max-iters', '20',
             '--eval-iters', '1'],
    'heads': ['--k', '4', '--heads-iters', '5', '--distill-samples', '4'],
    'dblast': ['--dblast-iters', '5', '--dblast-samples', '4', '--dblast-eval-samples', '2'],
    'draft': ['--draft-iters', '5', '--distill-samples', '4'],
}
ALL_STAGES = 'base,heads,dblast'


def train(*flags, stages=ALL_STAGES, out='{copy}'):
    """train.py's argv: the tiny sizes of `stages`, writing to `out`, then `flags`."""
    argv = ['train.py', *COMMON, '--out-dir', out, '--stages', stages]
    for stage in stages.split(','):
        argv += STAGE_FLAGS[stage]
    return argv + list(flags)


def train_refused(id, flags, *needles, stages=ALL_STAGES, **kw):
    """train.py on a fresh copy of the trained run: a refusal must leave its checkpoints as they were."""
    kw.setdefault('out', 'copy')
    return refused('train-' + id, train(*flags, stages=stages), *needles, **kw)


def decode(*flags):
    return ['generate.py', '--device', 'cpu', '--ckpt', '{ckpt}', '--max-new-tokens', '8', *flags]


def decode_refused(id, flags, *needles, **kw):
    return refused('decode-' + id, decode(*flags), *needles, **kw)


BENCH = ['bench.py', '--device', 'cpu', '--data', '{corpus}', '--out', '{out}/bench', '--ckpt-dir', '{out}/ckpt',
         '--tables', 'speed', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64',
         '--batch-size', '4', '--max-iters', '20', '--heads-iters', '4', '--dblast-iters', '4',
         '--distill-samples', '4', '--dblast-samples', '4', '--dblast-eval-samples', '2', '--n-prompts', '2',
         '--max-new', '16', '--repeats', '1', '--eval-samples', '2']


def bench_refused(id, flags, *needles, **kw):
    """bench.py in an empty folder: refused before any training, so no checkpoint appears there."""
    return refused('bench-' + id, BENCH + list(flags), *needles, out='fresh', **kw)


# --------------------------------------------------------------------- set-ups and checks of cases

def copy_over(name, source):
    """prepare: the copy's checkpoint `name` replaced by the crafted file `source`."""
    def prepare(p):
        shutil.copyfile(fill(source, p), os.path.join(p['copy'], name))
    return prepare


def crafted_over(name, change):
    """prepare: the copy's checkpoint `name` loaded, changed by change(ckpt dict) and saved over itself."""
    def prepare(p):
        path = os.path.join(p['copy'], name)
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
        change(ckpt)
        torch.save(ckpt, path)
    return prepare


def folder_over(name):
    """prepare: a folder in the place of the copy's checkpoint `name` (it cannot be replaced, even by root)."""
    def prepare(p):
        os.remove(os.path.join(p['copy'], name))
        os.makedirs(os.path.join(p['copy'], name, 'inside'))
    return prepare


def read_only_file(name):
    """prepare: the copy's checkpoint `name` made read-only (root may still write it: needs_non_root)."""
    def prepare(p):
        os.chmod(os.path.join(p['copy'], name), 0o444)
    return prepare


def payload_over(name):
    """prepare: the copy's checkpoint `name` replaced by a crafted pickle (marker: {work}/payload-ran)."""
    def prepare(p):
        write_payload_checkpoint(os.path.join(p['copy'], name), os.path.join(p['work'], 'payload-ran'))
    return prepare


def when_exists(path, timeout=TIMEOUT - 20):
    """interrupt: wait until `path` exists (or the process ended, or `timeout` passed)."""
    def wait(proc, p):
        deadline = time.monotonic() + timeout
        while not os.path.exists(fill(path, p)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    return wait


def when_torch_loads(proc, p, timeout=TIMEOUT - 30):
    """interrupt: wait until torch's library is mapped into the process, that is while the script is
    still importing (or, on a fast machine, just after): a Ctrl-C there must end the same way as
    later, one line and exit code 130. An event, not a time: it holds however busy the machine."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(f'/proc/{proc.pid}/maps') as f:
                if 'libtorch' in f.read():
                    return
        except OSError:
            pass
        time.sleep(0.01)


def still_loads(path):
    """after: the checkpoint at `path` loads as tensors and plain values and holds a model."""
    def check(p):
        ckpt = torch.load(fill(path, p), map_location='cpu', weights_only=True)
        assert 'model' in ckpt and ckpt['iter_num'] > 0, f"{fill(path, p)} is not a usable checkpoint"
    return check


# ----------------------------------------------------------------------------- the cases

NOT_UTF8 = b'\xff\xfe def'   # a command-line argument that is not UTF-8 (passed as bytes)

CASES = [
    # ------------------------------------------------------------------ train.py: numbers and bounds
    *[train_refused(f'{flag[2:]}-{name}', [flag, value], flag) for flag, values in [
        ('--weight-decay', dict(nan='nan', neg='-1')),
        ('--lr', dict(neg='-1', zero='0', nan='nan', inf='inf')),
        ('--heads-lr', dict(zero='0', nan='nan')),
        ('--dblast-lr', dict(neg='-1', inf='inf')),
        ('--temperature', dict(nan='nan', zero='0', neg='-1', inf='inf')),
        ('--dropout', dict(big='1.5', neg='-0.1', one='1')),
        ('--batch-size', dict(zero='0')),
        ('--max-iters', dict(zero='0')),
        ('--ckpt-interval', dict(zero='0')),
        ('--eval-interval', dict(zero='0')),
        ('--eval-iters', dict(zero='0')),
        ('--warmup-iters', dict(neg='-1')),
        ('--n-layer', dict(zero='0')),
        ('--n-head', dict(zero='0')),
        ('--n-embd', dict(zero='0')),
        ('--block-size', dict(one='1')),
        ('--k', dict(one='1', big='100', past='65')),       # past: one past the bound
        ('--dblast-k', dict(one='1')),
        ('--branches', dict(zero='0', past='257')),
        ('--threads', dict(past='1025')),
        ('--tau-threshold', dict(big='2', neg='-1')),
        ('--nll-weight', dict(neg='-1')),
        ('--grad-clip', dict(neg='-1')),
        ('--seed', dict(neg='-1', huge='99999999999999999999999')),
        ('--distill-samples', dict(zero='0')),
        ('--dblast-samples', dict(zero='0')),
        ('--heads-iters', dict(zero='0')),
        ('--dblast-iters', dict(zero='0')),
        ('--d-hidden', dict(zero='0')),
    ] for name, value in values.items()],
    train_refused('n-embd-not-divisible', ['--n-embd', '30', '--n-head', '4'], '--n-embd'),
    train_refused('batch-size-not-a-number', ['--batch-size', 'abc'], '--batch-size'),
    train_refused('old-flag-K', ['--K', '4'], '--K is now --branches'),
    train_refused('unknown-flag', ['--bogus-flag', '3'], '--bogus-flag', process=True),   # end to end
    # ------------------------------------------------------------------ train.py: choices and names
    train_refused('stages-empty', ['--stages', ''], '--stages'),
    train_refused('stages-bogus', ['--stages', 'bogus'], '--stages'),
    train_refused('tag-slash', ['--tag', 'a/b'], '--tag'),
    train_refused('device-bogus', ['--device', 'bogus'], '--device'),
    train_refused('device-cuda', ['--device', 'cuda'], '--device'),   # CUDA is hidden from every case
    train_refused('device-mps', ['--device', 'mps'], '--device'),
    train_refused('preset-bogus', ['--preset', 'bogus'], '--preset'),
    train_refused('dtype-bogus', ['--dtype', 'float16'], '--dtype'),
    # ------------------------------------------------------------------ train.py: flags no stage run uses
    train_refused('base-with-k', ['--k', '4'], '--k', stages='base'),
    train_refused('heads-with-temperature', ['--temperature', '1.0'], '--temperature', stages='heads'),
    train_refused('dblast-with-n-layer', ['--n-layer', '2'], '--n-layer', stages='dblast'),
    # ------------------------------------------------------------------ train.py: context too short
    train_refused('k-40-block-64', ['--k', '40'], '--k'),
    train_refused('k-4-block-one-short', ['--k', '4', '--block-size', '37'], 'at least 38', stages='base,heads'),
    train_refused('dblast-k-40-context-64', ['--dblast-k', '40'], '--dblast-k', stages='dblast'),
    # ------------------------------------------------------------------ train.py: files and folders
    train_refused('data-missing', ['--data', '{work}/no_such_corpus.txt'], '{work}/no_such_corpus.txt'),
    train_refused('data-fifo', ['--data', '{files}/a_fifo'], '{files}/a_fifo'),
    train_refused('data-dev-zero', ['--data', '/dev/zero'], '/dev/zero'),
    train_refused('data-unreadable-file', ['--data', '/proc/self/mem'], '/proc/self/mem'),  # EIO, even for root
    train_refused('data-chmod-000-file', ['--data', '{files}/unreadable.txt'], '{files}/unreadable.txt',
                  needs_non_root=True),
    train_refused('data-chmod-000-folder', ['--data', '{files}/unreadable_dir'], '{files}/unreadable_dir',
                  needs_non_root=True),
    train_refused('data-only-broken-symlink', ['--data', '{files}/broken_only'], '{files}/broken_only'),
    train_refused('data-nanogpt-crafted-meta', ['--data', '{files}/nanogpt_crafted'],
                  '{files}/nanogpt_crafted/meta.pkl', marker='{files}/payload-nanogpt-meta'),
    refused('train-out-dir-is-a-file', train(out='{files}/a_file.txt'), '{files}/a_file.txt'),
    refused('train-out-dir-unwritable', train(out='/proc/cli-test-out'), '/proc/cli-test-out'),
    refused('train-out-dir-in-read-only-folder', train(out='{files}/read_only/out'), '{files}/read_only/out',
            out='fresh', needs_non_root=True),
    train_refused('meta-missing', ['--meta', '{work}/no_such_meta.pkl'], '{work}/no_such_meta.pkl', stages='heads'),
    train_refused('heads-meta-crafted', ['--meta', '{files}/crafted_train_meta.pkl'],
                  '{files}/crafted_train_meta.pkl', stages='heads', marker='{files}/payload-train-meta'),
    train_refused('heads-crafted-base', [], 'ckpt.pt', stages='heads', prepare=payload_over('ckpt.pt'),
                  marker='{work}/payload-ran'),
    train_refused('resume-other-d-hidden', ['--resume', '--d-hidden', '8'], '--resume', 'heads.pt', stages='heads'),
    train_refused('resume-truncated-base', ['--resume'], 'ckpt.pt', stages='base',
                  prepare=copy_over('ckpt.pt', '{files}/truncated.pt')),
    # ------------------------------------------------------------------ train.py: odd entries in a data folder
    *[accepted(f'train-data-folder-with-{kind}',
               train('--max-iters', '1', '--data', f'{{files}}/{kind}_data', stages='base', out='{out}/run'),
               out='fresh', output_has='skipped') for kind in ('fifo', 'socket', 'broken-symlink')],
    # ------------------------------------------------------------------ train.py: Ctrl-C
    Case('train-ctrl-c', train('--max-iters', '100000', '--ckpt-interval', '5', stages='base', out='{out}/run'),
         130, ('--resume',), out='fresh', interrupt=when_exists('{out}/run/ckpt.pt'),
         after=still_loads('{out}/run/ckpt.pt')),

    # ------------------------------------------------------------------ generate.py: numbers
    decode_refused('temperature-nan', ['--temperature', 'nan'], '--temperature'),
    decode_refused('temperature-neg', ['--temperature', '-1'], '--temperature'),
    decode_refused('temperature-inf', ['--temperature', 'inf'], '--temperature'),
    decode_refused('max-new-tokens-zero', ['--max-new-tokens', '0'], '--max-new-tokens'),
    decode_refused('max-new-tokens-neg', ['--max-new-tokens', '-5'], '--max-new-tokens'),
    decode_refused('max-new-tokens-beyond-context', ['--max-new-tokens', '100000'], '--max-new-tokens'),
    decode_refused('seed-neg', ['--seed', '-1'], '--seed'),
    decode_refused('dtype-bogus', ['--dtype', 'half'], '--dtype'),
    decode_refused('tf32-on-cpu', ['--tf32'], '--tf32'),
    accepted('decode-bf16-on-cpu', decode('--dtype', 'bfloat16', '--heads', '{heads}'), output_has='(bfloat16 autocast)'),
    decode_refused('seed-huge', ['--seed', '99999999999999999999999'], '--seed'),
    decode_refused('heads-k-1', ['--heads', '{heads}', '--k', '1'], '--k'),
    decode_refused('heads-k-above-trained', ['--heads', '{heads}', '--k', '99'], '--k'),
    decode_refused('k-without-drafter', ['--k', '3'], '--k'),
    decode_refused('accept-without-drafter', ['--accept', 'topk:2'], '--accept'),
    decode_refused('accept-superscript-two', ['--heads', '{heads}', '--accept', 'topk:\u00b2'], '--accept'),
    decode_refused('accept-topk-0', ['--heads', '{heads}', '--accept', 'topk:0'], '--accept'),
    decode_refused('accept-minblock-huge', ['--heads', '{heads}', '--accept', 'minblock:99999999999999999999'],
                   '--accept'),
    decode_refused('accept-bogus', ['--heads', '{heads}', '--accept', 'bogus'], '--accept'),
    decode_refused('accept-lossy-sampling', ['--heads', '{heads}', '--accept', 'topk:2', '--temperature', '1'],
                   '--accept'),
    decode_refused('zt-neg', ['--drafter', '{dblast}', '--temperature', '1', '--zt', '-1'], '--zt'),
    decode_refused('zt-nan', ['--drafter', '{dblast}', '--temperature', '1', '--zt', 'nan'], '--zt'),
    decode_refused('paths-zero', ['--heads', '{heads}', '--paths', '0'], '--paths'),
    decode_refused('paths-huge', ['--heads', '{heads}', '--paths', '65'], '--paths'),
    decode_refused('nodes-zero', ['--heads', '{heads}', '--nodes', '0'], '--nodes'),
    decode_refused('nodes-huge', ['--heads', '{heads}', '--nodes', '1025'], '--nodes'),
    decode_refused('nodes-not-a-number', ['--heads', '{heads}', '--nodes', 'many'], '--nodes'),
    # ------------------------------------------------------------------ generate.py: flags that mean nothing here
    decode_refused('zt-with-heads', ['--heads', '{heads}', '--zt', '1'], '--zt'),
    decode_refused('verify-with-heads', ['--heads', '{heads}', '--verify', 'mixture'], '--verify'),
    decode_refused('paths-without-drafter', ['--paths', '2'], '--paths'),
    decode_refused('nodes-without-drafter', ['--nodes', '8'], '--nodes'),
    decode_refused('nodes-with-paths', ['--drafter', '{dblast}', '--temperature', '1', '--paths', '2', '--nodes', '8'],
                   '--nodes 8 and --paths 2'),
    decode_refused('nodes-lossy', ['--heads', '{heads}', '--accept', 'topk:2', '--nodes', '8'],
                   '--accept topk:2 with --nodes 8'),
    decode_refused('paths-from-with-heads', ['--heads', '{heads}', '--paths', '2', '--paths-from', 'branches'],
                   '--paths-from'),
    decode_refused('paths-from-one-path', ['--drafter', '{dblast}', '--temperature', '1', '--paths-from', 'branches'],
                   '--paths-from'),
    decode_refused('verify-with-branch-paths', ['--drafter', '{dblast}', '--temperature', '1', '--paths', '2',
                                                '--paths-from', 'branches', '--verify', 'branch'], '--verify'),
    decode_refused('sample-drafts-greedy', ['--heads', '{heads}', '--sample-drafts'], 'sample-drafts'),
    decode_refused('unknown-flag', ['--bogus-flag'], '--bogus-flag', process=True),
    decode_refused('empty-prompt', ['--prompt', ''], '--prompt'),
    decode_refused('device-bogus', ['--device', 'bogus'], '--device'),
    decode_refused('device-cuda', ['--device', 'cuda'], '--device'),
    decode_refused('device-mps', ['--device', 'mps'], '--device'),
    # ------------------------------------------------------------------ generate.py: drafters
    decode_refused('heads-given-dblast', ['--heads', '{dblast}'], '{dblast}', 'give it with --drafter'),
    decode_refused('drafter-given-heads', ['--drafter', '{heads}'], '{heads}', 'give it with --heads'),
    decode_refused('drafter-given-the-target', ['--drafter', '{ckpt}'], '{ckpt}', 'give it with --ckpt or --draft-model'),
    decode_refused('two-drafters-and-paths', ['--heads', '{heads}', '--drafter', '{dblast}', '--paths', '2'], '--paths'),
    decode_refused('lookup-0', ['--lookup', '0'], '--lookup'),
    decode_refused('lookup-k-past-the-context', ['--lookup', '2', '--k', '100000'], '--k 100000',
                   "context of 64 tokens"),
    decode_refused('draft-model-k-past-the-context', ['--draft-model', '{ckpt}', '--k', '65'], '--k 65'),
    decode_refused('tree-too-large', ['--lookup', '2', '--k', '20', '--nodes', '1024'], '--nodes 1024 at --k 20',
                   '19456'),
    decode_refused('lookup-and-heads-and-nodes', ['--heads', '{heads}', '--lookup', '2', '--nodes', '8'], '--nodes'),
    decode_refused('lookup-sample-drafts', ['--lookup', '2', '--temperature', '1', '--sample-drafts'], 'sample-drafts'),
    decode_refused('draft-model-given-heads', ['--draft-model', '{heads}'], '{heads}'),
    decode_refused('heads-nan', ['--heads', '{files}/nan_heads.pt'], '{files}/nan_heads.pt'),
    decode_refused('drafter-nan', ['--drafter', '{files}/nan_dblast.pt'], '{files}/nan_dblast.pt'),
    decode_refused('heads-other-base', ['--ckpt', '{files}/other_ckpt.pt', '--heads', '{heads}'], '{heads}'),
    # ------------------------------------------------------------------ generate.py: the target checkpoint
    decode_refused('ckpt-missing', ['--ckpt', '{run}/no_such_ckpt.pt'], '{run}/no_such_ckpt.pt'),
    decode_refused('ckpt-empty-name', ['--ckpt', ''], 'an empty file name'),
    decode_refused('meta-a-folder', ['--meta', '{files}'], 'not a regular file'),
    decode_refused('ckpt-fifo', ['--ckpt', '{files}/a_fifo'], '{files}/a_fifo', 'is not a regular file'),
    decode_refused('ckpt-dev-null', ['--ckpt', '/dev/null'], '/dev/null is not a regular file'),
    decode_refused('ckpt-a-text-file', ['--ckpt', '{files}/a_file.txt'], '{files}/a_file.txt',
                   'is not a PyTorch checkpoint'),
    decode_refused('ckpt-corrupt', ['--ckpt', '{files}/corrupt.pt'], '{files}/corrupt.pt'),
    decode_refused('ckpt-truncated', ['--ckpt', '{files}/truncated.pt'], '{files}/truncated.pt'),
    decode_refused('ckpt-nan-weights', ['--ckpt', '{files}/nan_ckpt.pt'], '{files}/nan_ckpt.pt'),
    # ------------------------------------------------------------------ generate.py: crafted pickles
    decode_refused('ckpt-crafted', ['--ckpt', '{files}/crafted_ckpt.pt'], '{files}/crafted_ckpt.pt',
                   marker='{files}/payload-ckpt'),
    decode_refused('heads-crafted', ['--heads', '{files}/crafted_heads.pt'], '{files}/crafted_heads.pt',
                   marker='{files}/payload-heads'),
    decode_refused('drafter-crafted', ['--drafter', '{files}/crafted_drafter.pt'], '{files}/crafted_drafter.pt',
                   marker='{files}/payload-drafter'),
    decode_refused('meta-crafted', ['--meta', '{files}/crafted_meta.pkl'], '{files}/crafted_meta.pkl',
                   marker='{files}/payload-meta'),
    # ------------------------------------------------------------------ generate.py: what must work
    accepted('decode-plain', decode()),
    accepted('decode-drafter-sampling', decode('--drafter', '{dblast}', '--temperature', '1')),
    accepted('decode-prompt-not-utf8', decode('--prompt', NOT_UTF8)),
    Case('decode-ctrl-c', ['generate.py', '--device', 'cpu', '--ckpt', '{files}/long_ckpt.pt', '--max-new-tokens',
                           '40000'], 130, ('interrupted',), interrupt=when_torch_loads, only_line=True),
    Case('train-ctrl-c-at-start-up', train('--max-iters', '100000', stages='base', out='{out}/run'), 130,
         ('interrupted',), out='fresh', interrupt=when_torch_loads),
    Case('bench-ctrl-c-at-start-up', ['bench.py', '--quick', '--device', 'cpu', '--out', '{out}/bench'], 130,
         ('interrupted',), out='fresh', interrupt=when_torch_loads),
    Case('gpu-check-ctrl-c-at-start-up', ['gpu_check.py', '--quick', '--device', 'cpu', '--out', '{out}/gc'], 130,
         ('interrupted',), out='fresh', interrupt=when_torch_loads),
    Case('exercises-ctrl-c-at-start-up', ['-m', 'exercises', 'check', '7', '--solution'], 130, ('interrupted',),
         interrupt=when_torch_loads, only_line=True),

    # ------------------------------------------------------------------ bench.py
    bench_refused('batch-zero', ['--batch', '0'], '--batch'),
    bench_refused('paths-list-zero', ['--paths-list', '0,2'], '--paths-list'),
    bench_refused('paths-temps-bogus', ['--paths-temps', '1,x'], '--paths-temps'),
    bench_refused('repeats-zero', ['--repeats', '0'], '--repeats'),
    bench_refused('n-prompts-zero', ['--n-prompts', '0'], '--n-prompts'),
    bench_refused('max-new-zero', ['--max-new', '0'], '--max-new'),
    bench_refused('max-new-beyond-context', ['--max-new', '100000'], '--max-new', within=30),
    bench_refused('tables-empty', ['--tables', ''], '--tables'),
    bench_refused('tables-bogus', ['--tables', 'bogus'], '--tables'),
    bench_refused('tables-time-alone', ['--tables', 'time'], '--tables'),
    bench_refused('dblast-k-one', ['--dblast-k', '1'], '--dblast-k'),
    bench_refused('seed-neg', ['--seed', '-1'], '--seed'),
    bench_refused('device-bogus', ['--device', 'bogus'], '--device'),
    bench_refused('n-layer-zero', ['--n-layer', '0'], '--n-layer'),
    bench_refused('out-is-a-file', ['--out', '{files}/a_file.txt'], '{files}/a_file.txt'),
    bench_refused('data-fifo', ['--data', '{files}/a_fifo'], '{files}/a_fifo'),
    # ------------------------------------------------------------------ crafted checkpoints: every field checked
    decode_refused('ckpt-model-args-a-list', ['--ckpt', '{files}/model_args_list.pt'], 'model_args', 'list'),
    decode_refused('ckpt-million-layers', ['--ckpt', '{files}/million_layers.pt'], 'n_layer=1000000',
                   'do not fit its weights', within=20),   # by arithmetic: nothing allocated
    decode_refused('ckpt-vocab-size-zero', ['--ckpt', '{files}/vocab_zero.pt'], 'vocab_size is int 0',
                   only_line=True),                       # no torch warning before the line
    decode_refused('ckpt-n-embd-text', ['--ckpt', '{files}/n_embd_text.pt'], "n_embd is str '16'"),
    decode_refused('ckpt-bias-text', ['--ckpt', '{files}/bias_text.pt'], "bias is str 'yes'"),
    decode_refused('ckpt-n-embd-not-divisible', ['--ckpt', '{files}/n_head_3.pt'], 'not divisible by n_head 3'),
    decode_refused('ckpt-config-a-list', ['--ckpt', '{files}/config_list.pt'], "'config' is list"),
    decode_refused('ckpt-data-path-an-int', ['--ckpt', '{files}/data_int.pt'], "'config' holds 'data': int 7"),
    decode_refused('ckpt-vocab-record-bogus', ['--ckpt', '{files}/vocab_bogus.pt'], 'malformed vocabulary record'),
    decode_refused('ckpt-weights-not-tensors', ['--ckpt', '{files}/weights_text.pt'], "'model' holds 'lm_head.weight': str"),
    decode_refused('ckpt-path-a-folder', ['--ckpt', '{files}'], '{files}'),
    decode_refused('drafter-kind-a-list', ['--drafter', '{files}/kind_list.pt'], "'kind' is list"),
    decode_refused('heads-k-a-million', ['--heads', '{files}/heads_k_million.pt'], 'k=1000000',
                   'do not fit its weights', within=20),
    decode_refused('drafter-branches-text', ['--drafter', '{files}/dblast_K_text.pt'], "'K' is str '4'"),
    decode_refused('drafter-d-hidden-float', ['--drafter', '{files}/dblast_d_hidden_float.pt'], "'d_hidden' is float"),
    decode_refused('heads-fingerprint-an-int', ['--heads', '{files}/heads_fingerprint_int.pt'], "'base_fingerprint'"),
    decode_refused('heads-without-weights', ['--heads', '{files}/heads_no_weights.pt'], "no 'drafter'"),
    decode_refused('ckpt-a-list', ['--ckpt', '{files}/a_list.pt'], 'not a checkpoint dict'),
    decode_refused('heads-k-one', ['--heads', '{files}/heads_k_one.pt'], "'k' is int 1"),
    decode_refused('drafter-temperature-zero', ['--drafter', '{files}/dblast_temperature_zero.pt'], "'temperature'"),
    decode_refused('drafter-history-text', ['--drafter', '{files}/dblast_history_text.pt'], "'history'"),
    decode_refused('ckpt-vocab-char-itos-int', ['--ckpt', '{files}/vocab_char_itos_int.pt'], 'malformed vocabulary'),
    decode_refused('ckpt-dropout-one', ['--ckpt', '{files}/dropout_one.pt'], 'dropout'),
    accepted('decode-ckpt-numpy-scalars', decode('--ckpt', '{files}/numpy_scalars.pt')),
    decode_refused('seed-huge-sampling', ['--seed', '99999999999999999999999', '--temperature', '1'], '--seed'),
    decode_refused('lookup-past', ['--lookup', '65'], '--lookup'),
    train_refused('resume-without-optimizer', ['--resume', '--max-iters', '40'], "has no 'optimizer'", stages='base',
                  prepare=crafted_over('ckpt.pt', lambda c: c.pop('optimizer'))),
    train_refused('resume-iter-num-text', ['--resume', '--max-iters', '40'], "'iter_num' is str '20'", stages='base',
                  prepare=crafted_over('ckpt.pt', lambda c: c.update(iter_num='20'))),
    train_refused('resume-iter-num-negative', ['--resume', '--max-iters', '40'], "'iter_num' is int -3", stages='base',
                  prepare=crafted_over('ckpt.pt', lambda c: c.update(iter_num=-3))),
    train_refused('resume-optimizer-step-text', ['--resume', '--max-iters', '40'], "'optimizer'", stages='base',
                  prepare=crafted_over('ckpt.pt', lambda c: c['optimizer']['state'][0].update(step='x'))),
    train_refused('resume-dblast-other-temperature', ['--resume', '--temperature', '1.0', '--dblast-iters', '9'],
                  '--resume', 'dblast_K4.pt', stages='dblast'),
    train_refused('resume-dblast-other-loss', ['--resume', '--dblast-loss', 'nll', '--dblast-iters', '9'],
                  '--resume', 'dblast_K4.pt', stages='dblast'),
    train_refused('resume-rng-missing', ['--resume', '--heads-iters', '9'], "has no 'rng'", stages='heads',
                  prepare=crafted_over('heads.pt', lambda c: c.pop('rng'))),
    train_refused('resume-optimizer-of-other-weights', ['--resume', '--heads-iters', '9'], 'optimizer state',
                  'does not fit', stages='heads',
                  prepare=crafted_over('heads.pt', lambda c: c.update(optimizer=torch.load(
                      c['config']['out_dir'] + '/ckpt.pt', weights_only=True)['optimizer']))),
    train_refused('resume-heads-weights-of-other-shape', ['--resume', '--heads-iters', '9'], 'do not fit',
                  stages='heads', prepare=crafted_over('heads.pt', lambda c: c.update(
                      drafter={n: t[..., :1] for n, t in c['drafter'].items()}))),
    train_refused('heads-on-a-million-layer-base', [], 'n_layer=1000000', stages='heads', within=20,
                  prepare=copy_over('ckpt.pt', '{files}/million_layers.pt')),
    train_refused('n-layer-a-million', ['--n-layer', '1000000', '--n-embd', '1024', '--n-head', '16'], 'free on cpu',
                  stages='base', within=20),        # by arithmetic, before the model is made
    train_refused('batch-size-a-billion', ['--batch-size', '1000000000'], '--batch-size 1000000000', 'base stage',
                  'free on cpu', stages='base', within=20),   # by arithmetic: the step's logits alone
    train_refused('heads-batch-size-a-billion', ['--batch-size', '1000000000'], 'heads stage', 'free on cpu',
                  stages='heads', within=20),
    train_refused('heads-d-hidden-a-hundred-million', ['--d-hidden', '100000000'], '--d-hidden 100000000',
                  'free on cpu', stages='heads', within=20),
    train_refused('dblast-samples-a-hundred-million', ['--dblast-samples', '100000000'], '--dblast-samples 100000000',
                  'free on cpu', stages='dblast', within=20),
    train_refused('distill-samples-a-hundred-million', ['--distill-samples', '100000000'],
                  '--distill-samples 100000000', 'free on cpu', stages='heads', within=20),
    # ------------------------------------------------------------------ dataset folders
    train_refused('data-nanogpt-odd-val', ['--data', '{files}/nanogpt_odd_val'], 'val.bin has 1001 bytes'),
    train_refused('data-nanogpt-no-val', ['--data', '{files}/nanogpt_no_val'], 'val.bin is missing'),
    train_refused('data-nanogpt-no-train', ['--data', '{files}/nanogpt_no_train'], 'train.bin is missing'),
    train_refused('data-nanogpt-val-a-folder', ['--data', '{files}/nanogpt_val_folder'],
                  'val.bin is not a regular file'),
    bench_refused('data-nanogpt-odd-val', ['--data', '{files}/nanogpt_odd_val'], 'val.bin has 1001 bytes'),
    # ------------------------------------------------------------------ a checkpoint that cannot be replaced
    train_refused('ckpt-pt-is-a-folder', [], 'cannot replace the checkpoint', 'ckpt.pt: it is a folder',
                  stages='base', prepare=folder_over('ckpt.pt')),
    train_refused('resume-heads-pt-is-a-folder', ['--resume'], 'heads.pt: it is a folder', stages='heads',
                  prepare=folder_over('heads.pt')),
    train_refused('dblast-pt-is-a-folder', [], 'dblast_K1.pt: it is a folder', stages='dblast',
                  prepare=folder_over('dblast_K1.pt')),
    train_refused('ckpt-pt-read-only', [], 'ckpt.pt: it is read-only', stages='base', needs_non_root=True,
                  prepare=read_only_file('ckpt.pt')),
    # ------------------------------------------------------------------ flags that mean nothing here
    decode_refused('paths-heads-greedy', ['--heads', '{heads}', '--paths', '4'], '--paths 4 means nothing here'),
    decode_refused('paths-k1-greedy', ['--drafter', '{run}/dblast_K1.pt', '--paths', '2'], '--paths 2 means nothing',
                   'one branch'),
    decode_refused('paths-no-sample-drafts', ['--heads', '{heads}', '--temperature', '1', '--no-sample-drafts',
                                              '--paths', '2'], '--paths 2 means nothing here'),
    decode_refused('paths-zt-0-greedy', ['--drafter', '{dblast}', '--zt', '0', '--paths', '3'],
                   '--paths 3 means nothing', 'Z_T = 0'),
    accepted('decode-paths-dblast-greedy-branches-differ', decode('--drafter', '{dblast}', '--paths', '2')),
    accepted('decode-tree-heads', decode('--heads', '{heads}', '--nodes', '12')),
    accepted('decode-tree-lookup', decode('--lookup', '2', '--k', '6', '--nodes', '12')),
    accepted('decode-tree-dblast-sampling', decode('--drafter', '{dblast}', '--temperature', '1.5', '--nodes', '10')),
    accepted('decode-sampled-tree-dblast', decode('--drafter', '{dblast}', '--temperature', '1.5', '--branching', '2,2,1'),
             output_has='branching=2,2,1'),
    decode_refused('branching-not-numbers', ['--drafter', '{dblast}', '--temperature', '1', '--branching', '4,x'],
                   '--branching', 'whole numbers separated by commas'),
    decode_refused('branching-greedy', ['--drafter', '{dblast}', '--branching', '2,1,1'], 'a sampled tree is for sampling'),
    decode_refused('branching-too-short', ['--drafter', '{dblast}', '--temperature', '1', '--branching', '2,2'],
                   '--branching 2,2 at --k 4', 'k-1 = 3 of them'),
    accepted('decode-paths-from-branches', decode('--drafter', '{dblast}', '--temperature', '1', '--paths', '2',
                                                  '--paths-from', 'branches')),
    decode_refused('verify-greedy', ['--drafter', '{dblast}', '--verify', 'branch'], '--verify means nothing'),
    decode_refused('seed-greedy', ['--heads', '{heads}', '--seed', '3'], '--seed means nothing'),
    accepted('decode-seed-greedy-dblast', decode('--drafter', '{dblast}', '--seed', '3')),   # it draws branches
    train_refused('tag-base-only', ['--tag', '_x'], '--tag means nothing', stages='base'),
    train_refused('d-hidden-base-only', ['--d-hidden', '8'], '--d-hidden means nothing', stages='base'),
    train_refused('d-hidden-draft-only', ['--d-hidden', '8'], '--d-hidden means nothing', stages='draft'),
    train_refused('draft-embd-a-hundred-million', ['--draft-embd', '100000000'], 'the draft model of these flags',
                  '--draft-embd 100000000', 'free on cpu', stages='draft', within=20),
    decode_refused('meta-not-the-recorded-vocabulary', ['--meta', '{files}/plain_meta.pkl'], '--meta',
                   'is not the bytes vocabulary'),
    accepted('decode-meta-of-a-char-target', decode('--ckpt', '{files}/char_ckpt.pt', '--meta',
                                                    '{files}/plain_meta.pkl', '--prompt', 'ab')),
    train_refused('meta-with-base-stage', ['--meta', '{files}/plain_meta.pkl'], '--meta means nothing', stages='base'),
    train_refused('heads-meta-not-the-recorded-vocabulary', ['--meta', '{files}/plain_meta.pkl'], '--meta',
                  'is not the bytes vocabulary', stages='heads'),
    decode_refused('accept-minblock-past-k', ['--heads', '{heads}', '--k', '4', '--accept', 'minblock:5'],
                   '--accept minblock:5', '--k 4'),
    decode_refused('device-cpu-1', ['--device', 'cpu:1'], '--device cpu:1'),
    train_refused('device-cpu-1', ['--device', 'cpu:1'], '--device cpu:1'),
    bench_refused('device-cpu-1', ['--device', 'cpu:1'], '--device cpu:1'),
    refused('bench-ckpt-dir-of-another-size', BENCH + ['--ckpt-dir', '{copy}', '--n-embd', '32'], '--ckpt-dir',
            'ckpt.pt', '--n-embd 16', out='copy', not_in=('--out-dir', '--resume')),
]

assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"


# ----------------------------------------------------------------------------- helpers

def fill(text, p):
    """A string with its '{name}' placeholders filled in from the paths p (bytes stay as they are)."""
    return text.format(**p) if isinstance(text, str) else text


def script_env():
    """One thread per process (they run side by side), unbuffered output, not under torchrun, and no
    CUDA, so that '--device cuda' is refused on any machine."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', CUDA_VISIBLE_DEVICES='')
    for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK'):
        env.pop(name, None)
    return env


def tree_hashes(folder):
    """sha256 of every checkpoint (*.pt) under folder, by path relative to it; the corpus and sample
    caches under data/ are not checkpoints. {} for a folder that does not exist."""
    hashes = {}
    for d, dirs, names in os.walk(folder):
        dirs[:] = [x for x in dirs if x != 'data']
        for n in names:
            if n.endswith('.pt'):
                path = os.path.join(d, n)
                with open(path, 'rb') as f:
                    hashes[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return hashes


def temporaries(folder):
    """Every file under folder that a write left behind half-done (a *.tmp name)."""
    return [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names if n.endswith('.tmp')]


@dataclass
class Result:
    code: Optional[int]          # None: killed after TIMEOUT seconds
    stdout: str
    stderr: str
    seconds: float
    before: dict                 # tree_hashes of the watched folder before the run
    after: dict = field(default_factory=dict)
    marker_exists: bool = False
    temporaries: list = field(default_factory=list)   # *.tmp files left in the case's folders

    def __repr__(self):
        return f"Result(code={self.code}, {self.seconds:.1f}s)"


class Results(dict):
    """{case id: Result}, with a short repr for failure reports."""

    def __repr__(self):
        return f"<results of {len(self)} cases>"


def case_paths(paths, case):
    """The paths, plus the case's own folder (work), its empty out folder and its copy of the run."""
    work = os.path.join(paths['cases'], re.sub(r'[^A-Za-z0-9_.-]', '_', case.id))
    return dict(paths, work=work, out=os.path.join(work, 'out'), copy=os.path.join(work, 'run'))


def run_case(case, paths):
    """Run one case in its own folder, as a real process or in this one; what it did, as a Result."""
    p = case_paths(paths, case)
    work = p['work']
    os.makedirs(work)
    if case.out == 'copy':
        shutil.copytree(p['run'], p['copy'])
    if case.prepare:
        case.prepare(p)
    watched = {'run': p['run'], 'copy': p['copy'], 'fresh': p['out']}[case.out]
    before = tree_hashes(watched)
    argv = [fill(a, p) for a in case.argv]
    t0 = time.monotonic()
    if case.process:
        code, stdout, stderr = run_process(case, argv, p)
    else:
        script, *args = [os.fsdecode(a) for a in argv]   # bytes arrive as Python decodes a real argv
        code, stdout, stderr = in_process(lambda: MAINS[script](args))
    return Result(code, stdout, stderr, time.monotonic() - t0, before, tree_hashes(watched),
                  bool(case.marker) and os.path.exists(fill(case.marker, p)), temporaries(work) + temporaries(p['run']))


def run_process(case, argv, p):
    """`python argv` in the case's folder -> (exit code or None after TIMEOUT seconds, stdout, stderr)."""
    work = p['work']
    t0 = time.monotonic()
    with open(os.path.join(work, 'stdout'), 'wb') as out, open(os.path.join(work, 'stderr'), 'wb') as err:
        # output to files, not pipes: a long run's progress bars would fill a pipe nobody reads yet
        proc = subprocess.Popen(sigint_at_default(argv), cwd=ROOT, env=script_env(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err)
        try:
            if case.interrupt:
                case.interrupt(proc, p)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=max(1.0, TIMEOUT - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None

    def read(name):
        with open(os.path.join(work, name), 'rb') as f:
            return f.read().decode('utf-8', errors='replace')

    return code, read('stdout'), read('stderr')


def lines_of(text):
    """Non-empty lines (progress bars redraw with '\\r': each redraw is a line of its own)."""
    return [line for line in text.splitlines() if line.strip()]


def tail(r, n=8):
    return f"exit code {r.code} after {r.seconds:.1f}s; stderr ends:\n" + '\n'.join(lines_of(r.stderr)[-n:])


def assert_refused(r, needles):
    """Exit code 2, exactly one `error:` line naming what the user gave, no usage dump, no traceback."""
    assert r.code == 2, tail(r)
    lines = lines_of(r.stderr)
    errors = [line for line in lines if line.startswith('error:')]
    assert len(errors) == 1, f"want exactly one error line, got {len(errors)}\n" + tail(r)
    assert not any(line.startswith('usage:') for line in lines), "argparse usage dump\n" + tail(r)
    for needle in needles:
        assert needle in errors[0], f"the error line does not name {needle!r}:\n{errors[0]}"


def assert_accepted(r):
    assert r.code == 0, tail(r)
    assert not any(line.startswith('error:') for line in lines_of(r.stderr)), tail(r)


def assert_interrupted(r, needles, only_line):
    """Exit code 130; the last line says what was kept and what to do (needles)."""
    assert r.code == 130, tail(r)
    assert 'Traceback' not in r.stderr, tail(r, 30)
    lines = lines_of(r.stderr)
    assert lines, "nothing on stderr"
    for needle in needles:
        assert needle in lines[-1], f"the last line does not mention {needle!r}:\n{lines[-1]}"
    if only_line:
        assert len(lines) == 1, "want one line on stderr\n" + tail(r)


# ----------------------------------------------------------------------------- crafted files

class Payload:
    """Unpickling this object calls open(marker, 'w'): the marker file appears if whatever loads a
    file holding it runs code from that file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, 'w')


def write_payload_checkpoint(path, marker):
    """A file that looks like one of our checkpoints, saved by torch.save, with a payload inside."""
    torch.save(dict(model=Payload(marker), model_args=dict(n_layer=1), kind='heads', drafter={}), path)


def tiny_corpus_bins(folder, n=4000):
    """train.bin / val.bin of a nanoGPT character dataset (uint16 ids below 65)."""
    ids = np.random.default_rng(0).integers(0, 65, n).astype(np.uint16)
    ids.tofile(os.path.join(folder, 'train.bin'))
    ids[: n // 4].tofile(os.path.join(folder, 'val.bin'))


def make_crafted_files(files, run):
    """Every bad or odd file the cases use, in the folder `files` (paths: see CASES)."""
    j = lambda *a: os.path.join(files, *a)
    good = torch.load(os.path.join(run, 'ckpt.pt'), map_location='cpu', weights_only=True)
    with open(os.path.join(run, 'ckpt.pt'), 'rb') as f:
        raw = f.read()

    # broken checkpoints
    with open(j('corrupt.pt'), 'wb') as f:
        f.write(random.Random(0).randbytes(5000))
    with open(j('truncated.pt'), 'wb') as f:
        f.write(raw[: len(raw) // 2])
    nan = dict(good, model=dict(good['model']))
    w = nan['model']['transformer.h.0.attn.c_attn.weight'].clone()
    w[0, 0] = float('nan')
    nan['model']['transformer.h.0.attn.c_attn.weight'] = w
    torch.save(nan, j('nan_ckpt.pt'))
    other = dict(good, model=dict(good['model']))     # another base model: drafters must refuse it
    other['model']['lm_head.weight'] = other['model']['lm_head.weight'] + 0.5
    other['model']['transformer.wte.weight'] = other['model']['lm_head.weight']
    torch.save(other, j('other_ckpt.pt'))
    for name, src in (('nan_heads.pt', 'heads.pt'), ('nan_dblast.pt', 'dblast_K4.pt')):
        d = torch.load(os.path.join(run, src), map_location='cpu', weights_only=True)
        key = next(k for k, t in d['drafter'].items() if t.is_floating_point())
        d['drafter'] = dict(d['drafter'], **{key: torch.full_like(d['drafter'][key], float('nan'))})
        torch.save(d, j(name))
    # a context of 50000 tokens: a generation long enough to interrupt
    cfg = GPTConfig(block_size=50000, vocab_size=256, n_layer=1, n_head=2, n_embd=16)
    torch.save(dict(model=GPT(cfg).state_dict(), model_args=asdict(cfg), vocab=Vocab('bytes').state()),
               j('long_ckpt.pt'))

    # crafted checkpoints: one field each out of type or range
    def variant(name, src='ckpt.pt', **change):
        d = torch.load(os.path.join(run, src), map_location='cpu', weights_only=True)
        d.update(change)
        torch.save(d, j(name))
    args = good['model_args']
    variant('model_args_list.pt', model_args=list(args.values()))
    variant('million_layers.pt', model_args=dict(args, n_layer=10 ** 6))
    variant('vocab_zero.pt', model_args=dict(args, vocab_size=0))
    variant('n_embd_text.pt', model_args=dict(args, n_embd='16'))
    variant('bias_text.pt', model_args=dict(args, bias='yes'))
    variant('n_head_3.pt', model_args=dict(args, n_head=3))
    variant('config_list.pt', config=[1, 2])
    variant('data_int.pt', config=dict(good['config'], data=7))
    variant('vocab_bogus.pt', vocab=dict(kind='letters'))
    variant('weights_text.pt', model=dict(good['model'], **{'lm_head.weight': 'weights'}))
    variant('kind_list.pt', 'dblast_K4.pt', kind=['dblast'])
    variant('heads_k_million.pt', 'heads.pt', k=10 ** 6)
    variant('dblast_K_text.pt', 'dblast_K4.pt', K='4')
    variant('dblast_d_hidden_float.pt', 'dblast_K4.pt', d_hidden=16.0)
    variant('heads_fingerprint_int.pt', 'heads.pt', base_fingerprint=5)
    variant('heads_k_one.pt', 'heads.pt', k=1)
    variant('dblast_temperature_zero.pt', 'dblast_K4.pt', temperature=0.0)
    variant('dblast_history_text.pt', 'dblast_K4.pt', history=[(1, 'x')])
    variant('vocab_char_itos_int.pt', vocab=dict(kind='char', itos=5))
    variant('dropout_one.pt', model_args=dict(args, dropout=1.0))
    variant('numpy_scalars.pt', best_val_loss=np.float64(1.2), config=dict(good['config'], lr=np.float32(1e-3)))
    torch.save([1, 2], j('a_list.pt'))
    heads = torch.load(os.path.join(run, 'heads.pt'), map_location='cpu', weights_only=True)
    heads.pop('drafter')
    torch.save(heads, j('heads_no_weights.pt'))
    # a character-level target that records no vocabulary (as nanoGPT's), and a plain meta.pkl for it
    with open(j('plain_meta.pkl'), 'wb') as f:
        pickle.dump(dict(vocab_size=3, itos={0: 'a', 1: 'b', 2: ' '}, stoi={'a': 0, 'b': 1, ' ': 2}), f)
    cfg = GPTConfig(block_size=32, vocab_size=3, n_layer=1, n_head=2, n_embd=16)
    torch.save(dict(model=GPT(cfg).state_dict(), model_args=asdict(cfg)), j('char_ckpt.pt'))
    # nanoGPT folders that are not quite: an odd byte count, a split missing, a split that is a folder
    for name in ('nanogpt_odd_val', 'nanogpt_no_val', 'nanogpt_no_train', 'nanogpt_val_folder'):
        os.makedirs(j(name))
        tiny_corpus_bins(j(name))
    with open(j('nanogpt_odd_val', 'val.bin'), 'wb') as f:
        f.write(bytes(1001))
    os.remove(j('nanogpt_no_val', 'val.bin'))
    os.remove(j('nanogpt_no_train', 'train.bin'))
    os.remove(j('nanogpt_val_folder', 'val.bin'))
    os.makedirs(j('nanogpt_val_folder', 'val.bin'))

    # crafted pickles, each with a marker of its own
    for name in ('ckpt', 'heads', 'drafter'):
        write_payload_checkpoint(j(f'crafted_{name}.pt'), j(f'payload-{name}'))
    for name, marker in (('crafted_meta.pkl', 'payload-meta'), ('crafted_train_meta.pkl', 'payload-train-meta')):
        with open(j(name), 'wb') as f:
            pickle.dump(dict(vocab_size=3, itos=Payload(j(marker)), stoi={}), f)
    os.makedirs(j('nanogpt_crafted'))
    tiny_corpus_bins(j('nanogpt_crafted'))
    with open(j('nanogpt_crafted', 'meta.pkl'), 'wb') as f:
        pickle.dump(dict(vocab_size=65, itos=Payload(j('payload-nanogpt-meta'))), f)

    # file-system oddities
    with open(j('a_file.txt'), 'w') as f:
        f.write('not a folder\n')
    os.mkfifo(j('a_fifo'))
    os.makedirs(j('broken_only'))
    os.symlink(j('nowhere'), j('broken_only', 'link.txt'))
    for kind in ('fifo', 'socket', 'broken-symlink'):
        folder = j(f'{kind}_data')
        os.makedirs(folder)
        with open(os.path.join(folder, 'corpus.txt'), 'w') as f:
            f.write(corpus_text())
        odd = os.path.join(folder, 'odd')
        if kind == 'fifo':
            os.mkfifo(odd)
        elif kind == 'broken-symlink':
            os.symlink(j('nowhere'), odd)
        else:   # a Unix socket file; bound by a relative name (a socket's path may be 107 bytes at most)
            cwd = os.getcwd()
            os.chdir(folder)
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.bind('odd')
            finally:
                os.chdir(cwd)
    with open(j('unreadable.txt'), 'w') as f:
        f.write(corpus_text())
    os.chmod(j('unreadable.txt'), 0)
    os.makedirs(j('unreadable_dir'))
    shutil.copyfile(os.path.join(os.path.dirname(run), 'corpus.txt'), j('unreadable_dir', 'corpus.txt'))
    os.chmod(j('unreadable_dir'), 0)
    os.makedirs(j('read_only'))
    os.chmod(j('read_only'), 0o555)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope='module')
def paths(tmp_path_factory):
    """The tiny trained run and the crafted files; their paths by placeholder name."""
    root = str(tmp_path_factory.mktemp('cli'))
    p = dict(corpus=os.path.join(root, 'corpus.txt'), run=os.path.join(root, 'run'),
             files=os.path.join(root, 'files'), cases=os.path.join(root, 'cases'))
    with open(p['corpus'], 'w') as f:
        f.write(corpus_text())
    code, _, err = in_process(lambda: train_main([fill(a, p) for a in train(out=p['run'])[1:]]))
    assert code == 0, err[-3000:]
    p.update(ckpt=os.path.join(p['run'], 'ckpt.pt'), heads=os.path.join(p['run'], 'heads.pt'),
             dblast=os.path.join(p['run'], 'dblast_K4.pt'))
    assert sorted(tree_hashes(p['run'])) == ['ckpt.pt', 'dblast_K1.pt', 'dblast_K4.pt', 'heads.pt']
    os.makedirs(p['files'])
    os.makedirs(p['cases'])
    make_crafted_files(p['files'], p['run'])
    p['trained_hashes'] = tree_hashes(p['run'])
    yield p
    for name in ('read_only', 'unreadable_dir', 'unreadable.txt'):   # so that the folder can be removed
        os.chmod(os.path.join(p['files'], name), 0o755)


@pytest.fixture(scope='module')
def results(paths, request):
    """Every case selected for this session (-k): {case id: Result}. The real processes run WORKERS
    at a time, the slow ones (interrupted, accepted) first, while this thread runs the others."""
    selected = {item.callspec.params['case'].id for item in request.session.items
                if isinstance(getattr(item, 'callspec', None) and item.callspec.params.get('case'), Case)}
    todo = [c for c in CASES if c.id in selected and not (c.needs_non_root and IS_ROOT)]
    todo.sort(key=lambda c: c.code == 2)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {c.id: pool.submit(run_case, c, paths) for c in todo if c.process}
        done = {c.id: run_case(c, paths) for c in todo if not c.process}
        return Results(done, **{cid: f.result() for cid, f in futures.items()})


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize('case', CASES, ids=[c.id for c in CASES])
def test_cli(case, results, paths):
    if case.needs_non_root and IS_ROOT:
        pytest.skip("running as root: permission bits do not stop root (see the /proc cases instead)")
    r = results[case.id]
    assert r.code is not None, f"no answer within {TIMEOUT}s: a hang\n" + tail(r)
    traceback = 'Traceback' in r.stderr
    assert not traceback, "a traceback instead of one error line\n" + tail(r, 30)
    p = case_paths(paths, case)
    if case.code == 2:
        assert_refused(r, [fill(n, p) for n in case.needles])
    elif case.code == 130:
        assert_interrupted(r, case.needles, case.only_line)
    else:
        assert_accepted(r)
    assert r.seconds <= case.within, f"took {r.seconds:.1f}s, more than {case.within}s"
    if case.code == 2 or case.out == 'run':
        assert r.after == r.before, f"checkpoints changed: {r.before} -> {r.after}"
    assert not r.temporaries, f"half-written files left: {r.temporaries}"
    for said in case.not_in:
        assert said not in r.stderr, f"the error names {said!r}, which this script does not have:\n{r.stderr}"
    if case.marker:
        assert not r.marker_exists, "the crafted pickle's payload ran: its marker file exists"
    if case.output_has:
        assert case.output_has in r.stdout + r.stderr, tail(r)
    if case.after:
        case.after(p)


def test_payload_would_run(paths, tmp_path):
    """The crafted pickles are real threats: loaded without weights_only, the payload does run."""
    marker = tmp_path / 'ran'
    write_payload_checkpoint(tmp_path / 'crafted.pt', str(marker))
    torch.load(tmp_path / 'crafted.pt', weights_only=False)
    assert marker.exists()


def test_trained_run_untouched(paths, results):
    """No case changed, removed or added a checkpoint of the shared trained run."""
    assert tree_hashes(paths['run']) == paths['trained_hashes']


def test_an_ascii_stdout_gets_what_it_cannot_encode_escaped(paths):
    """stdout in ASCII (PYTHONIOENCODING=ascii, or a C locale that Python does not coerce): a
    character it cannot encode is written escaped, as stderr writes it, not a traceback."""
    argv = ['generate.py', '--device', 'cpu', '--ckpt', paths['ckpt'], '--prompt', 'h\u00e9llo', '--max-new-tokens', '4']
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=dict(script_env(), PYTHONIOENCODING='ascii'),
                          capture_output=True, timeout=TIMEOUT)
    assert proc.returncode == 0 and b'Traceback' not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.startswith(b'h\\xe9llo'), proc.stdout


def test_the_default_checkpoint_missing_says_to_train_first(tmp_path):
    """A fresh clone: generate.py without --ckpt, and train.py's drafter stages without a target,
    each say to run python train.py first, in one line; the stage run makes no folder."""
    code, _, err = in_process(lambda: generate_main(['--device', 'cpu']), cwd=tmp_path)
    assert code == 2 and err.strip() == ("error: no target at out/ckpt.pt, the default --ckpt: run python train.py "
                                         "first (it writes out/ckpt.pt), or give --ckpt"), err
    out = tmp_path / 'none'
    code, _, err = in_process(lambda: train_main(['--device', 'cpu', '--stages', 'heads,dblast', '--out-dir', str(out)]))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the target in {out}/ckpt.pt, which is not there: train it first (python train.py" in err, err
    assert not out.exists()


def test_compile_says_it_compiles_before_the_silent_minute(capsys):
    """generate.py --compile prints a note before its warm-up compiles (a minute on a 2-core CPU),
    and nothing without --compile."""
    import argparse

    import generate
    generate.compiling(argparse.Namespace(compile=True))
    assert capsys.readouterr().err.startswith('note: --compile: compiling the decoding steps before the timed run')
    generate.compiling(argparse.Namespace(compile=False))
    assert capsys.readouterr().err == ''


# ----------------------------------------------------------------------------- what docstrings say, pinned

def test_merged_stats_are_one_calls_stats_over_every_step():
    """generate.merged_stats: calls and tokens summed; mean_tau and the acceptance per draft position
    over every step of every call (weighted by steps, not a mean of the calls' means), positions a
    shorter block lacks left out of their denominators."""
    def stats(taus, k, calls, tokens):   # what decode.finished reports for these row-steps
        rate = [sum(t > j for t in taus) / len(taus) for j in range(1, k)]
        return dict(calls=calls, tokens=tokens, tokens_per_call=tokens / calls, mean_tau=sum(taus) / len(taus),
                    accept_lengths=taus, accept_rate=rate)
    a, b, c = stats([4, 1, 2, 3, 4, 1], 4, 7, 15), stats([1], 4, 2, 1), stats([2, 3, 1], 3, 4, 6)
    got = merged_stats([a, b, c])
    taus = a['accept_lengths'] + b['accept_lengths'] + c['accept_lengths']
    assert got['calls'] == 13 and got['tokens'] == 22 and got['tokens_per_call'] == 22 / 13
    assert got['accept_lengths'] == taus and got['mean_tau'] == sum(taus) / len(taus)
    four = a['accept_lengths'] + b['accept_lengths']                      # only blocks of k = 4 have a 3rd draft
    want = [sum(t > j for t in taus) / len(taus) for j in (1, 2)] + [sum(t > 3 for t in four) / len(four)]
    assert len(got['accept_rate']) == 3
    assert all(abs(x - y) < 1e-12 for x, y in zip(got['accept_rate'], want)), (got['accept_rate'], want)


def test_colour_blocks_colours_each_steps_block_then_the_last_bonus():
    """generate.colour_blocks: the text unchanged once the colour codes are dropped, one segment per
    step's tau, alternating, and the last bonus (written without a step) as a segment of its own."""
    class Chars:
        def decode(self, ids):
            return ''.join(chr(97 + i) for i in ids)
    tokens, taus = list(range(8)), [3, 1, 3]                             # 7 committed by steps + the last bonus
    assert colour_blocks(Chars(), tokens, taus, False) == 'abcdefgh'
    text = colour_blocks(Chars(), tokens, taus, True)
    segments = [s.split('m', 1)[1] for s in text.split('\033[0m') if s]
    assert segments == ['abc', 'd', 'efg', 'h']
    assert text.count('\033[30;43m') == 2 and text.count('\033[30;46m') == 2
