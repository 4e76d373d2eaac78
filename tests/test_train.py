"""Training: the loss goes down, the distillation data is the target's greedy output,
checkpoints survive resume and interrupted writes, DDP keeps replicas identical, and bad inputs
end in one clean `error:` line."""
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch

from conftest import (ROOT, Proc, assert_clean_error, corpus_text, env, naive_greedy, run_main, run_py,
                      sigint_at_default, tiny_model)
import cli
import generate as generate_py
import train
import trainer
from cli import BadInput
from data import PROMPT_LEN, load_checkpoint, load_target, save_checkpoint, windows
from decode import generate
from dblast import DBlastDrafter
from heads import BlockHeads
from model import GPT, GPTConfig

TINY = ['--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '32',
        '--batch-size', '4', '--stages', 'base', '--no-demo', '--device', 'cpu',
        '--eval-iters', '1', '--eval-interval', '1000', '--warmup-iters', '100']


# --------------------------------------------------------------------------- the loss goes down

def test_training_steps_lower_the_loss(tmp_path):
    args = train.parse_args(['--device', 'cpu', '--n-layer', '2', '--n-head', '2', '--n-embd', '32',
                             '--block-size', '32', '--batch-size', '8', '--lr', '3e-3',
                             '--warmup-iters', '1', '--ckpt-interval', '1000',
                             '--out-dir', str(tmp_path)])
    rt = trainer.Runtime('cpu', 0)
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32))
    data = torch.tensor(list(corpus_text(3000).encode()), dtype=torch.uint8).numpy()
    w = windows(data, 8, 33, torch.Generator().manual_seed(0))
    x, y = w[:, :-1], w[:, 1:]
    with torch.no_grad():
        before = model(x, y)[1].item()
    saved = []
    last = trainer.train_loop(rt, args, 'test', train.LMObjective(model), lambda: (x, y), 30,
                            args.lr, lambda opt, it, rng: saved.append(it))
    with torch.no_grad():
        after = model(x, y)[1].item()
    assert abs(before - torch.log(torch.tensor(256.0)).item()) < 0.2   # starts near uniform
    assert after < 0.6 * before, (before, after)
    assert last < 0.7 * before
    assert saved == [30]          # the closing checkpoint, at the final iteration


class Poisoned(torch.nn.Module):
    """The LM loss, made non-finite at step `at`: the loss itself ('loss'), or a weight while the
    loss stays finite ('weight')."""

    def __init__(self, model, at, what):
        super().__init__()
        self.model, self.at, self.what, self.step = model, at, what, 0

    def forward(self, x, y):
        self.step += 1
        loss = self.model(x, y)[1]
        if self.step >= self.at and self.what == 'loss':
            return loss * float('nan')
        if self.step == self.at and self.what == 'weight':
            with torch.no_grad():
                self.model.transformer.wpe.weight[0, 0] = float('inf')
        return loss


@pytest.mark.parametrize('what', ['loss', 'weight'])
def test_a_non_finite_stage_stops_before_saving(tmp_path, what):
    """Never replace a good checkpoint with a bad one: a NaN loss or a non-finite weight stops the
    stage with a one-line error, and no save happens from that point on."""
    args = train.parse_args(['--device', 'cpu', '--n-layer', '1', '--n-head', '2', '--n-embd', '16',
                             '--block-size', '32', '--batch-size', '4', '--warmup-iters', '1',
                             '--ckpt-interval', '2', '--out-dir', str(tmp_path)])
    rt = trainer.Runtime('cpu', 0)
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=16))
    data = torch.tensor(list(corpus_text(3000).encode()), dtype=torch.uint8).numpy()
    w = windows(data, 4, 33, torch.Generator().manual_seed(0))
    saved = []
    with pytest.raises(BadInput, match='non-finite|nan'):
        trainer.train_loop(rt, args, 'test', Poisoned(model, 5, what), lambda: (w[:, :-1], w[:, 1:]), 30,
                         args.lr, lambda opt, it, rng: saved.append(it))
    assert saved == [2, 4]       # the saves before step 5, none after


# --------------------------------------------------------------------------- distillation data

def test_distillation_data_is_target_greedy():
    # greedy continuation equality holds for any model: a seeded tiny target (std: far from
    # uniform, so the continuations are not one repeated token) on a periodic token stream
    # (period 23 over a 32-token vocabulary)
    model = tiny_model(seed=0, vocab_size=32, block_size=96, std=0.3, dtype=torch.float64)
    rng = np.random.default_rng(0)
    data = np.tile(rng.integers(0, 32, size=23), 200).astype(np.uint8)
    rt = trainer.Runtime('cpu')
    n, gen_len, seed = 70, 16, 3            # n > 64: two of self_generated's CPU batches
    rows = train.self_generated(rt, model, data, n, gen_len, 0.0, seed, 'test')
    P = PROMPT_LEN
    assert rows.shape == (n, P + gen_len)
    # the prompts are corpus windows drawn with the seed
    want = windows(data, n, P, torch.Generator().manual_seed(seed))
    assert torch.equal(rows[:, :P], want)
    # the continuation is the target's greedy output
    out, _ = generate(model, rows[:, :P], gen_len)
    assert torch.equal(rows, out)
    assert torch.equal(rows[:5], naive_greedy(model, rows[:5, :P], gen_len))


