"""
What comes in from outside the program, and how bad input is refused: command-line numbers,
checkpoint files, vocabularies, corpora and held-out prompts, for generate.py, train.py and bench.py
alike. Every user error is a `BadInput`, which the scripts print as one `error:` line.

How a script ends (`run_script`): a BadInput with its line (exit code 2); Ctrl-C and SIGTERM with a
line saying what was kept, a save under way finishing first (130, 143); output that cannot be
written as a Unix tool's does: a closed pipe quietly (141), a full device with one line (1), and
a closed stdout refused before any work; --compile with no C++ compiler to build with, one line.

Checkpoints (`load_checkpoint`, `save_checkpoint`, `load_target`): written atomically (an
interrupted or failed write leaves no temporary file and the previous checkpoint as it was), read
with `weights_only=True` (tensors and plain values only: nothing in a file runs), every field
checked for type and range before it is used (`FIELDS`), a target's config checked against the
weights the file holds, in bytes, before any tensor is made, finite weights only.

Vocabularies (`Vocab`):
  bytes   UTF-8 bytes, 256 ids: this project's own models (the default)
  char    a nanoGPT character vocabulary, from its meta.pkl (stoi / itos); read without running code
  gpt2    GPT-2 BPE through tiktoken (optional; 50257 / 50304-vocabulary checkpoints)
A target's vocabulary is found as nanoGPT's sample.py finds it (`vocab_for`), recorded in every
checkpoint this project writes, and checked wherever text or a dataset becomes ids.

Corpora (`load_dataset`): a text file or folder of text files (bytes; by default the Python
standard library), or a nanoGPT dataset folder: train.bin / val.bin (uint16 ids) and optionally
meta.pkl. `heldout_prompts_of(out_dir)`: the held-out prompts train.py's closing demos decode, read
from its output folder without writing anything there.

Threads: `intra_op_threads` (the scripts' choice, set for the process) and `num_threads` (a setting
for the length of a `with` block, restored afterwards; decode.generate uses it per call).
"""
import argparse
import dataclasses
import functools
import hashlib
import math
import os
import pickle
import signal
import stat
import sys
import sysconfig
import threading
import time
from contextlib import ExitStack, contextmanager, suppress

import numpy as np
import torch

from model import GPT, GPTConfig

PROMPT_LEN = 32       # corpus prompt in front of each generated training sequence
DEMO_PROMPTS = 8      # held-out prompts of train.py's closing demos (heldout_prompts_of)
GPT2_SIZES = (50257, 50304)   # GPT-2's vocabulary, and nanoGPT's padded one


# ----------------------------------------------------------------------------- errors and flags

class BadInput(ValueError):
    """A user error (bad argument, missing or mismatched file): the scripts print its message as
    one line and exit non-zero instead of showing a traceback."""


def first_line(e, default='', limit=200):
    """An exception's message cut to its first line (and `limit` characters), to quote inside a
    one-line error; `default` when it has no message."""
    return (str(e).strip().splitlines() or [default])[0][:limit]


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, not a number, ...) are one `error:` line too."""

    def error(self, message):
        raise BadInput(message)


def check_number(flag, value, lo=None, hi=None, open_lo=False, open_hi=False, note=''):
    """A flag's number is finite and within its bounds (open_lo / open_hi: the bound itself is
    excluded): else a one-line BadInput naming the flag and what is allowed."""
    ok = (isinstance(value, int) or math.isfinite(value)) and (lo is None or value > lo or (value == lo and not open_lo)) \
        and (hi is None or value < hi or (value == hi and not open_hi))
    if not ok:
        allowed = ' and '.join([f"{'>' if open_lo else '>='} {lo}"] * (lo is not None)
                               + [f"{'<' if open_hi else '<='} {hi}"] * (hi is not None)) or 'finite'
        raise BadInput(f"{flag} {value}: must be {allowed}" + (f" ({note})" if note else ''))
    return value


# A model this small decodes one token in operations too small to split between threads
# (bench/threads/RESULTS.md): one thread is as fast on a quiet machine, and many times faster beside
# a busy one.
SMALL_MODEL = 20_000_000   # parameters


def intra_op_threads(threads=None, small=False):
    """Set the threads torch's CPU kernels use and return how many: `threads` when given (--threads),
    else one for small work (decoding a model under SMALL_MODEL parameters), else every core not
    already busy (busy_cores), at least one. Measured on 2 cores (bench/threads/RESULTS.md): beside
    busy processes two threads were up to 2.5x slower than one for a training step and up to 110x
    for a decode, each thread waiting for the other at every operation; on a quiet machine two were
    1.5x faster for training and no faster for decoding."""
    if threads is None:
        cores = os.cpu_count() or 1
        threads = 1 if small else max(1, min(cores, cores - round(busy_cores(cores))))
    torch.set_num_threads(threads)
    return threads


@contextmanager
def num_threads(n):
    """torch's intra-op threads at n for the length of the block, then as they were (n None: left as
    they are). For one call, where intra_op_threads sets them for the process."""
    before = torch.get_num_threads()
    if n is not None and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def decoding_threads(model, device):
    """The threads the scripts decode `model` with, for one call from Python: one on a CPU for a
    model under SMALL_MODEL parameters; else None, torch's setting as the caller left it (for a
    larger model the scripts read the machine's load, busy_cores, which takes 0.2 s: too slow to
    spend on every call)."""
    small = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel() < SMALL_MODEL
    return 1 if small and torch.device(device).type == 'cpu' else None


def busy_cores(cores, window=0.2):
    """How many cores other processes keep busy now: the share of CPU time not idle over `window`
    seconds of /proc/stat (Linux; this process sleeps meanwhile), else the 1-minute load average,
    which lags by about a minute."""
    def snap():
        with open('/proc/stat') as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4], time.process_time(), time.perf_counter()
    try:
        (total0, idle0, own0, t0), _, (total1, idle1, own1, t1) = snap(), time.sleep(window), snap()
        # less this process's own: torch's worker threads spin for a while after parallel work
        own = (own1 - own0) / (t1 - t0)
        return max(0.0, cores * (1 - (idle1 - idle0) / max(1, total1 - total0)) - own)
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0


# ----------------------------------------------------------------------------- how a script ends

class OutputLost(BaseException):
    """stdout or stderr can no longer be written: its reader is gone (a closed pipe), or its device
    is full. Raised by the scripts' own streams (GuardedOutput) in place of the OSError, as a
    BaseException so that no `except Exception` on the way (a part of gpu_check.py, tqdm's own
    handling) takes it for a failure of the work: the run ends, as a Unix tool's does (run_script)."""

    def __init__(self, stream, error):
        super().__init__(stream, error)
        self.stream, self.error = stream, error


