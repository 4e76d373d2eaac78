"""
`python -m exercises check N` runs the checks in a worker process, and counts a check as passed
only when that worker says so on its own channel. The threat model (exercises/README.md says it to
students): nothing here stops a student who edits the grader's files on disk, since an instructor
grades from a clean copy; but the code under test must not fake a pass from inside the run, and a
student.py that crashes or hangs is a failed check with a reason, not a traceback or a silence.

- The worker is this process forked, torch and the checks already imported (no second import of
  torch, which alone takes about 2 s), or, where forking is not safe (not Linux), a fresh Python
  started as `python -m exercises.worker`. It runs in a process group of its own, which is killed
  when the run ends, with anything the code under test started.
- Its results come back on a pipe of their own, each line carrying a random key made for that
  worker: what the code under test prints comes back on another pipe and is shown as its output,
  and a line without the key counts for nothing. A check passes only on a result line with the
  key that says it passed: a worker that exits early (sys.exit or os._exit, at import or inside a
  check), crashes or is killed has reported no pass for what it had not finished.
- The worker takes its runner, the check functions and the key before loading the code under
  test, so replacing harness.run_check or a check function does not change what runs; and after
  loading it and after each check it compares the functions and values of the harness, the
  checks, the project's modules and classes, torch, Python's builtins and the standard modules
  the checks compute with (math, statistics: a test's critical value; itertools, functools, copy)
  with what they were before: anything replaced is put back, and the check (or, at import, every
  check) fails, naming it.
- Time: loading student.py and each check get LIMIT seconds; past that the worker is killed and
  the check fails, and the checks after it are not run (a loop there would most likely loop in
  them too). After a crash or an exit inside a check, a new worker runs the checks after it.
- Files: the grader's files (the project's modules, the harness, the checks, the solutions) are
  read before the run and compared after each worker; if any changed, no check of the run counts.
  A file of the exercises (the harness, a checks.py, a solution) is written back as it was, so that
  a later run, --solution's included, reads what it read before; a module of the project that
  changed or appeared (one would shadow an import) is named, not touched, since it may be the edit
  of someone working on the project meanwhile.
"""
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from glob import glob

import torch

from exercises import harness

LIMIT = 120.0          # seconds for loading student.py, and for each check (the longest takes a few)
OUTPUT_LINES = 40      # lines of the code under test's output shown per check; the rest are counted
FORK = sys.platform.startswith('linux')   # elsewhere forking after torch's import is not safe


# ----------------------------------------------------------------------------- in the worker

class Watch:
    """The functions and values the checks rely on, as they were before the code under test ran:
    every attribute of the harness, the checks, the project's modules and their classes, torch,
    torch.nn.functional, torch.Tensor, torch.nn.Module, builtins and the standard modules the
    checks compute with (submodules aside, which torch loads lazily). changed() names, and puts
    back, those that are no longer the same objects."""

    def __init__(self, checks):
        import builtins
        import copy
        import functools
        import itertools
        import math
        import statistics

        import arguments
        import cli
        import data
        import dblast
        import decode
        import drafters
        import generate
        import heads
        import model
        import runner
        import train
        import trainer
        import verification
        modules = [harness, checks, verification, decode, model, dblast, heads, drafters, runner, cli, arguments, data,
                   generate, trainer, train]
        owners = [(m.__name__, m) for m in modules] + [
            (c.__module__ + '.' + c.__name__, c) for m in modules for c in vars(m).values()
            if isinstance(c, type) and c.__module__ == m.__name__]
        owners += [('torch', torch), ('torch.nn.functional', torch.nn.functional), ('torch.Tensor', torch.Tensor),
                   ('torch.nn.Module', torch.nn.Module), ('builtins', builtins)]
        # the standard library's: a critical value is statistics.NormalDist's (harness.critical)
        owners += [(m.__name__, m) for m in (math, statistics, itertools, functools, copy)]
        owners += [('statistics.NormalDist', statistics.NormalDist)]
        self.seen = [(label, owner, name, value) for label, owner in owners
                     for name, value in list(vars(owner).items()) if not isinstance(value, type(os))]

    def changed(self):
        found = []
        for i, (label, owner, name, value) in enumerate(self.seen):
            now = vars(owner).get(name, harness.MISSING)
            if now is value:
                continue
            if wrapper_of(now, value):  # torch's own lazy wrapping (torch._dynamo's of torch.manual_seed)
                self.seen[i] = (label, owner, name, now)
                continue
            found.append(f"{label}.{name}")
            setattr(owner, name, value)
        return found