def test_distillation_data_is_made_once_for_the_same_prompts_and_again_for_others(tmp_path, monkeypatch, capsys):
    """self_generated's cache: the same target, prompts and settings read it back without decoding;
    a text of the same length that draws other prompts decodes anew; a damaged file is made again,
    with a note."""
    model = tiny_model(seed=0, vocab_size=32, block_size=64, std=0.3, dtype=torch.float64)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 32, size=3000).astype(np.uint8)
    other = data.copy()
    other[1500:] = (other[1500:] + 1) % 32
    rt = trainer.Runtime('cpu')
    decodes = []
    real = train.generate
    monkeypatch.setattr(train, 'generate', lambda *a, **kw: decodes.append(1) or real(*a, **kw))
    make = lambda text: train.self_generated(rt, model, text, 8, 6, 0.0, 3, 'test', str(tmp_path))  # noqa: E731
    first = make(data)
    assert len(decodes) == 1 and len(list(tmp_path.glob('samples-*.pt'))) == 1
    assert torch.equal(make(data), first) and len(decodes) == 1             # read back
    assert not torch.equal(make(other), first) and len(decodes) == 2        # other prompts: made anew
    for f in tmp_path.glob('samples-*.pt'):
        f.write_bytes(b'not a tensor')
    assert torch.equal(make(data), first) and len(decodes) == 3
    assert 'making them again' in capsys.readouterr().out


def tiny_target_in(folder, corpus_file):
    """train.py's base stage at tiny sizes (2 steps, a context of 48) into `folder`: the target the
    drafter stages' tests train for. Returns the flags that name its data and folder (one thread)."""
    out = ['--data', str(corpus_file), '--out-dir', str(folder), '--threads', '1']
    train.main(TINY + out + ['--max-iters', '2', '--block-size', '48'])
    return out


def heads_world():
    """A float64 target (32 tokens of context), live k = 4 heads, and 3 sequences of 32 tokens whose
    first 5 carry no label."""
    model = tiny_model(seed=0, vocab_size=64, block_size=32, std=0.3)          # float64
    heads = BlockHeads(model.config, 4).double()
    torch.nn.init.normal_(heads.c_proj.weight, std=0.2)
    tokens = torch.randint(64, (3, 32), generator=torch.Generator().manual_seed(0))
    labels = tokens.clone()
    labels[:, :5] = -1
    return model, heads, tokens, labels


def test_the_joint_objective_adds_the_targets_next_token_loss():
    """MATH.md §3 "Frozen vs joint": joint, the objective is the heads' loss plus the target's own
    next-token cross-entropy on the same labels (-1: none); frozen, the heads' loss alone, and no
    gradient reaches the target. With the random offset the same term is added to head I's loss."""
    model, heads, tokens, labels = heads_world()
    T = 32 - 4
    for offset in (None, torch.tensor(1)):
        with torch.no_grad():
            of_heads = heads.loss(model.hidden(tokens[:, :T]), model.lm_head, labels, offset)
            _, of_target = model(tokens[:, :T], labels[:, 1:T + 1])            # ignores -1
        joint = train.HeadsObjective(model, heads, joint=True)(tokens, labels, offset)
        assert torch.allclose(joint, of_heads + of_target, rtol=1e-6)   # its target term is float32's
        frozen = train.HeadsObjective(model, heads, joint=False)(tokens, labels, offset)
        assert torch.allclose(frozen, of_heads, rtol=1e-12)
        frozen.backward()
        assert all(p.grad is None for p in model.parameters()) and heads.c_fc.weight.grad is not None
    # joint, the heads' loss reaches the target too: its gradient is not its own term's alone
    weight = model.transformer.h[0].attn.c_attn.weight
    train.HeadsObjective(model, heads, joint=True)(tokens, labels).backward()
    both, weight.grad = weight.grad, None
    model(tokens[:, :T], labels[:, 1:T + 1])[1].backward()
    assert not torch.allclose(both, weight.grad)


def test_frozen_heads_train_on_hidden_states_made_once(tmp_path, corpus_file, monkeypatch):
    """With a frozen target, the heads stage makes the target's hidden states over the distilled
    sequences once (train.frozen_hidden), not at every step, and the heads' loss on them is the
    loss the objective computes from the tokens; trained jointly, the target runs at every step."""
    model, heads, tokens, labels = heads_world()
    objective = train.HeadsObjective(model, heads, joint=False)
    h = train.frozen_hidden(model, tokens[:, :32 - 4], nullcontext(), rows=2)    # in two chunks
    for offset in (None, torch.tensor(1)):
        assert torch.allclose(objective(None, labels, offset, h), objective(tokens, labels, offset), rtol=1e-12)

    out = tiny_target_in(tmp_path, corpus_file)
    real, calls = GPT.hidden, []
    monkeypatch.setattr(GPT, 'hidden', lambda self, idx: calls.append(len(idx)) or real(self, idx))
    real_loss, labelled = BlockHeads.loss, []
    monkeypatch.setattr(BlockHeads, 'loss', lambda self, h, lm_head, idx, offset=None:
                        labelled.append(idx) or real_loss(self, h, lm_head, idx, offset))
    for mode, want in (('--frozen', [4]), ('--joint', [2] * 5)):   # 4 sequences; 5 steps of 2 rows
        calls.clear()
        train.main(['--stages', 'heads', '--device', 'cpu', '--no-demo', '--k', '4', '--heads-iters', '5',
                    '--distill-samples', '4', '--batch-size', '2', mode, '--tag', mode[2:]] + out)
        assert calls == want, (mode, calls)
    # MATH.md §3: of a distilled sequence the corpus prompt's PROMPT_LEN tokens are masked (-1), and
    # the target's own continuation is learnt
    assert len(labelled) == 10 and all((y[:, :PROMPT_LEN] == -1).all() and (y[:, PROMPT_LEN:] >= 0).all()
                                       for y in labelled)