class GuardedOutput:
    """sys.stdout or sys.stderr as it is (its buffering, isatty, encoding, fileno, ...), whose
    failed writes raise OutputLost naming the stream."""

    def __init__(self, stream, label):
        self._stream, self._label = stream, label

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputLost(self._label, e) from None

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputLost(self._label, e) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def fd_to_devnull(fd):
    """Point file descriptor `fd` at /dev/null: what is still buffered for it, and whatever C code
    writes there, goes nowhere, and no file opened later takes its number."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def guard_output():
    """The process's stdout and stderr, as run_script runs a script: each wrapped in GuardedOutput,
    stdout flushed at every line (a closed pipe or a full device then shows at the first line, not
    after the work). stderr closed (`2>&-`): what would go there is dropped, and its descriptor is
    held on /dev/null. Returns False where stdout is closed (`>&-`): nothing printed could be seen."""
    if sys.stderr is None:
        try:
            os.fstat(2)
        except OSError:
            fd_to_devnull(2)
        sys.stderr = open(os.devnull, 'w')
    if sys.stdout is None:
        return False
    out = sys.stdout
    if out is sys.__stdout__ and not out.line_buffering and not getattr(out, 'write_through', True):
        out.reconfigure(line_buffering=True)
    for name in ('stdout', 'stderr'):
        stream = getattr(sys, name)
        if stream is getattr(sys, f'__{name}__'):   # the process's own, not a caller's redirection
            setattr(sys, name, GuardedOutput(stream, name))
    return True


def flush_output():
    sys.stdout.flush()
    sys.stderr.flush()


def say(line):
    """One line on stderr, if it can still be written."""
    with suppress(OutputLost, OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def quiet_exit(code):
    """Exit with `code`; output that can no longer be written is dropped instead of being reported
    once more by the interpreter on its way out."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except (OutputLost, OSError):
            with suppress(OSError, ValueError, AttributeError):
                fd_to_devnull(stream.fileno())
    sys.exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler ending a job), raised as Ctrl-C's KeyboardInterrupt is, so that it
    gets Ctrl-C's care: a save under way finishes first (save_before_stop) and the scripts say what
    was kept; run_script then ends with exit code 143."""


def on_sigterm(owner):
    """SIGTERM's handler for the process `owner` (its pid). A child forked from it gets the default
    back: it ends at once, as it would have without this handler."""
    def handler(signum, frame):
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise Terminated()
    return handler


def terminated(e):
    """Whether a KeyboardInterrupt came from SIGTERM: a Terminated, or raised while handling one (a
    script's own KeyboardInterrupt saying what was saved)."""
    while e is not None:
        if isinstance(e, Terminated):
            return True
        e = e.__context__
    return False


COMPILER_MISSING = ("--compile on a CPU needs a C++ compiler (inductor builds the compiled steps with it), and none "
                    "was found{tried}: install one (e.g. g++) or name it in $CXX, or run without --compile")


def compiler_missing(e):
    """Whether torch.compile failed because inductor found no C++ compiler (InvalidCxxCompiler,
    however dynamo wrapped it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == 'InvalidCxxCompiler':
            return True
        e = getattr(e, 'inner_exception', None) or e.__cause__ or e.__context__
    return False


def check_compiler(device):
    """Before any work, where --compile is asked on a CPU: a C++ compiler inductor can use, found the
    way inductor looks for one (torch._inductor.cpp_builder: $CXX, else g++, each run with --version);
    else one line saying what is missing and how to run without it."""
    if torch.device(device).type != 'cpu':
        return
    from torch._inductor import config, cpp_builder
    try:
        cpp_builder.get_cpp_compiler()
    except Exception as e:
        if not compiler_missing(e):
            raise
        search = config.cpp.cxx if isinstance(config.cpp.cxx, (list, tuple)) else (config.cpp.cxx,)
        names = [c for c in search if c]
        raise BadInput(COMPILER_MISSING.format(tried=f" ({', '.join(names)} did not run)" if names else ''))


def run_script(main, interrupted='interrupted'):
    """Run a script's main() and end it as a Unix tool ends:
      a BadInput                 one `error: ...` line, exit code 2
      Ctrl-C                     one line (the KeyboardInterrupt's own message, else `interrupted`), 130
      SIGTERM                    handled as Ctrl-C is (a save under way finishes), the same line, 143
      stdout closed (`>&-`)      refused before main() runs: one line, exit code 2
      a closed pipe (`| head`)   ends quietly, exit code 141 (128 + SIGPIPE), as a tool killed by SIGPIPE
      a full device              one line naming the stream (on stderr, if it can), exit code 1
      no C++ compiler            (torch.compile on a CPU) one line saying what to do, exit code 2
    The process's streams and SIGTERM's handler are given back afterwards (a caller in-process)."""
    if signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL):   # the script's start-up handler
        signal.signal(signal.SIGINT, signal.default_int_handler)                  # hands over to the one below
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    if sigterm is signal.SIG_DFL:   # not where SIGTERM is ignored (nohup-like) or handled by the caller
        signal.signal(signal.SIGTERM, on_sigterm(os.getpid()))
    streams = sys.stdout, sys.stderr
    try:
        if not guard_output():
            say("error: stdout is closed, so nothing this command prints could be seen; send it to a file, or to "
                "/dev/null to drop it")
            quiet_exit(2)
        try:
            try:
                main()
            except SystemExit:   # argparse's --help, a script's own exit: what they printed has to get out
                flush_output()
                raise
            flush_output()
        except OutputLost as e:
            if isinstance(e.error, BrokenPipeError):   # the reader is gone: nothing to say, and no one to say it to
                quiet_exit(141)
            say(f"error: cannot write to {e.stream} ({e.error.strerror or e.error}); stopped, and what it printed "
                f"is incomplete")
            quiet_exit(1)
        except BadInput as e:
            say(f"error: {e}")
            quiet_exit(2)
        except NotImplementedError as e:   # a handout (python -m exercises handout): an exercise not written yet
            say(f"not written yet: {e}")
            quiet_exit(2)
        except KeyboardInterrupt as e:   # a script may raise its own, saying what was saved
            text = str(e) or interrupted
            if terminated(e):
                text = 'terminated (SIGTERM)' + text.removeprefix('interrupted') if text.startswith('interrupted') \
                    else f"terminated (SIGTERM): {text}"
            say(f"\n{text}")
            quiet_exit(143 if terminated(e) else 130)
        except Exception as e:
            if not compiler_missing(e):
                raise
            say(f"error: {COMPILER_MISSING.format(tried='')}")
            quiet_exit(2)
    finally:
        if sigterm is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, sigterm)
        for name, stream in zip(('stdout', 'stderr'), streams):
            if stream is None and getattr(sys, name) is not None:   # the /dev/null guard_output opened
                with suppress(Exception):
                    getattr(sys, name).close()
            if isinstance(getattr(sys, name), GuardedOutput) or stream is None:
                setattr(sys, name, stream)


# ----------------------------------------------------------------------------- device and precision

def pick_device(name=None, flag='--device'):
    """The device to run on: `name` if this machine has it (a one-line error naming `flag` if not),
    else the best available."""
    if name is None:
        if torch.cuda.is_available():
            return 'cuda'
        mps = getattr(torch.backends, 'mps', None)
        return 'mps' if mps is not None and mps.is_available() else 'cpu'
    said = f"{flag} {name}" if flag.startswith('--') else f"{flag}={name!r}"
    if not isinstance(name, (str, torch.device)):
        raise BadInput(f"{said}: not a device; use cpu, cuda, cuda:N or mps")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise BadInput(f"{said}: not a device; use cpu, cuda, cuda:N or mps")
    if dev.type == 'cuda' and not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
        raise BadInput(f"{said}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == 'mps' and not (getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available()):
        raise BadInput(f"{said}: MPS is not available on this machine")
    if dev.type not in ('cpu', 'cuda', 'mps'):
        raise BadInput(f"{said}: use cpu, cuda, cuda:N or mps")
    if dev.type in ('cpu', 'mps') and dev.index not in (None, 0):   # torch takes cpu:1 and runs on the one CPU
        raise BadInput(f"{said}: the {dev.type.upper()} is one device here; use {dev.type}")
    return str(name)


# name -> what it computes in: float32, or bfloat16 by autocast (the weights, the optimizer and the
# sampling arithmetic stay float32; 'auto' is resolved by pick_dtype)
DTYPES = ('auto', 'float32', 'bfloat16')


def pick_dtype(name, device, training=False, flag='--dtype'):
    """'float32' or 'bfloat16' for `name` in DTYPES on `device` (a one-line error where the device
    cannot). auto: bfloat16 for training on a CUDA device that supports it; float32 elsewhere, and
    for decoding always (its greedy output is compared token for token with plain decoding's)."""
    kind = torch.device(device).type
    bf16_ok = kind == 'cpu' or (kind == 'cuda' and torch.cuda.is_bf16_supported())
    if name == 'auto':
        return 'bfloat16' if training and kind == 'cuda' and bf16_ok else 'float32'
    if name not in DTYPES:
        raise BadInput(f"{flag} {name!r}: choose one of {', '.join(DTYPES)}")
    if name == 'bfloat16' and not bf16_ok:
        raise BadInput(f"{flag} bfloat16: not supported on {device} here; use float32")
    return name


class Precision:
    """The precision a piece of work runs at, stated once and entered where it runs:
    `dtype` 'float32', or 'bfloat16' by autocast on the device; `tf32`: float32 matmuls on CUDA
    may round through TF32. Entering sets both and leaving restores what was there, so the TF32
    of a training step never leaks into decoding in the same process (bench.py trains in-process),
    where a k-token verification and a one-token step would otherwise round differently."""

    def __init__(self, dtype='float32', device='cpu', tf32=False):
        self.dtype, self.device_type, self.tf32 = dtype, torch.device(device).type, tf32
        self._stack = []

    def __str__(self):
        return self.dtype + (' autocast' if self.dtype != 'float32' else '') + (' + TF32' if self.tf32 else '')

    def autocast(self):
        # float32 switches autocast off: decoding's float32 inside a bf16 step stays float32
        return torch.autocast(self.device_type, dtype=getattr(torch, self.dtype), enabled=self.dtype != 'float32')

    @contextmanager
    def matmuls(self):
        """Only the float32 matmul precision (TF32 or not; CUDA only: CPU kernels are left alone)."""
        before = torch.get_float32_matmul_precision()
        if self.device_type == 'cuda':
            torch.set_float32_matmul_precision('high' if self.tf32 else 'highest')
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)

    def __enter__(self):
        stack = ExitStack()
        stack.enter_context(self.matmuls())
        stack.enter_context(self.autocast())
        self._stack.append(stack)
        return self

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


def decoding_precision(name, device, tf32=False):
    """generate.py's and bench.py's --dtype and --tf32 as a Precision (one-line errors for what
    means nothing or what the device cannot do)."""
    dtype = pick_dtype(name, device)
    if tf32 and (torch.device(device).type != 'cuda' or dtype != 'float32'):
        raise BadInput(f"--tf32 means nothing here: it applies to float32 on a CUDA device (this run: {dtype} "
                       f"on {device})")
    return Precision(dtype, device, tf32)


# ----------------------------------------------------------------------------- checkpoints

def check_finite(module, what):
    """Refuse weights with a NaN or an inf: they would decode garbage or poison a checkpoint."""
    bad = [n for n, t in module.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise BadInput(f"{what}: non-finite weights in {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ''))


# what stops a script: Ctrl-C, and SIGTERM (`kill`, a scheduler), which run_script handles as Ctrl-C
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def save_before_stop():
    """Ctrl-C or SIGTERM inside the block waits for the block to end: a write that has begun
    finishes (a second signal stops it at once). Only for the signals the main thread has a Python
    handler for (run_script installs them); elsewhere (another thread, a signal ignored or at its
    default) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    handlers = {s: h for s, h in handlers.items() if callable(h)}
    if not handlers:
        yield
        return
    pending = []

    def later(signum, frame):
        if pending:                                 # the second: now
            handlers[signum](signum, frame)
        pending.append((signum, frame))
    for s in handlers:
        signal.signal(s, later)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    if pending:
        signum, frame = pending[0]
        handlers[signum](signum, frame)


def temporary_path(path):
    """Where write_atomically writes `path` first, beside it."""
    return f"{path}.{os.getpid()}.tmp"


def torch_write_error(tmp, error):
    """Why torch's own writer (torch.save to a path) failed on `tmp`, which it reports as a
    RuntimeError without the system's reason: the reason its message names (a name too long, no
    such folder), else the error one more write there gets from the system (a full disk, a file
    size limit), else its message."""
    text = first_line(error, type(error).__name__)
    if 'strerror:' in text:
        return text.split('strerror:', 1)[1].strip()
    try:
        with open(tmp, 'ab') as f:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e.strerror or str(e)
    return f"torch.save: {text}"


def write_atomically(path, write, what='checkpoint'):
    """write(tmp) writes the file at a temporary path beside `path`, which then replaces `path` in
    one rename: a reader sees the old file or the new one, never part of one. Ctrl-C or SIGTERM
    meanwhile is held until the file is in place (save_before_stop); any failure (no space, a
    folder or an immutable file in the way, a second signal) removes the temporary file, leaves
    `path` as it was, and a write error (an OSError, or torch's writer's RuntimeError) is one line
    naming the file and why."""
    tmp = temporary_path(path)
    try:
        with save_before_stop():
            try:
                write(tmp)
                os.replace(tmp, path)
            except BaseException as e:
                why = torch_write_error(tmp, e) if isinstance(e, RuntimeError) else None
                with suppress(OSError):
                    os.remove(tmp)
                if why is not None:
                    raise OSError(why) from None
                raise
    except OSError as e:
        raise BadInput(f"cannot write the {what} {path} ({e.strerror or e}); nothing half-written is left, and "
                       f"{'the previous one is as it was' if os.path.exists(path) else 'there is none'}")


def save_checkpoint(obj, path):
    """torch.save, atomically (write_atomically): an interrupted or failed save leaves the previous
    checkpoint intact and no temporary file."""
    write_atomically(path, lambda tmp: torch.save(obj, tmp))


def check_replaceable(path, what='checkpoint', writable=True):
    """Before any work: a file this run will write can be written there: a name the file system
    holds, and nothing yet or a regular file that can be replaced (a folder in its place is
    refused; writable: an immutable or a read-only file too, which root may write, not an
    immutable one)."""
    check_name_fits(path, what)
    try:
        mode = os.lstat(path).st_mode
    except OSError:   # nothing there yet
        return
    if stat.S_ISLNK(mode):   # the rename replaces the link itself
        return
    why = ('it is a folder' if stat.S_ISDIR(mode) else 'it is not a regular file' if not stat.S_ISREG(mode)
           else 'it is read-only or immutable' if writable and not os.access(path, os.W_OK) else None)
    if why:
        raise BadInput(f"cannot replace the {what} {path}: {why}; nothing was done")


def check_name_fits(path, what='checkpoint'):
    """Before any work: the file system of `path`'s folder can hold its name, and that of the
    temporary file it is written to first (write_atomically), else one line (a long --tag, found
    only once a whole stage had trained and came to save)."""
    folder, tmp = os.path.dirname(path) or '.', temporary_path(path)
    limits = {}
    for key, default in (('PC_NAME_MAX', 255), ('PC_PATH_MAX', 4096)):
        try:
            limits[key] = os.pathconf(folder, key)
        except (OSError, ValueError):   # no such folder yet, or no answer: the usual Linux limits
            limits[key] = default
    name, whole = len(os.fsencode(os.path.basename(tmp))), len(os.fsencode(tmp))
    for part, n, limit in (('name', name, limits['PC_NAME_MAX']), ('path', whole, limits['PC_PATH_MAX'] - 1)):
        if n > limit:
            raise BadInput(f"cannot write the {what} {path}: its {part} and the '{tmp[len(path):]}' of the temporary "
                           f"file written first make {n} bytes, more than the {limit} the file system there allows; "
                           f"use a shorter {part}; nothing was done")


# numpy scalars, as a checkpoint may hold them (a learning rate computed with numpy, a loss): data
# whose unpickling runs nothing but numpy's own constructors, so weights_only loading allows them
NUMPY_SCALARS = [getattr(np, '_core', np.core).multiarray.scalar, np.dtype] + [
    type(np.dtype(t)) for t in (np.float64, np.float32, np.float16, np.int64, np.int32, np.bool_)]


def is_whole(v, lo=None, hi=None):
    """A whole number (an int or a numpy integer, not a bool) within [lo, hi]."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and (lo is None or v >= lo) \
        and (hi is None or v <= hi)


def is_real(v):
    """A finite number (numpy's included, not a bool)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def is_weights(v):
    return isinstance(v, dict) and all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in v.items())


def is_optimizer_state(v):
    """torch.optim's state_dict: {'state': {index: {name: tensor or number}}, 'param_groups': [{'params':
    [index, ...], ...}]}."""
    return (isinstance(v, dict) and isinstance(v.get('state'), dict) and isinstance(v.get('param_groups'), list)
            and all(isinstance(st, dict) and all(isinstance(x, (torch.Tensor, int, float)) for x in st.values())
                    for st in v['state'].values())
            and all(isinstance(g, dict) and isinstance(g.get('params'), list) and all(map(is_whole, g['params']))
                    for g in v['param_groups']))


def is_rng_record(v):
    """train.py's RNG states: {'gen': [...], 'torch': [...], 'dgen': [...]}, a uint8 state per rank."""
    return (isinstance(v, dict) and {'gen', 'torch'} <= set(v)
            and all(isinstance(v[n], list) and v[n] and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                                                           and t.dim() == 1 for t in v[n]) for n in v))


