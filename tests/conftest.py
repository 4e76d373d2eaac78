"""Shared helpers for the tests: the repo root on sys.path, tiny seeded models, a tiny corpus,
the greedy reference and randomised BPD heads, and the helpers that run the scripts' command lines
(a real process, or the script's main in this process), and the hooks that run the tests marked
`second_process` in a second pytest process, on the other core."""
import importlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cli import run_script  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

# one intra-op thread: on a busy 2-core machine a thread pool mostly waits on itself
torch.set_num_threads(1)


# ----------------------------------------------------------------------------- models and data


def tiny_model(seed=0, vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32, bias=True,
               std=None, dtype=torch.float64):
    """A small seeded GPT. With `std`, every parameter (LayerNorm weights and biases included) is
    redrawn as N(0, std) (LayerNorm weights around 1), so the logits are far from uniform and every
    bias path matters; the default init gives near-uniform, repetitive models."""
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd, bias=bias)
    model = GPT(cfg)
    if std is not None:
        g = torch.Generator().manual_seed(seed + 1000)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g) * std
                if name.endswith(('ln_1.weight', 'ln_2.weight', 'ln_f.weight')):
                    p.copy_(1.0 + noise)
                else:
                    p.copy_(noise)
    return model.to(dtype).eval()


# An enumerable world: a vocabulary of 8, so every continuation of a few tokens can be listed.
V8 = GPTConfig(block_size=32, vocab_size=8, n_layer=2, n_head=2, n_embd=16)
V8_PROMPT = torch.tensor([[1, 5, 2, 7]])


def peaky(module, std, seed):
    """Random weights large enough that p and q are far from uniform (and far from each other)."""
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module.double().eval()


@pytest.fixture(scope='module')
def v8_target():
    """A peaky target of the enumerable world (float64)."""
    return peaky(GPT(V8), 0.3, 0)


def corpus_text(n_bytes=6000):
    """A few KB of Python-like text."""
    lines = []
    i = 0
    while sum(len(x) + 1 for x in lines) < n_bytes:
        lines.append(f"def f{i}(x, y={i % 7}):")
        lines.append(f"    return x * {i} + y  # step {i % 13}")
        lines.append("")
        i += 1
    return "\n".join(lines) + "\n"