def test_the_drafter_stages_train_and_judge_as_they_say(tmp_path, corpus_file, monkeypatch):
    """What the heads and dblast stages hand their losses, from a run trained in bf16: the random
    offset draws every head (0 .. k-2) and no other; the frozen heads' hidden states are made at
    decoding's float32; DBlast's loss gets --temperature, --tau-threshold and --nll-weight, and the
    held-out evaluation scores sampled branches under mixture verification at --temperature."""
    out = tiny_target_in(tmp_path, corpus_file)
    seen = dict(offsets=set(), precision=[], loss=[], evaluated=[])
    real_loss, real_hidden, real_dblast_loss = BlockHeads.loss, train.frozen_hidden, DBlastDrafter.loss
    monkeypatch.setattr(BlockHeads, 'loss', lambda self, h, lm_head, idx, offset=None: seen['offsets'].add(
        None if offset is None else int(offset)) or real_loss(self, h, lm_head, idx, offset))
    monkeypatch.setattr(train, 'frozen_hidden', lambda model, seqs, precision, **kw: seen['precision'].append(
        str(precision)) or real_hidden(model, seqs, precision, **kw))
    monkeypatch.setattr(DBlastDrafter, 'loss', lambda self, *a: seen['loss'].append(a[5:]) or real_dblast_loss(self, *a))
    monkeypatch.setattr(train, 'expected_tau', lambda *a: seen['evaluated'].append(a[4:]) or 2.0)
    train.main(['--stages', 'heads,dblast', '--device', 'cpu', '--no-demo', '--dtype', 'bfloat16', '--k', '4',
                '--heads-iters', '40', '--distill-samples', '4', '--batch-size', '2', '--dblast-iters', '2',
                '--dblast-samples', '4', '--dblast-eval-samples', '2', '--eval-interval', '1', '--temperature', '1.3',
                '--tau-threshold', '0.05', '--nll-weight', '0.25', '--baseline-loss', 'none'] + out)
    assert seen['offsets'] == {0, 1, 2}
    assert seen['precision'] == ['float32']
    assert seen['loss'] and all(a == (1.3, 'al', 0.05, 0.25) for a in seen['loss']), seen['loss'][:1]
    assert seen['evaluated'] and all(a == (1.3, True, 'mixture') for a in seen['evaluated']), seen['evaluated']


def test_after_joint_heads_the_later_stages_train_for_the_fine_tuned_target(tmp_path, corpus_file):
    """--joint fine-tunes the target in the heads stage and saves it as ckpt_joint.pt; the stages
    after it in the same run (here dblast) train for that target, not for ckpt.pt."""
    out = tiny_target_in(tmp_path, corpus_file)
    train.main(['--stages', 'heads,dblast', '--device', 'cpu', '--no-demo', '--k', '4', '--heads-iters', '2',
                '--distill-samples', '4', '--batch-size', '2', '--joint', '--dblast-iters', '2', '--dblast-samples',
                '4', '--dblast-eval-samples', '2', '--branches', '2'] + out)
    joint = load_target(str(tmp_path / 'ckpt_joint.pt')).fingerprint()
    assert joint != load_target(str(tmp_path / 'ckpt.pt')).fingerprint()
    for name in ('heads.pt', 'dblast_K2.pt', 'dblast_K1.pt'):
        assert load_checkpoint(str(tmp_path / name))['base_fingerprint'] == joint, name


# --------------------------------------------------------------------------- checkpoints

@contextmanager
def ctrl_c_as_step_5_starts(monkeypatch):
    """Inside, a stage's training is interrupted (KeyboardInterrupt) as its step 5 starts: with
    --ckpt-interval 2 its last save is step 4's."""
    real_lr_at = trainer.lr_at

    def lr_at(it, *args):
        if it == 4:
            raise KeyboardInterrupt
        return real_lr_at(it, *args)
    monkeypatch.setattr(trainer, 'lr_at', lr_at)
    try:
        yield
    finally:
        monkeypatch.setattr(trainer, 'lr_at', real_lr_at)