def is_config(v):
    """A run's recorded flags (vars(args) of train.py, nanoGPT's config): a dict whose data path, if
    any, is text (train.py's 'data', nanoGPT's 'dataset')."""
    return v is None or (isinstance(v, dict) and all(v.get(n) is None or isinstance(v[n], str)
                                                     for n in ('data', 'dataset')))


# Every field a checkpoint of this project or of nanoGPT may carry -> (test, what it must be).
# load_checkpoint applies the test to each field present before anything reads it; fields not
# named here are never read.
FIELDS = {
    'kind': (lambda v: isinstance(v, str), 'a name'),
    'model': (is_weights, 'a dict of tensors'),
    'drafter': (is_weights, 'a dict of tensors'),
    'joint_model': (lambda v: v is None or is_weights(v), 'None or a dict of tensors'),
    'model_args': (lambda v: isinstance(v, dict), 'a dict of the model\'s sizes'),
    'config': (is_config, 'a dict of flags whose data path is text'),
    'vocab': (lambda v: v is None or isinstance(v, dict), 'a vocabulary record'),
    'optimizer': (is_optimizer_state, "an optimizer's state_dict"),
    'iter_num': (lambda v: is_whole(v, 0), 'a whole number >= 0'),
    'rng': (is_rng_record, "train.py's RNG states (uint8 tensors per rank)"),
    'best_val_loss': (lambda v: v is None or is_real(v) or (isinstance(v, torch.Tensor) and v.numel() == 1),
                      'a number'),
    'k': (lambda v: is_whole(v, 2), 'a whole number >= 2'),
    'K': (lambda v: is_whole(v, 1), 'a whole number >= 1'),
    'd_hidden': (lambda v: is_whole(v, 1), 'a whole number >= 1'),
    'base_fingerprint': (lambda v: isinstance(v, str), 'a fingerprint (text)'),
    'trained_from': (lambda v: isinstance(v, str), 'a fingerprint (text)'),
    'joint': (lambda v: isinstance(v, bool), 'True or False'),
    'loss': (lambda v: isinstance(v, str), 'a loss name'),
    'temperature': (lambda v: is_real(v) and v > 0, 'a number > 0'),
    'history': (lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and is_whole(p[0]) and is_real(p[1]) for p in v),
        'a list of (step, value) pairs'),
}


