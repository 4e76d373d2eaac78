"""Shared helpers for the tests: the repo root on sys.path, tiny seeded models, a tiny corpus,
the greedy reference and randomised BPD heads, and the helpers that run the scripts' command lines
(a real process, or the script's main in this process)."""
import importlib
import io
import os
import random
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from unittest import mock

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from data import run_script  # noqa: E402
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
# A real process per case costs a torch import (~2 s), so most command-line cases run a script's
# main(argv) in this process (`in_process`, `cli`), wrapped in the same run_script that turns
# BadInput into `error: ...` and exit code 2. A few cases also run as real processes (`run_py`), to
# pin the exit code and stderr end to end.

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
    (data.run_script) -> (exit code, stdout, stderr). CUDA is hidden, so that '--device cuda' is
    refused on any machine; the RNGs, the working directory and torchrun's variables are restored
    afterwards. An exception that run_script lets through would be a traceback in a real run: it
    comes back as one, with exit code 1."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    home, py_state = os.getcwd(), random.getstate()
    ddp = {n: os.environ.pop(n) for n in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK') if n in os.environ}
    try:
        with redirect_stdout(out), redirect_stderr(err), torch.random.fork_rng(devices=[]), \
                mock.patch('torch.cuda.is_available', return_value=False), \
                mock.patch('torch.cuda.device_count', return_value=0):
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
        os.environ.update(ddp)
    return code, out.getvalue(), err.getvalue()


def cli(script, args, cwd=ROOT):
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