@pytest.mark.parametrize('dropout', ['0.0', '0.1'])   # dropout draws from torch's global RNG: restored too
def test_resume_round_trip_matches_uninterrupted_run(tmp_path, corpus_file, monkeypatch, capsys, dropout):
    a, b = tmp_path / 'interrupted', tmp_path / 'straight'
    # one thread in every run: by default each run picks its threads by the machine's load at its
    # start, and sums split over other threads round differently
    common = TINY + ['--data', str(corpus_file), '--ckpt-interval', '2', '--seed', '7', '--threads', '1',
                     '--dropout', dropout]
    with ctrl_c_as_step_5_starts(monkeypatch), pytest.raises(KeyboardInterrupt):
        train.main(common + ['--out-dir', str(a), '--max-iters', '6'])
    ck4 = load_checkpoint(str(a / 'ckpt.pt'))
    assert ck4['iter_num'] == 4
    capsys.readouterr()
    train.main(common + ['--out-dir', str(a), '--max-iters', '6', '--resume'])
    assert 'resumed at step' not in capsys.readouterr().out   # the same flags: no note
    train.main(common + ['--out-dir', str(b), '--max-iters', '6'])

    ra, rb = load_checkpoint(str(a / 'ckpt.pt')), load_checkpoint(str(b / 'ckpt.pt'))
    assert ra['iter_num'] == 6 and rb['iter_num'] == 6
    ma, mb = load_target(str(a / 'ckpt.pt')), load_target(str(b / 'ckpt.pt'))
    assert ma.config == GPTConfig(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=16, dropout=float(dropout))
    # resuming really continued training from step 4 (weights moved)...
    assert not all(torch.equal(ck4['model'][k], ra['model'][k]) for k in ra['model'])
    # ...and gives exactly the weights of the uninterrupted run
    diff = {k: (ra['model'][k] - rb['model'][k]).abs().max().item() for k in ra['model']}
    assert all(v == 0 for v in diff.values()), diff
    assert ma.fingerprint() == mb.fingerprint()
    # optimizer moments too, so a later resume keeps matching
    sa, sb = ra['optimizer']['state'], rb['optimizer']['state']
    assert sa.keys() == sb.keys()
    for i in sa:
        assert torch.equal(sa[i]['exp_avg'], sb[i]['exp_avg'])
        assert torch.equal(sa[i]['exp_avg_sq'], sb[i]['exp_avg_sq'])

    # --resume on a finished stage skips it and leaves the checkpoint alone
    before = (a / 'ckpt.pt').read_bytes()
    train.main(common + ['--out-dir', str(a), '--max-iters', '6', '--resume'])
    assert (a / 'ckpt.pt').read_bytes() == before


@pytest.mark.parametrize('stage', ['heads', 'dblast'])
def test_a_drafter_stage_resumed_matches_an_uninterrupted_one(tmp_path, corpus_file, monkeypatch, stage):
    """Interrupted after its step-4 save and resumed, a drafter stage ends with the weights and
    optimizer moments of a run that was never interrupted: the heads trained jointly (the
    fine-tuned target resumed too), and DBlast's K = 2 drafter (its evaluation history too)."""
    a, b = tmp_path / 'interrupted', tmp_path / 'straight'
    tiny_target_in(a, corpus_file)
    shutil.copytree(a, b)
    flags = ['--stages', stage, '--device', 'cpu', '--no-demo', '--data', str(corpus_file), '--threads', '1',
             '--seed', '7', '--batch-size', '2', '--ckpt-interval', '2']
    flags += (['--k', '4', '--heads-iters', '6', '--distill-samples', '4', '--joint'] if stage == 'heads' else
              ['--dblast-iters', '6', '--dblast-samples', '4', '--dblast-eval-samples', '2', '--branches', '2',
               '--baseline-loss', 'none'])
    with ctrl_c_as_step_5_starts(monkeypatch), pytest.raises(KeyboardInterrupt):
        train.main(flags + ['--out-dir', str(a)])
    name = 'heads.pt' if stage == 'heads' else 'dblast_K2.pt'
    assert load_checkpoint(str(a / name))['iter_num'] == 4
    train.main(flags + ['--out-dir', str(a), '--resume'])
    train.main(flags + ['--out-dir', str(b)])
    ra, rb = load_checkpoint(str(a / name)), load_checkpoint(str(b / name))
    assert ra['iter_num'] == rb['iter_num'] == 6
    for part in ('drafter', 'joint_model') if stage == 'heads' else ('drafter',):
        assert ra[part].keys() == rb[part].keys() and all(torch.equal(ra[part][k], rb[part][k]) for k in ra[part])
    sa, sb = ra['optimizer']['state'], rb['optimizer']['state']
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]['exp_avg_sq'], sb[i]['exp_avg_sq']) for i in sa)
    assert ra.get('history') == rb.get('history')


def test_resume_refuses_a_different_model(tmp_path, corpus_file):
    common = TINY + ['--data', str(corpus_file), '--out-dir', str(tmp_path), '--max-iters', '1']
    train.main(common)
    args = list(common)
    args[args.index('--n-embd') + 1] = '32'
    with pytest.raises(BadInput, match='--resume'):
        train.main(args + ['--resume', '--max-iters', '2'])


def test_resume_with_other_flags_says_which(tmp_path, corpus_file, capsys):
    common = TINY + ['--data', str(corpus_file), '--out-dir', str(tmp_path), '--ckpt-interval', '1']
    train.main(common + ['--max-iters', '1', '--lr', '0.002', '--threads', '1'])
    capsys.readouterr()
    train.main(common + ['--max-iters', '2', '--lr', '0.001', '--threads', '2', '--resume'])
    said = capsys.readouterr().out
    # the checkpoint's values of the flags that changed what is learnt; --threads changes nothing
    assert 'base: resumed at step 1 of a run made with --lr 0.002, --max-iters 1;' in said, said