def describe(v):
    """A value as an error line quotes it: its type, and the value itself when short."""
    text = repr(v)
    return f"{type(v).__name__} {text}" if len(text) <= 40 else f"a {type(v).__name__}"


def odd_part(value, ok):
    """What is wrong with a field that fails its test `ok`, to quote: for a dict judged entry by entry
    (weights, flags) the first entry that fails ("holds 'lm_head.weight': str 'w'"), else the value
    itself ("is list [1, 2]")."""
    if isinstance(value, dict) and ok in (is_weights, is_config):
        for key, v in value.items():
            if not ok({key: v}):
                return f"holds {key!r}: {describe(v)}"
    return f"is {describe(value)}"


def check_path(path, what='path'):
    if not isinstance(path, (str, os.PathLike)):
        raise BadInput(f"{what} {describe(path)}: give a file name (str or os.PathLike)")
    return os.fspath(path)


def folder_given(path):
    """The line for a folder given where a checkpoint file goes: what it is, and what to give."""
    with suppress(OSError):
        names = sorted(n for n in os.listdir(path) if n.endswith('.pt') and os.path.isfile(os.path.join(path, n)))
        if names:
            first = 'ckpt.pt' if 'ckpt.pt' in names else names[0]
            return (f"{path} is a folder; give a checkpoint file, e.g. {os.path.join(path, first)} (it holds "
                    f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''})")
    return f"{path} is a folder; give a checkpoint file (a .pt file, e.g. the ckpt.pt train.py writes), not a folder"


