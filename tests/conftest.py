"""Shared helpers for the tests: the repo root on sys.path, tiny seeded models, a tiny corpus,
the greedy reference and randomised BPD heads, and the helpers that run the scripts' command lines
(a real process, or the script's `__main__` block in this process)."""
import os
import runpy
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

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
    """The reference of references: full causal recompute of every prefix, argmax, append."""
    x = prompt
    for _ in range(m):
        logits, _ = model(x)
        x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


def randomise(heads, seed, std=1.0):
    """Heads whose drafts depend on h but are mostly wrong: random c_fc and c_proj, large std."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (heads.c_fc.weight, heads.c_fc.bias, heads.c_proj.weight, heads.c_proj.bias):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return heads


# ----------------------------------------------------------------------------- command lines
# A real process per case costs a torch import (~2 s), so most command-line cases run the script's
# own `__main__` block in this process (`cli`: runpy, with sys.argv set): the same argument parsing,
# the same try/except that turns BadInput into `error: ...` and exit code 2. An exception that
# escapes it would be a traceback in a real run; here it is reported as one. A few cases also run
# as real processes (`run_py`), to pin the exit code and stderr end to end.

def env():
    e = dict(os.environ, OMP_NUM_THREADS='1', PYTHONUNBUFFERED='1', PYTHONFAULTHANDLER='1')
    e.pop('RANK', None)
    e.pop('WORLD_SIZE', None)
    return e


def run_py(args, timeout=120):
    return subprocess.run([sys.executable] + args, cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=timeout)


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


def cli(script, args, capsys, monkeypatch):
    """Run `python script args` in-process -> (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, 'argv', [script] + [str(a) for a in args])
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    code = 0
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name='__main__')
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # what a real process would show as a traceback
        out, err = capsys.readouterr()
        return 1, out, err + f"Traceback (in-process): {type(e).__name__}: {e}\n"
    out, err = capsys.readouterr()
    return code, out, err


class Proc:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr
