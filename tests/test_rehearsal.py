"""The one-GPU run, rehearsed on the CPU: `python train.py` on CUDA takes the GPU preset, bf16
autocast and (with --compile) a compiled training step, paths the CPU run never takes. Here every
stage runs at the GPU preset's model shapes (6 layers, 6 heads, width 384, context 512), with
batches and steps cut down, under bf16 autocast and --compile, and the checkpoints it writes load
back and decode with the heads and the DBlast drafter, in float32 and in bf16.

On the CPU torch.compile traces with the `aot_eager` backend: dynamo's capture and AOT autograd's
joint forward-backward graph (what breaks when a step does not trace) without inductor's C++ code
generation per graph (24 s cold for the CPU preset's training step on the README's 2-core AMD
EPYC); tests/test_compiled.py runs the real inductor on the decoding step."""
import functools

import pytest
import torch

from conftest import corpus_text, run_main
from data import load_checkpoint, load_target
from drafters import load_drafter

# training at the GPU preset's shapes: slow, and on the other core (conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.second_process]

GPU_SHAPES = dict(n_layer=6, n_head=6, n_embd=384, block_size=512)


def test_every_stage_at_the_gpu_preset_shapes_under_bf16_and_compile(tmp_path, monkeypatch):
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text(corpus_text(40000))
    out = tmp_path / 'out'
    aot_eager = functools.partial(torch.compile, backend='aot_eager')
    monkeypatch.setattr(torch, 'compile', aot_eager)                        # the training step
    torch._dynamo.reset()
    # one step of one sequence per stage: a bf16 matmul on a CPU without bf16 units is slow
    args = ['--preset', 'gpu', '--device', 'cpu', '--dtype', 'bfloat16', '--compile', '--data', corpus,
            '--out-dir', out, '--batch-size', '1', '--max-iters', '1', '--eval-iters', '1', '--heads-iters', '1',
            '--distill-samples', '1', '--dblast-iters', '1', '--dblast-samples', '1',
            '--dblast-eval-samples', '1', '--no-demo']
    code, stdout, stderr = run_main('train.py', args)
    assert code == 0, stdout[-2000:] + stderr[-2000:]
    assert 'preset gpu on cpu, training in bfloat16 autocast, decoding in float32' in stdout

    # the files a GPU run writes, and what they hold
    assert sorted(p.name for p in out.glob('*.pt')) == ['ckpt.pt', 'dblast_K1.pt', 'dblast_K4.pt', 'heads.pt']
    assert list((out / 'data').glob('samples-*.pt'))
    target = load_target(str(out / 'ckpt.pt'))
    assert {k: getattr(target.config, k) for k in GPU_SHAPES} == GPU_SHAPES
    ckpt = load_checkpoint(str(out / 'ckpt.pt'))
    assert ckpt['config']['dtype'] == 'bfloat16' and ckpt['config']['compile'] and ckpt['iter_num'] == 1
    assert all(v.dtype == torch.float32 for v in ckpt['model'].values())   # autocast: float32 weights
    for name in ('heads.pt', 'dblast_K4.pt', 'dblast_K1.pt'):
        drafter = load_drafter(str(out / name), target)
        assert all(torch.isfinite(p).all() for p in drafter.parameters())
    history = load_checkpoint(str(out / 'dblast_K4.pt'))['history']
    assert history and all(1 <= tau <= 4 for _, tau in history)            # evaluated, in float32

    # decoding with both drafters: the heads greedy in float32, DBlast sampling in bf16 (the
    # compiled step at these shapes: tests/test_compiled.py and gpu_check.py)
    common = ['--ckpt', out / 'ckpt.pt', '--max-new-tokens', '12', '--device', 'cpu']
    code, stdout, stderr = run_main('generate.py', common + ['--heads', out / 'heads.pt'])
    assert code == 0 and '(float32)' in stdout and 'same as plain greedy decoding: ' in stdout, stderr[-2000:]
    code, stdout, stderr = run_main('generate.py', common + ['--drafter', out / 'dblast_K4.pt', '--temperature', '1.5',
                                                      '--dtype', 'bfloat16'])
    assert code == 0 and '(bfloat16 autocast)' in stdout and 'mean tau' in stdout, stderr[-2000:]