def load_checkpoint(path, kind=None):
    """torch.load with one-line errors for a missing, corrupt or wrong-kind file. Only tensors and
    plain Python values (and numpy scalars) load (weights_only=True): a file that needs more is
    refused, and nothing in it runs. Every field in FIELDS that the file carries is checked."""
    path = check_path(path, 'checkpoint')
    if os.path.isdir(path):
        raise BadInput(folder_given(path))
    if not os.path.isfile(path):
        raise BadInput(f"checkpoint not found: {path}")
    try:
        with torch.serialization.safe_globals(NUMPY_SCALARS):
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        if 'Weights only load failed' in str(e):  # it names a class or function: refused unloaded
            raise BadInput(f"checkpoint {path} refused: it holds more than tensors and plain values "
                           f"(nothing in it was run)")
        raise BadInput(f"checkpoint {path} is unreadable ({type(e).__name__}); re-train or re-copy it")
    except Exception as e:  # truncated zip, pickle garbage, ...
        raise BadInput(f"checkpoint {path} is unreadable ({type(e).__name__}); re-train or re-copy it")
    if not isinstance(ckpt, dict):
        raise BadInput(f"checkpoint {path} is not a checkpoint dict")
    for name, (ok, want) in FIELDS.items():
        if name in ckpt and not ok(ckpt[name]):
            raise BadInput(f"checkpoint {path}: its {name!r} {odd_part(ckpt[name], ok)}; want {want}")
    if ckpt.get('vocab') is not None:
        Vocab.from_state(ckpt['vocab'], path)
    have = ckpt.get('kind', 'target')
    if kind is not None and have != kind:
        raise BadInput(f"checkpoint {path} holds a {have!r}, expected a {kind!r}")
    return ckpt