def wrapper_of(new, old):
    """Is `new` a wrapper of `old` (functools.wraps's __wrapped__, followed down), or torch's own patch of
    it (a function of torch's files that closes over it: torch._dynamo's of torch.nn.Module.__init__ and
    __setstate__, made at the first call of a function decorated with @torch.compile)?"""
    if torch_patch_of(new, old):
        return True
    for _ in range(8):
        new = getattr(new, '__wrapped__', None)
        if new is None:
            return False
        if new is old:
            return True
    return False


TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def torch_patch_of(new, old):
    code = getattr(new, '__code__', None)
    if code is None or not os.path.abspath(code.co_filename).startswith(TORCH_DIR):
        return False
    for cell in getattr(new, '__closure__', None) or ():
        try:
            if cell.cell_contents is old:
                return True
        except ValueError:                 # an empty cell
            continue
    return False


def replaced(names, when):
    more = f" and {len(names) - 3} more" if len(names) > 3 else ''
    return (f"the code under test replaced {', '.join(names[:3])}{more} {when} (put back): a check counts only on "
            f"the grader's and torch's own functions")


def serve(n, which, first, send):
    """Run exercise n's checks from index `first` on `which`, reporting each with send(event, **fields)."""
    checks = harness.checks_of(n)
    functions = harness.check_functions(checks)
    run_check, failed, asdict = harness.run_check, harness.failed, vars       # taken before any code under test
    watch = Watch(checks)
    try:
        impl = harness.implementation(n, which)
        reason = ''
    except harness.NotLoaded as e:
        reason = str(e)
    changed = watch.changed()
    if changed:
        reason = replaced(changed, 'while student.py loaded')
    send('loaded', reason=reason)
    if reason:
        return
    for index in range(first, len(functions)):
        name, fn = functions[index]
        send('start', index=index)
        result = run_check(checks, impl, name, fn)
        changed = watch.changed()
        if changed:
            result = failed(name, fn, replaced(changed, 'during this check'), result.seconds)
        send('result', index=index, **asdict(result))
    send('done')


def sender(fd, key):
    """send(event, **fields): one JSON line with the key on the results pipe. The key and the pipe
    live in this closure, made before the code under test is loaded."""
    write, dumps, flush = os.write, json.dumps, sys.stdout.flush

    def send(event, **fields):
        flush()                                   # the check's own output first
        data = (dumps(dict(fields, key=key, event=event)) + '\n').encode()
        while data:
            data = data[write(fd, data):]
    return send


def child(n, which, first, key, results, output):
    """The forked worker: its output to the output pipe, its reports to the results pipe; it never
    returns into the caller's stack (os._exit)."""
    code = 1
    try:
        os.setpgid(0, 0)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)     # input() gets EOF, never waits on a terminal
        os.dup2(output, 1)
        os.dup2(output, 2)
        # nothing of the parent's but the results pipe stays open here (a test runner's files, say)
        os.closerange(3, results)
        os.closerange(results + 1, max(results + 1, os.sysconf('SC_OPEN_MAX') if hasattr(os, 'sysconf') else 1024))
        sys.stdout = open(1, 'w', buffering=1, closefd=False)
        sys.stderr = open(2, 'w', buffering=1, closefd=False)
        serve(n, which, first, sender(results, key))
        code = 0
    except BaseException:
        try:
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
        except BaseException:
            pass
    finally:
        os._exit(code)


# ----------------------------------------------------------------------------- in the parent

def grader_files():
    """{path: bytes} of the files the checks are judged by: the project's modules, the harness,
    every exercise's checks.py and the solutions (student.py files are the student's)."""
    paths = glob(os.path.join(harness.ROOT, '*.py')) + glob(os.path.join(harness.HERE, '*.py')) + \
        glob(os.path.join(harness.HERE, '*', 'checks.py')) + glob(os.path.join(harness.HERE, 'solutions', '*.py'))
    out = {}
    for path in paths:
        with open(path, 'rb') as f:
            out[path] = f.read()
    return out


