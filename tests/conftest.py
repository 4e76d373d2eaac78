"""Shared helpers for the tests: the repo root on sys.path, tiny seeded models, a tiny corpus."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from model import GPT, GPTConfig  # noqa: E402

# one intra-op thread: on a busy 2-core machine a thread pool mostly waits on itself
torch.set_num_threads(1)


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