def test_drafters_of_an_unfinished_target_get_a_note():
    note = train.unfinished_target(dict(iter_num=30, config=dict(max_iters=60)), 'out/ckpt.pt')
    assert 'out/ckpt.pt stopped at step 30 of 60' in note and '--stages base --resume' in note
    assert train.unfinished_target(dict(iter_num=60, config=dict(max_iters=60)), 'p') == ''
    assert train.unfinished_target(dict(iter_num=3, config=dict(max_iters='60')), 'p') == ''   # says nothing: none
    assert train.unfinished_target(dict(model={}), 'p') == ''                                  # nanoGPT's may lack both


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / 'ckpt.pt'
    old = tiny_model(seed=1, vocab_size=32, dtype=torch.float32)
    save_checkpoint(dict(model=old.state_dict(), model_args=vars(old.config), iter_num=1), str(path))
    old_bytes = path.read_bytes()

    new = tiny_model(seed=2, vocab_size=32, dtype=torch.float32)
    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        with open(f, 'wb') as fh:         # half a file, then the process "dies"
            fh.write(b'PK\x03\x04 partial checkpoint')
        raise KeyboardInterrupt('killed mid-write')

    monkeypatch.setattr(torch, 'save', dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(dict(model=new.state_dict(), model_args=vars(new.config), iter_num=2),
                        str(path))
    monkeypatch.setattr(torch, 'save', real_save)

    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ['ckpt.pt']          # the half-written temporary file is gone
    ck = load_checkpoint(str(path))
    assert ck['iter_num'] == 1
    back = load_target(str(path))
    assert back.fingerprint() == old.fingerprint() != new.fingerprint()

    # the next successful save replaces it (a stale temp file does not get in the way)
    save_checkpoint(dict(model=new.state_dict(), model_args=vars(new.config), iter_num=2), str(path))
    assert load_checkpoint(str(path))['iter_num'] == 2
    assert load_target(str(path)).fingerprint() == new.fingerprint()


# A model whose checkpoint (weights and AdamW's two moments, 5 MB) takes longer to write than a
# training step takes: saved every step, most of the run is saving
SAVES_EVERY_STEP = ['--n-layer', '2', '--n-head', '2', '--n-embd', '128', '--block-size', '64', '--batch-size', '2',
                    '--stages', 'base', '--no-demo', '--device', 'cpu', '--eval-iters', '1', '--eval-interval',
                    '100000', '--warmup-iters', '10', '--max-iters', '100000', '--ckpt-interval', '1']


# A process that saves a 5 MB checkpoint over and over, and after each Ctrl-C says what it finds.
# It starts saving once the file `go` exists: started beside train.py, it imports while train.py
# does, and does not save for nothing while the test waits on train.py
SAVER = """
import os, sys, time
import torch
sys.path.insert(0, {root!r})
from data import load_checkpoint, save_checkpoint
folder, n, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = dict(model={{f'w{{i}}': torch.randn(256, 256) for i in range(20)}}, iter_num=0)
while not os.path.exists(go):
    time.sleep(0.01)
done = 0
while done < n:
    try:
        state['iter_num'] += 1
        save_checkpoint(state, os.path.join(folder, 'ckpt.pt'))
    except KeyboardInterrupt:
        done += 1
        saved = load_checkpoint(os.path.join(folder, 'ckpt.pt'))['iter_num']
        print(f"interrupt {{done}}: {{sorted(os.listdir(folder))}} saved {{saved}} of {{state['iter_num']}}", flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_at_random_moments_of_saving_leaves_nothing_half_written(tmp_path, corpus_file):
    """Real processes, Ctrl-C at random moments while they save. One saves a 5 MB checkpoint over
    and over and is sent Ctrl-C 8 times, 0.02 to 0.2 s apart (most of its time is inside a save):
    after each, only ckpt.pt is in its folder, and it holds the save begun last or the one before.
    And train.py saving every step, sent Ctrl-C 0 to 0.5 s after its first save: its one line, exit
    code 130, no temporary file, and a ckpt.pt that loads."""
    rng, n = random.Random(), 8
    saves, out = tmp_path / 'saves', tmp_path / 'run'
    saves.mkdir()
    with open(tmp_path / 'saver.out', 'w') as said, open(tmp_path / 'train.err', 'w') as err:   # files, not pipes
        saver = subprocess.Popen(sigint_at_default(['-c', SAVER.format(root=ROOT), str(saves), str(n),
                                                    str(tmp_path / 'go')]), cwd=ROOT,
                                 env=env(), stdout=said, stderr=subprocess.STDOUT)
        trainer = subprocess.Popen(sigint_at_default(['train.py', *SAVES_EVERY_STEP, '--data', str(corpus_file),
                                                      '--out-dir', str(out)]),
                                   cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=err)
    try:
        def wait_for(ready, proc):
            deadline = time.monotonic() + 120
            while not ready() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        wait_for(lambda: (out / 'ckpt.pt').exists(), trainer)
        delay = rng.uniform(0.0, 0.5)
        time.sleep(delay)
        trainer.send_signal(signal.SIGINT)
        (tmp_path / 'go').touch()
        wait_for(lambda: (saves / 'ckpt.pt').exists(), saver)
        for i in range(n):            # the next Ctrl-C once the last one is answered
            time.sleep(rng.uniform(0.02, 0.2))
            saver.send_signal(signal.SIGINT)
            wait_for(lambda: (tmp_path / 'saver.out').read_text().count('interrupt ') > i, saver)
        codes = trainer.wait(timeout=60), saver.wait(timeout=60)
    finally:
        for proc in (trainer, saver):
            if proc.poll() is None:
                proc.kill()
    lines = (tmp_path / 'saver.out').read_text().splitlines()
    assert codes[1] == 0 and len(lines) == n, f"the saver: exit {codes[1]}, {len(lines)} lines for {n} Ctrl-C:\n" + \
        '\n'.join(lines[-20:])
    for line in lines:
        found, saved, begun = re.fullmatch(r"interrupt \d+: (.*) saved (\d+) of (\d+)", line).groups()
        assert found == "['ckpt.pt']" and int(begun) - 1 <= int(saved) <= int(begun), line
    err = (tmp_path / 'train.err').read_text()
    said = f"train.py, Ctrl-C {delay:.2f}s after its first save: exit {codes[0]}\n{err[-1500:]}"
    assert codes[0] == 130 and 'Traceback' not in err and '--resume' in err.strip().splitlines()[-1], said
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'data'], said            # no ckpt.pt.*.tmp
    assert not [f for f in os.listdir(out / 'data') if f.endswith('.tmp')], said
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] >= 1, said


@pytest.mark.slow
def test_a_run_into_a_file_writes_few_progress_updates(tmp_path, corpus_file):
    """stderr not a terminal (a log file): each bar is drawn at its start, at most every
    FILE_BAR_SECONDS, and at its end, not at every update, each draw a line of its own (no '\r'). A
    300-step stage of a few seconds writes four bar lines at most (drawn at every tenth step, as on
    a terminal, it wrote 31 or more), and its last state is its last line."""
    code, _, err = run_main('train.py', [*TINY, '--data', corpus_file, '--out-dir', tmp_path, '--max-iters', '300'])
    assert code == 0, err[-2000:]
    bars = [line for line in err.splitlines() if '/300 [' in line]
    assert '\r' not in err and 2 <= len(bars) <= 4, err
    assert '300/300' in bars[-1], err


def test_every_stage_says_where_it_saved(tmp_path, corpus_file):
    """Each stage ends with one line naming the checkpoint it wrote: the target, the heads and each
    DBlast drafter."""
    small = ['--data', str(corpus_file), '--out-dir', str(tmp_path), '--threads', '1', '--max-iters', '2',
             '--block-size', '48']
    code, out, err = run_main('train.py', [*TINY, *small, '--stages', 'base,heads,dblast', '--heads-iters', '2',
                                           '--dblast-iters', '2', '--distill-samples', '4', '--dblast-samples', '4',
                                           '--dblast-eval-samples', '2', '--k', '4'])
    assert code == 0, err[-2000:]
    for stage, name in (('base', 'ckpt.pt'), ('heads', 'heads.pt'), ('dblast K=4', 'dblast_K4.pt'),
                        ('dblast K=1', 'dblast_K1.pt')):
        assert re.search(rf"^{stage}: done in \d+s -> {re.escape(str(tmp_path / name))}$", out + err, re.M), out + err


def test_a_bar_in_a_file_shows_each_step_it_reached_on_a_line(monkeypatch, capsys):
    """In a log file the bar's step advances line by line while a stage runs (tqdm alone redraws
    with '\r' on one line, which a log shows only at the stage's end), and a message printed
    between two draws leaves no blank line."""
    monkeypatch.setattr(trainer, 'FILE_BAR_SECONDS', 0.05)
    monkeypatch.setattr(sys.stderr, 'isatty', lambda: False)
    for i in trainer.progress(range(12), desc='base', total=12):
        time.sleep(0.02)
        if i == 6:
            trainer.tqdm.write('base step 6: a message')
    err = capsys.readouterr().err
    steps = [int(line.split('|')[2].split('/')[0]) for line in err.splitlines() if '/12 [' in line]
    assert '\r' not in err and all(line.strip() for line in err.splitlines()), err
    assert len(steps) >= 4 and steps == sorted(steps) and steps[0] == 0 and steps[-1] == 12, err


def test_a_bar_inside_a_bar_in_a_file_writes_no_escapes_and_ends_on_its_last_step(monkeypatch, capsys):
    """The held-out samples a DBlast stage makes draw a bar inside the stage's (leave=False, as a
    terminal erases it when done). In a log file: no terminal escape (tqdm moves the cursor up to
    draw the inner bar: '^[[A' lines), and the inner bar's last line is its end, not its 0% start."""
    monkeypatch.setattr(trainer, 'FILE_BAR_SECONDS', 60)
    monkeypatch.setattr(sys.stderr, 'isatty', lambda: False)
    for _ in trainer.progress(range(2), desc='dblast K=4', total=2):
        for _ in trainer.progress(range(5), desc='held-out samples', leave=False):
            pass
    err = capsys.readouterr().err
    inner = [line for line in err.splitlines() if line.startswith('held-out samples')]
    assert '\x1b' not in err and all(line.strip() for line in err.splitlines()), repr(err)
    assert inner and '5/5' in inner[-1] and '2/2' in err.splitlines()[-1], err