@pytest.fixture
def corpus_file(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(corpus_text())
    return p


# ----------------------------------------------------------------------------- references

def naive_greedy(model, prompt, m):
    """The reference of references: GPT.generate at temperature 0, nanoGPT's loop (full causal
    recompute of every prefix, argmax, append; tests/test_model.py pins it)."""
    return model.generate(prompt, m, temperature=0.0)


def randomise(heads, seed, std=1.0):
    """Heads whose drafts depend on h but are mostly wrong: random c_fc and c_proj, large std."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (heads.c_fc.weight, heads.c_fc.bias, heads.c_proj.weight, heads.c_proj.bias):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return heads


# ----------------------------------------------------------------------------- command lines
# A real process per case costs a Python start and a torch import (a refused `python train.py`: 1.9 s
# on the README's 2-core AMD EPYC), so most command-line cases run a script's main(argv) in this
# process (`in_process`, `run_main`), wrapped in the same run_script that turns BadInput into
# `error: ...` and exit code 2. A few cases also run as real processes (`run_py`), to pin the exit
# code and stderr end to end.

def env():
    e = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', PYTHONFAULTHANDLER='1')
    e.pop('RANK', None)
    e.pop('WORLD_SIZE', None)
    return e


def run_py(args, timeout=120):
    return subprocess.run([sys.executable] + args, cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def sigint_at_default(argv):
    """`python argv`, started with SIGINT at its default. A shell starts a background job with SIGINT
    ignored, and its children inherit that; Python then installs no KeyboardInterrupt handler, and a
    Ctrl-C a test sends would do nothing. Resetting it here makes the test about the script, not
    about how the suite was started."""
    reset = ('import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); '
             'os.execv(sys.executable, [sys.executable] + sys.argv[1:])')
    return [sys.executable, '-c', reset, *argv]


def in_process(main, cwd=ROOT):
    """Run main() in this process, in the folder cwd, the way a script's `__main__` block runs it
    (cli.run_script) -> (exit code, stdout, stderr). CUDA is hidden, so that '--device cuda' is
    refused on any machine. Without --threads a script reads the machine's load (cli.busy_cores,
    0.2 s asleep at each call, and a training stage cli.CoreWatch as it trains); here it reads what
    the suite knows instead: every core but this test's is busy (the second pytest process keeps
    one), so the script trains on one thread, as the tests do (tests/test_data.py checks the real
    reading). The RNGs, torch's threads, the working directory and torchrun's variables are
    restored afterwards. An exception that run_script lets through would be a traceback in a real
    run: it comes back as one, with exit code 1."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    home, py_state, threads = os.getcwd(), random.getstate(), torch.get_num_threads()
    ddp = {n: os.environ.pop(n) for n in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK') if n in os.environ}
    try:
        with redirect_stdout(out), redirect_stderr(err), torch.random.fork_rng(devices=[]), \
                mock.patch('torch.cuda.is_available', return_value=False), \
                mock.patch('torch.cuda.device_count', return_value=0), \
                mock.patch('cli.busy_cores', lambda cores, window=0.2: cores - 1), \
                mock.patch('cli.CoreWatch.busy', lambda self: self.cores - 1):
            os.chdir(cwd)
            try:
                run_script(main)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception as e:
                err.write(f"Traceback (in-process): {type(e).__name__}: {e}\n")
                code = 1
    finally:
        os.chdir(home)
        random.setstate(py_state)
        torch.set_num_threads(threads)
        os.environ.update(ddp)
    return code, out.getvalue(), err.getvalue()


def run_main(script, args, cwd=ROOT):
    """`python script args`, run from cwd, in this process -> (exit code, stdout, stderr)."""
    module = importlib.import_module(script.removesuffix('.py'))
    return in_process(lambda: module.main([str(a) for a in args]), cwd)


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert 'Traceback' not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    assert lines, "no message on stderr"
    last = lines[-1]
    assert last.startswith('error:'), proc.stderr
    for n in needles:
        assert n in last, last
    return last


class Proc:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


# ----------------------------------------------------------------------------- the second core
# Every test runs on one intra-op thread, so one pytest process leaves the second core of a 2-core
# machine idle. The tests marked `second_process` (those that build a handout, compile, train at
# the GPU preset's shapes or run the exercises' checks on the references and the negative controls,
# and a few more that balance the two processes) run in a second pytest process, started with this
# one and given the same tests, -k and -m: it runs the marked ones while this process runs the
# others, then this process reports
# each marked test as the second one reported it (pytest's own report serialisation: the same
# outcome, traceback and captured output). Each test still runs alone as usual.
# BLOCKWISE_ONE_PROCESS=1 runs everything in this process (for --pdb); so does a one-core machine.

SECOND = 'BLOCKWISE_SECOND_PROCESS'   # set in the second process: the file its reports go to
_second = {}


def pytest_configure(config):
    _second['config'] = config
    if (os.environ.get(SECOND) or os.environ.get('BLOCKWISE_ONE_PROCESS') or (os.cpu_count() or 1) < 2
            or config.option.collectonly or getattr(config.option, 'usepdb', False)):
        return
    folder = tempfile.mkdtemp(prefix='blockwise-second-')
    selection = [f for flag, value in (('-k', config.option.keyword), ('-m', config.option.markexpr)) if value
                 for f in (flag, value)]
    reports, log = os.path.join(folder, 'reports.jsonl'), open(os.path.join(folder, 'output.txt'), 'w')
    proc = subprocess.Popen([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '--basetemp',
                             os.path.join(folder, 'tmp'), *selection, *config.args],
                            cwd=str(config.invocation_params.dir), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=dict(os.environ, **{SECOND: reports}))
    _second.update(proc=proc, folder=folder, reports=reports, log=log, ids=set(), done={}, read=0)


def pytest_ignore_collect(collection_path, config):
    """The second process does not import the test files that hold no marked test."""
    if os.environ.get(SECOND) and collection_path.suffix == '.py' and collection_path.name.startswith('test_'):
        return 'second_process' not in collection_path.read_text()
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    marked = [i for i in items if i.get_closest_marker('second_process')]
    if os.environ.get(SECOND):       # the second process: only the marked tests
        config.hook.pytest_deselected(items=[i for i in items if i not in marked])
        items[:] = marked
    elif 'proc' in _second:          # this process: its own tests first, then the reports of the marked
        _second['ids'] = {i.nodeid for i in marked}
        items[:] = [i for i in items if i not in marked] + marked


def pytest_runtest_logreport(report):
    if os.environ.get(SECOND):
        config = _second['config']
        data = config.hook.pytest_report_to_serializable(config=config, report=report)
        with open(os.environ[SECOND], 'a') as f:
            f.write(json.dumps(data) + '\n')


def _reports_of(nodeid):
    """The second process's reports of one test, once its teardown is reported (or a failure
    saying the process ended without it)."""
    config, proc, done = _second['config'], _second['proc'], _second['done']
    finished = lambda: bool(done.get(nodeid)) and done[nodeid][-1].when == 'teardown'   # noqa: E731
    while not finished():
        ended = proc.poll() is not None
        lines = ''
        if os.path.exists(_second['reports']):
            with open(_second['reports']) as f:
                f.seek(_second['read'])
                lines = f.read()
        whole = lines[:lines.rfind('\n') + 1]        # a line still being written waits for the next look
        _second['read'] += len(whole)
        for line in whole.splitlines():
            report = config.hook.pytest_report_from_serializable(config=config, data=json.loads(line))
            if isinstance(report.longrepr, list):   # a skip's (file, line, reason): JSON made it a list
                report.longrepr = tuple(report.longrepr)
            done.setdefault(report.nodeid, []).append(report)
        if ended and not whole and not finished():
            with open(os.path.join(_second['folder'], 'output.txt')) as f:
                tail = f.read()[-3000:]
            return [pytest.TestReport(nodeid, ('', 0, nodeid), {}, 'failed', when='call', longrepr=(
                f"the second pytest process ended (exit code {proc.returncode}) before it reported this "
                f"test; its output ends:\n{tail}"))]
        if not whole:
            time.sleep(0.05)
    return done.pop(nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.nodeid not in _second.get('ids', ()):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for report in _reports_of(item.nodeid):
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def pytest_unconfigure(config):
    if 'proc' in _second:
        if _second['proc'].poll() is None:   # stopped early (-x, Ctrl-C, nothing marked): not wanted
            _second['proc'].kill()
            _second['proc'].wait()
        _second['log'].close()
        shutil.rmtree(_second['folder'], ignore_errors=True)
