"""
What every command line of the project shares, and the Python API's one error: how bad input is
refused, and how a script ends. None of it is the algorithm; generate.py, train.py, bench.py,
gpu_check.py and the exercises' runner all run through it.

Errors and flags: every user error is a `BadInput` (generate() raises it too), which the scripts
print as one `error:` line; `ArgumentParser` and `check_number` make argparse's and a flag's range
errors one line as well.

Threads: `intra_op_threads` (the scripts' choice, set for the process) and `num_threads` (a setting
for the length of a `with` block, restored afterwards; decode.generate uses it per call).

How a script ends (`run_script`): a BadInput with its line (exit code 2); Ctrl-C and SIGTERM with a
line saying what was kept, a save under way finishing first (130, 143); output that cannot be
written as a Unix tool's does: a closed pipe quietly (141), a full device with one line (1), and
a closed stdout refused before any work; --compile with no C++ compiler to build with, one line.

Device and precision: `pick_device`, `pick_dtype` and `Precision` (float32 or bf16 autocast, TF32
or not, entered where a piece of work runs and restored after it).

Writing files (`write_atomically`): an interrupted or failed write leaves no temporary file and the
previous file as it was; a name the file system cannot hold is refused before any work
(`check_replaceable`).
"""
import argparse
import math
import os
import signal
import stat
import sys
import threading
import time
from contextlib import ExitStack, contextmanager, suppress

import torch

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
        allowed = ' and '.join(['finite'] * (not (isinstance(value, int) or math.isfinite(value)))
                               + [f"{'>' if open_lo else '>='} {lo}"] * (lo is not None)
                               + [f"{'<' if open_hi else '<='} {hi}"] * (hi is not None)) or 'finite'
        raise BadInput(f"{flag} {value}: must be {allowed}" + (f" ({note})" if note else ''))
    return value


# ----------------------------------------------------------------------------- threads

# A model this small decodes one token in operations too small to split between threads
# (bench/threads/RESULTS.md): one thread is as fast on a quiet machine, and many times faster beside
# a busy one.
SMALL_MODEL = 20_000_000   # parameters


def intra_op_threads(threads=None, small=False):
    """Set the threads torch's CPU kernels use and return how many: `threads` when given (--threads),
    else one for small work (decoding a model under SMALL_MODEL parameters), else every core not
    already busy (busy_cores), at least one. Measured on 2 cores (bench/threads/RESULTS.md): beside
    busy processes two threads were up to 1.7x slower than one for a training step and up to 110x
    for a decode, each thread waiting for the other at every operation; on a quiet machine two were
    1.7x faster for training and no faster for decoding."""
    if threads is None:
        cores = os.cpu_count() or 1
        threads = 1 if small else free_cores(cores, busy_cores(cores))
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
    watch = CoreWatch(cores)
    time.sleep(window)
    busy = watch.busy()
    if busy is None:
        return os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.0
    return busy


class CoreWatch:
    """The cores other processes kept busy between two readings of /proc/stat (Linux), less this
    process's own CPU time: torch's worker threads spin for a while after parallel work, and a
    process that trains counts itself out. busy() reads since the last reading, so a loop that calls
    it now and then measures without sleeping. None where /proc/stat cannot be read."""

    def __init__(self, cores):
        self.cores, self.last = cores, self.snap()

    @staticmethod
    def snap():
        try:
            with open('/proc/stat') as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
            return sum(ticks), ticks[3] + ticks[4], time.process_time(), time.perf_counter()
        except (OSError, ValueError, IndexError):
            return None

    def busy(self):
        before, now = self.last, self.snap()
        self.last = now
        if now is None or before is None or now[3] <= before[3]:
            return None
        (total0, idle0, own0, t0), (total1, idle1, own1, t1) = before, now
        own = (own1 - own0) / (t1 - t0)
        return max(0.0, self.cores * (1 - (idle1 - idle0) / max(1, total1 - total0)) - own)


def free_cores(cores, busy):
    """The threads that fit beside `busy` cores of other work: the cores left, at least one."""
    return max(1, min(cores, cores - round(busy)))


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
    if out is sys.__stdout__ and getattr(out, 'errors', None) == 'strict':   # an ASCII locale, say
        out.reconfigure(errors='backslashreplace')      # a character it cannot encode, as stderr shows it
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


# ----------------------------------------------------------------------------- writing files

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
    one rename: a reader sees the old file or the new one, never part of one, and the new one is
    on the disk before the rename (fsync), so that a machine that loses power meanwhile keeps one
    of the two whole rather than a renamed file whose data never reached the disk. Ctrl-C or SIGTERM
    meanwhile is held until the file is in place (save_before_stop); any failure (no space, a
    folder or an immutable file in the way, a second signal) removes the temporary file, leaves
    `path` as it was, and a write error (an OSError, or torch's writer's RuntimeError) is one line
    naming the file and why."""
    tmp = temporary_path(path)
    try:
        with save_before_stop():
            try:
                write(tmp)
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
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