# --------------------------------------------------------------------------- DDP

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


# Two ranks under torchrun, started once for the module (three interpreters: the launcher and its
# ranks). Each rank runs train.py's main as `torchrun train.py ...` does (cli.run_script, its
# process group and teardown); in that group, before training, it checks that a loss non-finite on
# one rank stops every rank (an all-reduce that draws nothing: the training is as it would be).
RANKS = """import sys
import torch
sys.path.insert(0, {root!r})
import train
from cli import run_script

def train_all(rt, args):
    loss = torch.tensor(float('nan') if rt.rank == 1 else 1.0)
    sys.stdout.write(f'rank {{rt.rank}} all finite {{rt.all_finite(loss)}}\\n')   # one write: lines stay whole
    trains(rt, args)

trains, train.train_all = train.train_all, train_all
run_script(train.main)
"""


@pytest.fixture(scope='module')
def ddp_run(tmp_path_factory):
    """torchrun, 2 gloo ranks: the non-finite check, then train.py at tiny sizes for 2 steps ->
    (the finished process, {rank: weights fingerprint}, train.py's out folder)."""
    folder = tmp_path_factory.mktemp('ddp')
    (folder / 'corpus.txt').write_text(corpus_text())
    (folder / 'ranks.py').write_text(RANKS.format(root=ROOT))
    out = folder / 'ddp'
    proc = run_py(['-m', 'torch.distributed.run', '--nproc_per_node', '2', '--nnodes', '1',
                   '--master_addr', '127.0.0.1', '--master_port', str(free_port()), str(folder / 'ranks.py'),
                   *TINY, '--max-iters', '2', '--data', str(folder / 'corpus.txt'), '--out-dir', str(out)],
                  timeout=180)
    fps = {}
    for rank, fp in re.findall(r'rank (\d) weights ([0-9a-f]+)', proc.stdout):   # lines of two ranks may meet
        fps[int(rank)] = fp
    return proc, fps, out


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_end_identical(ddp_run):
    proc, fps, out = ddp_run
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(fps) == [0, 1], report
    assert fps[0] == fps[1], report
    assert proc.returncode == 0, report   # both ranks shut down cleanly (train.run's teardown)
    # and it is the weights rank 0 saved
    ck = load_checkpoint(str(out / 'ckpt.pt'))
    assert ck['iter_num'] == 2
    assert load_target(str(out / 'ckpt.pt')).fingerprint() == fps[0]