def check_model_args(model_args, where):
    """A GPTConfig from a checkpoint's model_args (or train.py's flags), every size checked for type
    and range; a field it lacks takes GPTConfig's default, as nanoGPT's older files need."""
    if not isinstance(model_args, dict):
        raise BadInput(f"{where}: its model_args is {describe(model_args)}; want a dict of the model's sizes")
    for name in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'):
        if name in model_args and not is_whole(model_args[name], 1):
            raise BadInput(f"{where}: model_args {name} is {describe(model_args[name])}; want a whole number >= 1")
    if 'dropout' in model_args and not (is_real(model_args['dropout']) and 0 <= model_args['dropout'] < 1):
        raise BadInput(f"{where}: model_args dropout is {describe(model_args['dropout'])}; want a number in [0, 1)")
    if 'bias' in model_args and not isinstance(model_args['bias'], bool):
        raise BadInput(f"{where}: model_args bias is {describe(model_args['bias'])}; want True or False")
    config = GPTConfig.from_dict(model_args)
    if config.n_embd % config.n_head:
        raise BadInput(f"{where}: model_args n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    return config


def config_of(ckpt, path):
    """The checked GPTConfig of a target checkpoint dict (check_model_args), without its weights."""
    if 'model_args' not in ckpt:
        raise BadInput(f"checkpoint {path} has no 'model_args': not a GPT checkpoint")
    return check_model_args(ckpt['model_args'], f"checkpoint {path}")


def weight_count(config):
    """How many weights GPT(config) holds, tied ones counted once per name as a state_dict lists them,
    by arithmetic: a one-layer model built on the meta device (no memory) gives what lies outside
    the layers and one layer's share."""
    with torch.device('meta'):
        one = GPT(dataclasses.replace(config, n_layer=1))
    sizes = {n: t.numel() for n, t in one.state_dict().items()}
    layer = sum(v for n, v in sizes.items() if n.startswith('transformer.h.0.'))
    return sum(sizes.values()) - layer + config.n_layer * layer


def gigabytes(n_bytes):
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e8 else f"{n_bytes / 1e6:.1f} MB" if n_bytes >= 1e5 \
        else f"{n_bytes / 1e3:.1f} kB"


def memory_free(device):
    """Bytes free on `device` now (CPU: MemAvailable of /proc/meminfo, else the free pages; CUDA: the
    driver's count), or None where this machine does not say."""
    kind = torch.device(device).type
    try:
        if kind == 'cuda':
            return torch.cuda.mem_get_info(torch.device(device))[0]
        if kind == 'cpu':
            with suppress(OSError):
                with open('/proc/meminfo') as f:
                    for line in f:
                        if line.startswith('MemAvailable:'):
                            return int(line.split()[1]) * 1024
            return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None


def check_fits(n_bytes, device, what):
    """Refuse work that needs more memory than `device` has free, by arithmetic, before any tensor."""
    free = memory_free(device)
    if free is not None and n_bytes > free:
        raise BadInput(f"{what} needs {gigabytes(n_bytes)}, more than the {gigabytes(free)} free on {device} here")


def load_target(path, device='cpu'):
    """A target GPT from a checkpoint of ours or nanoGPT's."""
    device = pick_device(device, 'device')
    return target_from(load_checkpoint(path), path, device)


def target_from(ckpt, path, device='cpu'):
    """The target GPT of a loaded checkpoint dict (path: for messages); non-finite weights refused.
    Its model_args are checked against the weights the file holds, in bytes, before any tensor is
    made: a crafted config (a million layers over a small file) is refused, not allocated."""
    if 'model' not in ckpt or 'model_args' not in ckpt:
        raise BadInput(f"checkpoint {path} has no 'model'/'model_args': not a GPT checkpoint")
    config = check_model_args(ckpt['model_args'], f"checkpoint {path}")
    weights = {n.removeprefix('_orig_mod.'): t for n, t in ckpt['model'].items()}
    held = sum(t.numel() for n, t in weights.items() if not n.endswith(('.attn.bias', '.attn.masked_bias')))
    want = weight_count(config)
    if want != held:
        sizes = ', '.join(f"{n}={getattr(config, n)}"
                          for n in ('n_layer', 'n_head', 'n_embd', 'block_size', 'vocab_size'))
        raise BadInput(f"checkpoint {path}: its model_args ({sizes}) do not fit its weights: they make {want:,} "
                       f"({gigabytes(4 * want)} in float32), the file holds {held:,} ({gigabytes(4 * held)})")
    check_fits(4 * want, device, f"the model of {path}")
    try:
        model = GPT.from_checkpoint(dict(ckpt, model_args=dataclasses.asdict(config)))
    except Exception as e:  # any malformed content: shapes, types, impossible sizes
        raise BadInput(f"checkpoint {path}: weights do not fit its config ({first_line(e, type(e).__name__)})")
    check_finite(model, f"checkpoint {path}")
    return model.to(device).eval()


# ----------------------------------------------------------------------------- vocabularies

class Vocab:
    """Text <-> token ids. kind 'bytes' | 'char' (itos: the symbol of every id) | 'gpt2'."""

    def __init__(self, kind='bytes', itos=None):
        self.kind, self.itos = kind, itos
        if kind == 'char':
            self.stoi = {s: i for i, s in enumerate(itos)}

    @functools.cached_property
    def bpe(self):
        try:
            import tiktoken  # optional: only the text of GPT-2-vocabulary models needs it
        except ImportError:
            raise BadInput("a GPT-2-vocabulary model needs tiktoken for its text: pip install tiktoken")
        return tiktoken.get_encoding('gpt2')

    @property
    def size(self):
        return {'bytes': 256, 'char': len(self.itos or ()), 'gpt2': 50257}[self.kind]

    def __eq__(self, other):
        return isinstance(other, Vocab) and self.state() == other.state()

    def __repr__(self):
        return f"{self.kind} vocabulary ({self.size} symbols)"

    def encode(self, text, what='the prompt'):
        """Ids of `text`; a symbol the vocabulary lacks is a one-line error naming it."""
        if not isinstance(text, str):
            raise BadInput(f"{what} is {describe(text)}; want text (a str)")
        if self.kind == 'bytes':   # surrogateescape: a non-UTF-8 command line gives its own bytes
            return list(text.encode('utf-8', 'surrogateescape'))
        if self.kind == 'gpt2':
            return self.bpe.encode(text, allowed_special={'<|endoftext|>'})
        missing = sorted({c for c in text if c not in self.stoi})
        if missing:
            raise BadInput(f"{what} has {len(missing)} character(s) outside the model's {self.size}-symbol "
                           f"vocabulary: {''.join(missing)[:40]!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        """The text of a sequence of token ids (a list, or a 1-D tensor); an id the vocabulary lacks
        (past its end, or negative) has no text."""
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError, RuntimeError):
            raise BadInput(f"ids {describe(ids)}: want a sequence of token ids (a list of ints or a 1-D tensor)")
        if self.kind == 'bytes':
            return bytes(i for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')
        if self.kind == 'gpt2':   # ids of nanoGPT's padding (50257..50303) have no text
            return self.bpe.decode([i for i in ids if 0 <= i < 50257])
        return ''.join(self.itos[i] if 0 <= i < len(self.itos) else '\ufffd' for i in ids)

    def state(self):
        """Plain values, for a checkpoint."""
        return dict(kind=self.kind, itos=self.itos)

    @classmethod
    def from_state(cls, state, where):
        try:
            kind, itos = state['kind'], state.get('itos')
            assert kind in ('bytes', 'char', 'gpt2')
            assert kind != 'char' or (isinstance(itos, list) and all(isinstance(s, str) for s in itos))
        except (AssertionError, KeyError, TypeError, AttributeError):
            raise BadInput(f"{where}: malformed vocabulary record")
        return cls(kind, itos)


class _NoCode(pickle.Unpickler):
    """Unpickles plain data only: any class or function the file names is refused before it is
    looked up, so nothing in the file can run."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_meta(path):
    """A nanoGPT meta.pkl ({'vocab_size', 'stoi', 'itos'}) as a char Vocab, read without executing
    anything: only dicts, strings and ints are accepted."""
    path = check_path(path, 'meta')
    try:
        with open(path, 'rb') as f:
            meta = _NoCode(f).load()
    except OSError as e:
        raise BadInput(f"meta file {path}: {e.strerror or e}")
    except Exception as e:
        raise BadInput(f"meta file {path} refused: not a plain nanoGPT meta.pkl ({e})")
    itos = meta.get('itos') if isinstance(meta, dict) else None
    ok = (isinstance(itos, dict) and sorted(itos) == list(range(len(itos)))
          and all(isinstance(s, str) for s in itos.values()))
    if not ok:
        raise BadInput(f"meta file {path}: no 'itos' mapping ids 0..n-1 to strings")
    return Vocab('char', [itos[i] for i in range(len(itos))])


def vocab_for(ckpt, path, vocab_size, meta=None):
    """The vocabulary of a target checkpoint: --meta if given (refused if it is not the one the
    checkpoint records); the one this project recorded in it;
    nanoGPT's meta.pkl where its sample.py looks (data/<config dataset>/meta.pkl) or beside the
    checkpoint; else by size: 256 is bytes, 50257 / 50304 is GPT-2."""
    recorded = ckpt.get('vocab') and Vocab.from_state(ckpt['vocab'], path)
    if meta:
        vocab = read_meta(meta)
        if recorded and vocab != recorded:   # a checkpoint of ours says which vocabulary it was trained in
            raise BadInput(f"--meta {meta}: its {vocab} is not the {recorded} {path} records; leave --meta out")
    elif recorded:
        vocab = recorded
    else:
        dataset = (ckpt.get('config') or {}).get('dataset')
        found = [p for p in ([os.path.join('data', str(dataset), 'meta.pkl')] if dataset else [])
                 + [os.path.join(os.path.dirname(path), 'meta.pkl')] if os.path.isfile(p)]
        if found:
            vocab = read_meta(found[0])
        elif vocab_size == 256:
            vocab = Vocab('bytes')
        elif vocab_size in GPT2_SIZES:
            vocab = Vocab('gpt2')
        else:
            raise BadInput(f"{path}: no vocabulary found for its {vocab_size}-token model "
                           f"(no meta.pkl in data/{dataset or '<dataset>'}/ or beside it); give --meta PATH")
    if vocab.size > vocab_size:
        raise BadInput(f"{path}: its model has {vocab_size} token ids, fewer than the {vocab}")
    return vocab


def load_vocab(path, meta=None):
    """The vocabulary of the target checkpoint at `path`, found as `vocab_for` finds it."""
    ckpt = load_checkpoint(path)
    return vocab_for(ckpt, path, config_of(ckpt, path).vocab_size, meta)


# ----------------------------------------------------------------------------- corpora

def regular_files(root):
    """Every regular, readable file under root, sorted; FIFOs, sockets, devices and broken links
    are skipped (reading a FIFO would wait forever) and counted."""
    files, skipped = [], 0
    for d, dirs, names in os.walk(root):
        dirs.sort()
        for n in names:
            p = os.path.join(d, n)
            try:
                ok = stat.S_ISREG(os.stat(p).st_mode)
            except OSError:   # a broken link
                ok = False
            files += [p] if ok else []
            skipped += not ok
    return sorted(files), skipped


def corpus_files(path=None):
    """The default corpus: the interpreter's standard library .py files, sorted, without
    site-packages and test folders. With a path: that text file, or every file under that folder."""
    if path is None:
        root = sysconfig.get_paths()['stdlib']
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ('site-packages', 'dist-packages', 'test', 'tests',
                                                            'idle_test', '__pycache__'))
            files += [os.path.join(d, n) for n in names if n.endswith('.py')]
        return sorted(files), 0
    if os.path.isdir(path):
        return regular_files(path)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise BadInput(f"--data {path}: not a regular file or folder")
    if os.path.isfile(path):
        return [path], 0
    raise BadInput(f"--data {path}: no such file or folder")


def read_bytes(f, flag='--data'):
    try:
        with open(f, 'rb') as fh:
            return fh.read()
    except OSError as e:
        raise BadInput(f"{flag}: cannot read {f} ({e.strerror or e})")


class Dataset:
    """train, val: 1-D arrays of token ids; vocab: the Vocab they are in, or None (a nanoGPT
    dataset without meta.pkl: GPT-2 ids, as nanoGPT assumes); meta: the meta.pkl it was read from."""

    def __init__(self, train, val, vocab, source, meta=None):
        self.train, self.val, self.vocab, self.source, self.meta = train, val, vocab, source, meta

    def check(self, vocab_size, vocab, flag='--data'):
        """Refuse ids the model does not have, or data in another vocabulary than the model's."""
        if self.vocab is not None and vocab is not None and self.vocab != vocab:
            raise BadInput(f"{flag} {self.source}: its {self.vocab} is not the model's {vocab}")
        top = max(int(self.train.max()), int(self.val.max()))
        if top >= vocab_size:
            raise BadInput(f"{flag} {self.source}: holds token id {top}, but the model has only {vocab_size} "
                           f"ids (0..{vocab_size - 1})")
        return self


def nanogpt_bins(data, flag='--data'):
    """The train.bin and val.bin of a nanoGPT dataset folder, checked (each there, a regular readable
    file, a whole number of uint16 ids, enough of them), or None where `data` is not such a folder."""
    bins = {split: os.path.join(data, f'{split}.bin') for split in ('train', 'val')} if data else {}
    there = [split for split, p in bins.items() if os.path.lexists(p)]
    if not there:
        return None
    for split, p in bins.items():
        if split not in there:
            raise BadInput(f"{flag} {data}: a nanoGPT dataset folder holds train.bin and val.bin; {split}.bin is "
                           f"missing")
        if not os.path.isfile(p):
            raise BadInput(f"{flag} {data}: {split}.bin is not a regular file")
        if not os.access(p, os.R_OK):   # a one-line error, not a traceback from numpy
            raise BadInput(f"{flag} {data}: cannot read {split}.bin")
        size = os.path.getsize(p)
        if size % 2:
            raise BadInput(f"{flag} {data}: {split}.bin has {size} bytes, not a whole number of token ids (uint16, "
                           f"2 bytes each): truncated or not nanoGPT's")
        if size < 2 * (PROMPT_LEN + 2):
            raise BadInput(f"{flag} {data}: {split}.bin holds too few tokens")
    return bins


def load_dataset(data, cache_dir, write_cache=True, flag='--data'):
    """The corpus as a Dataset. A nanoGPT dataset folder (train.bin, val.bin) is memory-mapped as
    it is. Text is read as bytes and cached under cache_dir (write_cache=False: a cache there is
    read, none is written); held-out split by file: every 20th file (a single file: its last 10%)."""
    bins = nanogpt_bins(data, flag)
    if bins:
        arrays = [np.memmap(bins[split], dtype=np.uint16, mode='r') for split in ('train', 'val')]
        meta = os.path.join(data, 'meta.pkl')
        if not os.path.isfile(meta):
            return Dataset(*arrays, None, data)
        return Dataset(*arrays, read_meta(meta), data, meta)
    files, skipped = corpus_files(data)
    # the cache key names the files and their sizes and dates: edit the corpus, get a new cache
    h = hashlib.sha1()
    for f in files:
        st = os.stat(f)
        h.update(f'{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}\n'.encode())
    key = ('stdlib' if data is None else 'data') + '-' + h.hexdigest()[:12]
    paths = [os.path.join(cache_dir, f'{key}_{s}.bin') for s in ('train', 'val')]
    if all(os.path.exists(p) for p in paths):
        return Dataset(*(np.fromfile(p, dtype=np.uint8) for p in paths), Vocab('bytes'), data or 'stdlib')
    texts = [b for b in map(read_bytes, files) if b and b'\0' not in b[:4096]]   # skip binaries
    if skipped:
        print(f"note: {flag} {data}: skipped {skipped} entries that are not regular files (FIFOs, sockets, "
              f"broken links)")
    if not texts or sum(map(len, texts)) < 1024:
        raise BadInput(f"{flag} {data}: holds no text (need at least 1 KiB of text files)")
    if len(texts) == 1:
        cut = int(len(texts[0]) * 0.9)
        train, val = texts[0][:cut], texts[0][cut:]
    else:
        train = b''.join(t for i, t in enumerate(texts) if i % 20 != 19)
        val = b''.join(t for i, t in enumerate(texts) if i % 20 == 19) or texts[-1]
    arrays = (np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8))
    if write_cache:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise BadInput(f"cannot write the corpus cache in {cache_dir} ({e.strerror or e})")
        for arr, p in zip(arrays, paths):
            write_atomically(p, arr.tofile, 'corpus cache')
    return Dataset(*arrays, Vocab('bytes'), data or 'stdlib')