def compare(before):
    """The grader's files against `before`, after a worker: -> (put back, changed). A file of the
    exercises (the harness, a checks.py, a solution) that changed or went is written back as it was:
    nobody but an instructor edits those. A module of the project that changed or appeared is only
    named: it may be an edit of someone working on the project while the checks ran."""
    now = grader_files()
    put, changed = [], []
    for path in sorted(set(before) | set(now)):
        if now.get(path) == before.get(path):
            continue
        if path.startswith(harness.HERE + os.sep) and path in before:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, 'wb') as f:
                f.write(before[path])
            os.replace(tmp, path)
            put.append(os.path.relpath(path, harness.ROOT))
        else:
            changed.append(os.path.relpath(path, harness.ROOT))
    return put, changed


class Worker:
    """One worker process running exercise n's checks from index `first`, and the pipes it reports on."""

    def __init__(self, n, which, first):
        self.key = secrets.token_hex(16)
        results_r, results_w = os.pipe()
        output_r, output_w = os.pipe()
        if FORK:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(results_r)
                os.close(output_r)
                child(n, which, first, self.key, results_w, output_w)
            try:
                os.setpgid(pid, pid)   # the child does the same: whichever runs first
            except OSError:
                pass
            self.pid, self.proc = pid, None
        else:
            self.proc = subprocess.Popen(
                [sys.executable, '-m', 'exercises.worker', str(n), which, str(first), str(results_w),
                 str(torch.get_num_threads())], cwd=harness.ROOT, stdin=subprocess.PIPE, stdout=output_w,
                stderr=output_w, pass_fds=(results_w,), start_new_session=True)
            self.proc.stdin.write((self.key + '\n').encode())
            self.proc.stdin.close()
            self.pid = self.proc.pid
        os.close(results_w)
        os.close(output_w)
        self.results, self.output = results_r, output_r
        self.pending = b''             # a report line not yet whole

    def read(self, timeout):
        """Wait up to `timeout` s for the worker: -> (its reports, its output's new text, whether its
        results pipe is closed). Reports without the key are dropped."""
        ready, _, _ = select.select([self.results, self.output], [], [], max(0.0, timeout))
        text, events, ended = '', [], False
        if self.output in ready:
            text = os.read(self.output, 1 << 16).decode(errors='replace')
        if self.results in ready:
            chunk = os.read(self.results, 1 << 16)
            ended = not chunk
            self.pending += chunk
            *whole, self.pending = self.pending.split(b'\n')
            for line in whole:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get('key') == self.key:
                    events.append(event)
        return events, text, ended

    def rest_of_output(self):
        """What the worker wrote that was not read yet (after its results pipe closed)."""
        out = ''
        while select.select([self.output], [], [], 0.2)[0]:
            chunk = os.read(self.output, 1 << 16)
            if not chunk:
                break
            out += chunk.decode(errors='replace')
        return out

    def stop(self):
        """Kill the worker's process group and collect its exit: 'exit code N' or 'killed by SIGX'."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            pass
        _, status = os.waitpid(self.pid, 0)
        if self.proc is not None:
            self.proc.returncode = status
        for fd in (self.results, self.output):
            os.close(fd)
        if os.WIFSIGNALED(status):
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        return f"exit code {os.waitstatus_to_exitcode(status)}"


class Run:
    """Exercise n's checks on `which` in worker processes. Iterating yields one Result per check, in
    order, as each ends, and writes what the code under test prints to `out` (OUTPUT_LINES a
    check). Afterwards `tampered` says which of the grader's files changed during the run (see
    compare), '' if none: the run then counts for nothing."""

    def __init__(self, n, which='student', out=None, limit=None):
        self.n, self.which, self.out = n, which, out or sys.stdout
        self.limit = LIMIT if limit is None else limit
        self.functions = harness.check_functions(harness.checks_of(n))
        self.tampered = ''

    def __iter__(self):
        before = grader_files()
        index = 0
        while index < len(self.functions) and not self.tampered:
            worker = Worker(self.n, self.which, index)
            try:
                for result in self.follow(worker, index):
                    yield result
                    index += 1
            finally:
                ended = worker.stop()
                put, changed = compare(before)
                self.tampered = '; '.join(
                    [f"{', '.join(put)} changed during the run, put back as it was"] * bool(put) +
                    [f"{', '.join(changed)} changed during the run (not put back: an edit of yours? If not, "
                     f"restore it, with git for one)"] * bool(changed))
            if index < len(self.functions) and self.ended_at is not None:
                # the worker ended before this check reported: it fails, a new worker runs the rest,
                # unless it ran out of time: a loop there would most likely loop in the rest too
                name, fn = self.functions[index]
                yield harness.failed(name, fn, self.ended_at.replace('{ended}', ended), self.seconds)
                index += 1
                if self.timed_out:
                    for name, fn in self.functions[index:]:
                        yield harness.failed(name, fn, f"not run: the check before it was stopped after "
                                                       f"{self.limit:.0f} s")
                    index = len(self.functions)
            elif index < len(self.functions) and self.unloaded is not None:   # every check fails so
                for name, fn in self.functions[index:]:
                    yield harness.failed(name, fn, self.unloaded.replace('{ended}', ended))
                index = len(self.functions)
        for name, fn in self.functions[index:]:            # the grader's files changed: the run stopped
            yield harness.failed(name, fn, "not run: the grader's files changed during the run")

    def follow(self, worker, first):
        """The Results worker reports, from check `first` on; on its end sets ended_at (it stopped
        inside a check: why, '{ended}' for how) or unloaded (it never loaded student.py)."""
        self.ended_at, self.unloaded, self.seconds, self.timed_out = None, None, 0.0, False
        start, loaded, current, shown, self.partial = time.monotonic(), False, None, 0, ''
        while True:
            left = start + self.limit - time.monotonic()
            if left <= 0:
                if not loaded:
                    self.unloaded = (f"student.py did not finish loading in {self.limit:.0f} s (an endless loop at "
                                     f"import?); its worker was stopped")
                else:
                    self.ended_at = f"no answer in {self.limit:.0f} s (an endless loop?): the check was stopped"
                    self.seconds, self.timed_out = self.limit, True
                return
            events, text, ended = worker.read(left)
            if ended:
                text += worker.rest_of_output()
            shown = self.show(text, shown, whole=ended or any(e.get('event') == 'result' for e in events))
            for event in events:
                kind = event.get('event')
                if kind == 'loaded' and not loaded:
                    if event.get('reason'):
                        self.unloaded = str(event['reason'])
                        return
                    loaded = True
                elif kind == 'start' and loaded and event.get('index') == (first if current is None else current + 1):
                    current, start, shown = event['index'], time.monotonic(), 0
                elif kind == 'result' and current is not None and event.get('index') == current:
                    name, fn = self.functions[current]
                    yield harness.Result(name, harness.docstring_parts(fn)[0], event.get('passed') is True,
                                         str(event.get('reason', '')), str(event.get('hint', '')),
                                         float(event.get('seconds', 0.0)), event.get('not_written') is True)
                elif kind == 'done':
                    return
            if ended:
                if not loaded:
                    self.unloaded = "the checks' worker ended ({ended}) while loading student.py: os._exit, or a crash?"
                else:
                    self.ended_at = ("the checks' worker ended ({ended}) inside this check, before it reported: "
                                     "os._exit, or a crash? A new worker runs the checks after it")
                    self.seconds = time.monotonic() - start
                return

    def show(self, text, shown, whole=False):
        """Write the code under test's output, OUTPUT_LINES lines a check at most, a line once it is
        whole (or the check is over: whole); -> lines shown."""
        *lines, self.partial = (self.partial + text).split('\n')
        if whole and self.partial:
            lines.append(self.partial)
            self.partial = ''
        for line in lines:
            if shown < OUTPUT_LINES:
                self.out.write(f"        | {line}\n")
            elif shown == OUTPUT_LINES:
                self.out.write("        | ... (more output, not shown)\n")
            shown += 1
        return shown


def main(argv):
    """`python -m exercises.worker N WHICH FIRST FD THREADS`, the key on stdin: a spawned worker."""
    n, which, first, fd, threads = int(argv[0]), argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    key = sys.stdin.readline().strip()
    torch.set_num_threads(threads)
    serve(n, which, first, sender(fd, key))


if __name__ == '__main__':
    main(sys.argv[1:])