@pytest.mark.slow
def test_a_loss_non_finite_on_one_rank_stops_every_rank(ddp_run):
    """Finiteness is decided by all ranks together: had rank 1 raised alone, rank 0 would wait in
    its next all-reduce until the timeout."""
    proc = ddp_run[0]
    said = sorted(re.findall(r'rank (\d) all finite (\w+)', proc.stdout))
    assert said == [('0', 'False'), ('1', 'False')], proc.stdout + proc.stderr[-2000:]


def test_core_watch_counts_other_processes_since_its_last_reading(monkeypatch):
    """cli.CoreWatch: the cores busy between two readings of /proc/stat, less this process's own CPU
    time, each reading the start of the next window; None where there is no reading."""
    snaps = iter([(0, 0, 0.0, 0.0), (200, 100, 0.5, 1.0), (400, 100, 2.5, 2.0), None, (600, 300, 3.0, 3.0)])
    monkeypatch.setattr(cli.CoreWatch, 'snap', staticmethod(lambda: next(snaps)))
    watch = cli.CoreWatch(2)
    assert watch.busy() == pytest.approx(0.5)   # half the ticks busy (1 core), half a core of it this process's
    assert watch.busy() == 0.0                  # no tick idle, and both cores this process's
    assert watch.busy() is None and watch.busy() is None    # no reading, then no window to read from
    assert [cli.free_cores(2, b) for b in (0.0, 0.4, 0.7, 1.6, 2.0)] == [2, 2, 1, 1, 1]


def test_a_stage_follows_the_cores_other_processes_take(monkeypatch):
    """Without --threads on a CPU, a stage sets torch's threads to the cores other processes leave,
    measured as it trains: down when another process starts, up again when it ends, with a line
    each time; the same readings change nothing when the threads already fit."""
    readings = iter([1.0, 1.0, 0.1, 0.0])

    class Watch:
        def __init__(self, cores):
            pass

        def busy(self):
            return next(readings)
    monkeypatch.setattr(trainer, 'CoreWatch', Watch)
    monkeypatch.setattr(trainer.os, 'cpu_count', lambda: 2)
    said = []
    rt = types.SimpleNamespace(print=said.append)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        check, seen = trainer.follow_load(rt, every=0), []
        for _ in range(4):
            check()
            seen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 1, 2, 2], seen
    assert said == ["CPU threads: 2 -> 1 (other processes keep 1.0 of 2 cores busy)",
                    "CPU threads: 1 -> 2 (other processes keep 0.1 of 2 cores busy)"], said


def test_gpu_preset_for_any_cuda_device_name(monkeypatch):
    """--device cuda:0 is a CUDA device like --device cuda: the GPU preset and bf16 training."""
    monkeypatch.setattr(trainer, 'pick_device', lambda name=None: name)
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda: True)
    for device in ('cuda', 'cuda:0', 'cuda:1'):
        args = train.parse_args(['--device', device])
        assert (args.preset, args.n_layer, args.block_size, args.dtype) == ('gpu', 6, 512, 'bfloat16')
    assert train.parse_args(['--device', 'cpu']).preset == 'cpu'


def test_target_data_is_made_at_decoding_precision():
    """Distillation continuations and DBlast's samples, hidden states and log-probabilities come
    out the same whatever the training precision: they are made in float32, as decoding runs."""
    model = tiny_model(seed=0, vocab_size=256, block_size=48, std=0.3, dtype=torch.float32)
    text = np.frombuffer(corpus_text(3000).encode(), dtype=np.uint8)
    made = [train.dblast_data(trainer.Runtime('cpu', 0, dtype), model, text, 3, 1.0, 5, 'test')
            for dtype in ('float32', 'bfloat16')]
    for a, b in zip(*made):
        assert a.dtype != torch.bfloat16 and torch.equal(a, b)