def check_out_dir(path, flag='--out-dir'):
    """The output folder exists and can be written to, before any work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f'.write-test-{os.getpid()}')
        with open(probe, 'w'):
            pass
        os.remove(probe)
    except OSError as e:
        raise BadInput(f"{flag} {path}: cannot write there ({e.strerror or e})")


def windows(data, n, length, gen):
    """n random windows (n, length) of a 1-D id array, as a LongTensor."""
    ix = torch.randint(len(data) - length, (n,), generator=gen).numpy()
    return torch.from_numpy(np.stack([data[i:i + length] for i in ix]).astype(np.int64))


def heldout_prompts(val, n, length, newline=ord('\n'), seed=1234):
    """n held-out prompts that start at a line start (`newline`: the id of '\\n', None if the
    vocabulary has none): the same ones for every comparison."""
    starts = np.flatnonzero(np.asarray(val[:-length - 1]) == newline) + 1 if newline is not None else []
    if len(starts) < n:  # text with few lines: any position will do
        starts = np.arange(len(val) - length)
    rng = np.random.default_rng(seed)
    ix = rng.choice(starts, size=n, replace=False)
    return torch.from_numpy(np.stack([val[i:i + length] for i in ix]).astype(np.int64))


def heldout_prompts_of(out_dir='out', n=DEMO_PROMPTS, device='cpu'):
    """The held-out prompts train.py's closing demos decode, (n, PROMPT_LEN) token ids, from its
    output folder (or its target's checkpoint file): the data and vocabulary its target,
    out_dir/ckpt.pt, records (a nanoGPT checkpoint: data/<its dataset>, where nanoGPT keeps it). Reading writes nothing: the corpus
    cache train.py left in out_dir/data is read when it is there, else the text is read again and
    not cached."""
    out_dir = check_path(out_dir, 'out_dir')
    if not is_whole(n, 1):
        raise BadInput(f"n={n!r}: how many prompts, a whole number >= 1")
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.isfile(out_dir):   # the target's checkpoint itself: its folder is the run's
        path, out_dir = out_dir, os.path.dirname(out_dir) or '.'
    ckpt = load_checkpoint(path)
    vocab = vocab_for(ckpt, path, config_of(ckpt, path).vocab_size)
    config = ckpt.get('config') or {}
    data = config.get('data')
    if 'data' not in config and config.get('dataset'):    # nanoGPT's train.py
        data = os.path.join('data', config['dataset'])
    if data is not None and not os.path.exists(data):
        raise BadInput(f"{path} was trained on {data}, which is not there (from {os.getcwd()})")
    val = load_dataset(data, os.path.join(out_dir, 'data'), write_cache=False, flag=f"the data of {path},").val
    if len(val) < PROMPT_LEN + n + 1:
        raise BadInput(f"n={n}: the held-out text of {path} is too short for that many prompts")
    return heldout_prompts(val, n, PROMPT_LEN, newline_id(vocab)).to(pick_device(device, 'device'))


def newline_id(vocab):
    """The id of '\\n' in `vocab` (GPT-2's when None: a nanoGPT dataset without meta.pkl), or None."""
    if vocab is None or vocab.kind == 'gpt2':
        return 198
    return 10 if vocab.kind == 'bytes' else vocab.stoi.get('\n')