# --------------------------------------------------------------------------- bad inputs
# Every case runs train.py's main in this process (conftest.cli), through the run_script a real
# run goes through; tests/test_cli.py pins the exit code and stderr of a real `python train.py`.

@pytest.fixture
def train_cli():
    def run(*args):
        return Proc(*run_main('train.py', [*TINY, *args]))
    return run


def test_train_data_missing_path(tmp_path, train_cli):
    proc = train_cli('--data', tmp_path / 'missing', '--out-dir', tmp_path / 'out')
    assert proc.returncode == 2
    assert_clean_error(proc, '--data', 'missing')
    assert not (tmp_path / 'out').exists()          # refused before the output folder is made


@pytest.mark.parametrize('content', ['empty', 'binary'])
def test_train_data_folder_without_text(tmp_path, train_cli, content):
    folder = tmp_path / 'data'
    folder.mkdir()
    if content == 'binary':
        (folder / 'blob.bin').write_bytes(b'\x00\x01\x02\xff' * 2048)
    proc = train_cli('--data', folder, '--out-dir', tmp_path / 'out')
    assert proc.returncode == 2
    assert_clean_error(proc, 'no text')


def test_plans_the_demos_or_the_draft_stage_cannot_finish_are_refused_before_any_work(tmp_path):
    """A held-out text too short for the closing demos' prompts, and a draft stage whose distilled text
    has no room for its windows (one continuation, or a context that holds no prompt and a token after
    it): one line each, before any training."""
    data = tmp_path / 'data'
    data.mkdir()
    (data / 'a.txt').write_text(corpus_text(3000))
    (data / 'b.txt').write_text('x = 1\n' * 6 + 'y\n')          # 38 bytes: the held-out text (the last file)
    out = ['--data', str(data), '--out-dir', str(tmp_path / 'out'), '--device', 'cpu'] + TINY[:6]
    with pytest.raises(BadInput, match=r"held-out text \(38 tokens\) is too short for the closing demos' 8 prompts"):
        train.main(out + ['--stages', 'base,heads', '--k', '2', '--block-size', '36'])
    with pytest.raises(BadInput, match=r"--distill-samples 1: the draft stage trains on windows"):
        train.main(out + ['--stages', 'base,draft', '--distill-samples', '1', '--no-demo'])
    with pytest.raises(BadInput, match=r"context of 32 tokens is too short for the draft stage on distilled text"):
        train.main(out + ['--stages', 'base,draft', '--block-size', '32', '--no-demo'])
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()


def test_the_closing_demos_decode_as_far_as_the_blocks_they_show_allow(monkeypatch):
    """A context of 39 tokens holds a 32-token prompt, a DBlast block of 4 and 3 new tokens: the demos
    of a run without heads decode those 3, whatever --k says (it was taken as 8: -1 tokens, refused)."""
    lengths = []
    monkeypatch.setattr(generate_py, 'demo', lambda model, prompts, drafter, k, T, label, max_new, log, **kw:
                        lengths.append(max_new))
    target = GPT(GPTConfig(block_size=39, vocab_size=8, n_layer=1, n_head=1, n_embd=8))
    generate_py.closing_demos(target, torch.zeros(1, 32, dtype=torch.long), None, None, 8, [('DBlast K=4', None)],
                              4, 1.5, lambda line: None)
    assert lengths == [3, 3]    # one path, then several


def test_warm_up_is_at_most_a_tenth_of_a_stage(tmp_path, corpus_file, monkeypatch):
    """A short stage ends past its warm-up: with --warmup-iters 100 and 20 steps, the warm-up is 2
    steps, so the stage trains at its learning rate instead of ending inside the ramp."""
    seen = []
    real = trainer.lr_at
    monkeypatch.setattr(trainer, 'lr_at', lambda it, lr, warmup, total: seen.append(warmup) or real(it, lr, warmup, total))
    train.main(TINY + ['--data', str(corpus_file), '--out-dir', str(tmp_path), '--max-iters', '20'])
    assert set(seen) == {2} and len(seen) >= 20


def test_help_gives_every_flags_default():
    """train.py --help, as the README promises: each flag with a default shows it (those without
    help text too, and 0.0), a preset's says so, and a switch shows none."""
    text = ' '.join(trainer.build_parser(train.PRESETS, train.__doc__).format_help().split('options:')[1].split())
    for shown in ('--seed SEED (default: 1337)', '--dropout DROPOUT (default: 0.0)', '--k K block size',
                  '--branches BRANCHES K, the latent branches', '--max-iters MAX_ITERS (default by --preset: cpu 800, quick 400, gpu 3000)',
                  '--lr LR (default by --preset: cpu 0.004, quick 0.003, gpu 0.001)',
                  "--stages STAGES comma list of base, heads, dblast, draft (default: base,heads,dblast)"):
        assert shown in text, shown
    assert '(default: 8)' in text.split('--k K')[1].split('--')[0]
    assert '--compile torch.compile the training step --dtype' in text      # a switch: no default shown
    for flag, _, typ, default, _, _ in trainer.FLAGS:
        if default is not None and default is not False and default != '' and typ != 'frozen|joint':
            entry = re.search(r'--' + flag.replace('_', '-') + r'(, --no-\S+)? (.*?)( --|$)', text)   # to the next flag
            assert '(default' in entry.group(2), flag
