"""Training: the loss goes down, checkpoints survive resume and interrupted writes, DDP keeps
replicas identical, and bad inputs end in one clean `error:` line."""
import os
import runpy
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ROOT, corpus_text, tiny_model
import train
from model import BadInput, GPT, GPTConfig, load_checkpoint, load_target, save_checkpoint

TINY = ['--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '32',
        '--batch-size', '4', '--stages', 'base', '--no-demo', '--device', 'cpu',
        '--eval-iters', '1', '--eval-interval', '1000', '--warmup-iters', '100']


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


# --------------------------------------------------------------------------- the loss goes down

def test_training_steps_lower_the_loss(tmp_path):
    args = train.parse_args(['--device', 'cpu', '--n-layer', '2', '--n-head', '2', '--n-embd', '32',
                             '--block-size', '32', '--batch-size', '8', '--lr', '3e-3',
                             '--warmup-iters', '1', '--ckpt-interval', '1000',
                             '--out-dir', str(tmp_path)])
    rt = train.Runtime('cpu', 0)
    model = GPT(GPTConfig(block_size=32, vocab_size=256, n_layer=2, n_head=2, n_embd=32))
    data = torch.tensor(list(corpus_text(3000).encode()), dtype=torch.uint8).numpy()
    w = train.windows(data, 8, 33, torch.Generator().manual_seed(0))
    x, y = w[:, :-1], w[:, 1:]
    with torch.no_grad():
        before = model(x, y)[1].item()
    saved = []
    last = train.train_loop(rt, args, 'test', train.LMObjective(model), lambda: (x, y), 30,
                            args.lr, lambda opt, it, rng: saved.append(it))
    with torch.no_grad():
        after = model(x, y)[1].item()
    assert abs(before - torch.log(torch.tensor(256.0)).item()) < 0.2   # starts near uniform
    assert after < 0.6 * before, (before, after)
    assert last < 0.7 * before
    assert saved == [30]          # the closing checkpoint, at the final iteration


# --------------------------------------------------------------------------- checkpoints

def test_resume_round_trip_matches_uninterrupted_run(tmp_path, corpus_file):
    a, b = tmp_path / 'interrupted', tmp_path / 'straight'
    common = TINY + ['--data', str(corpus_file), '--ckpt-interval', '2', '--seed', '7']
    train.main(common + ['--out-dir', str(a), '--max-iters', '4'])
    ck4 = load_checkpoint(str(a / 'ckpt.pt'))
    assert ck4['iter_num'] == 4
    train.main(common + ['--out-dir', str(a), '--max-iters', '6', '--resume'])
    train.main(common + ['--out-dir', str(b), '--max-iters', '6'])

    ra, rb = load_checkpoint(str(a / 'ckpt.pt')), load_checkpoint(str(b / 'ckpt.pt'))
    assert ra['iter_num'] == 6 and rb['iter_num'] == 6
    ma, mb = load_target(str(a / 'ckpt.pt')), load_target(str(b / 'ckpt.pt'))
    assert ma.config == GPTConfig(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=16)
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


def test_resume_refuses_a_different_model(tmp_path, corpus_file):
    common = TINY + ['--data', str(corpus_file), '--out-dir', str(tmp_path), '--max-iters', '1']
    train.main(common)
    args = list(common)
    args[args.index('--n-embd') + 1] = '32'
    with pytest.raises(BadInput, match='--resume'):
        train.main(args + ['--resume', '--max-iters', '2'])


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
    ck = load_checkpoint(str(path))
    assert ck['iter_num'] == 1
    back = load_target(str(path))
    assert back.fingerprint() == old.fingerprint() != new.fingerprint()

    # the next successful save replaces it (a stale temp file does not get in the way)
    save_checkpoint(dict(model=new.state_dict(), model_args=vars(new.config), iter_num=2), str(path))
    assert load_checkpoint(str(path))['iter_num'] == 2
    assert load_target(str(path)).fingerprint() == new.fingerprint()


# --------------------------------------------------------------------------- DDP

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def torchrun_base(corpus_file, out):
    proc = run_py(['-m', 'torch.distributed.run', '--nproc_per_node', '2', '--nnodes', '1',
                   '--master_addr', '127.0.0.1', '--master_port', str(free_port()), 'train.py',
                   *TINY, '--max-iters', '2', '--data', str(corpus_file), '--out-dir', str(out)],
                  timeout=180)
    fps = {}
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == 'rank' and parts[2] == 'weights':
            fps[int(parts[1])] = parts[3]
    return proc, fps


def test_torchrun_two_gloo_ranks_end_identical(tmp_path, corpus_file):
    out = tmp_path / 'ddp'
    proc, fps = torchrun_base(corpus_file, out)
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(fps) == [0, 1], report
    assert fps[0] == fps[1], report
    if proc.returncode != 0 and 'Signal' in proc.stderr:
        # Seen a few times on a heavily loaded machine: a rank aborts at shutdown ("terminate
        # called without an active exception", SIGABRT) after training finished and printed its
        # weights. Not reproducible on demand; one retry, loudly, so the DDP check still runs.
        warnings.warn("torchrun: a rank died by a signal at shutdown; retrying once:\n" + report)
        proc, fps = torchrun_base(corpus_file, tmp_path / 'ddp_retry')
        out = tmp_path / 'ddp_retry'
        report = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert sorted(fps) == [0, 1] and fps[0] == fps[1], report
    assert proc.returncode == 0, report
    # and it is the weights rank 0 saved
    ck = load_checkpoint(str(out / 'ckpt.pt'))
    assert ck['iter_num'] == 2
    assert load_target(str(out / 'ckpt.pt')).fingerprint() == fps[0]


# --------------------------------------------------------------------------- bad inputs
# A real process per case costs a torch import (~2 s), so most cases run the script's own
# `__main__` block in this process (runpy, with sys.argv set): the same argument parsing, the same
# try/except that turns BadInput into `error: ...` and exit code 2. An exception that escapes it
# would be a traceback in a real run; here it is reported as one. Two cases also run as real
# processes, to pin the exit code and stderr end to end.

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


@pytest.fixture
def decode_cli(capsys, monkeypatch):
    def run(ckpt, *extra):
        return Proc(*cli('decode.py', ['--ckpt', ckpt, '--device', 'cpu', '--max-new-tokens', '4',
                                       *extra], capsys, monkeypatch))
    return run


@pytest.fixture
def train_cli(capsys, monkeypatch):
    def run(*args):
        return Proc(*cli('train.py', [*TINY, *args], capsys, monkeypatch))
    return run


@pytest.fixture(scope='module')
def good_ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp('ckpts')
    m = tiny_model(seed=3, vocab_size=256, block_size=64, n_layer=1, n_embd=16,
                   dtype=torch.float32)
    path = d / 'good.pt'
    save_checkpoint(dict(model=m.state_dict(), model_args=vars(m.config)), str(path))
    return path


def test_decode_cli_works_on_a_good_checkpoint(good_ckpt, decode_cli):
    """The control for the error cases below: the same checkpoint and flags succeed."""
    proc = decode_cli(good_ckpt, '--prompt', 'def ', '--temperature', '0.5', '--seed', '1')
    assert proc.returncode == 0, proc.stderr
    assert 'Traceback' not in proc.stderr, proc.stderr
    assert proc.stdout.startswith('def ')
    assert '5 calls' in proc.stdout


def test_decode_missing_checkpoint_real_process(tmp_path):
    proc = run_py(['decode.py', '--ckpt', str(tmp_path / 'nope.pt'), '--prompt', 'x',
                   '--device', 'cpu'])
    assert proc.returncode == 2
    assert_clean_error(proc, 'not found')


def test_decode_corrupt_checkpoint(tmp_path, decode_cli):
    bad = tmp_path / 'garbage.pt'
    bad.write_bytes(os.urandom(2000))
    assert_clean_error(decode_cli(bad, '--prompt', 'x'), str(bad))


def test_decode_truncated_checkpoint(tmp_path, good_ckpt, decode_cli):
    bad = tmp_path / 'truncated.pt'
    data = good_ckpt.read_bytes()
    bad.write_bytes(data[:len(data) // 2])
    assert_clean_error(decode_cli(bad, '--prompt', 'x'), 'unreadable')


def test_decode_config_does_not_fit_weights(tmp_path, good_ckpt, decode_cli):
    ck = torch.load(good_ckpt, weights_only=False)
    ck['model_args'] = dict(ck['model_args'], n_embd=32)
    bad = tmp_path / 'mismatch.pt'
    torch.save(ck, bad)
    assert_clean_error(decode_cli(bad, '--prompt', 'x'), 'do not fit')


@pytest.mark.parametrize('extra, needles', [
    (['--prompt', ''], ['empty']),
    (['--prompt', 'def f(x):', '--max-new-tokens', '60'], ['64']),   # 9 + 60 > block_size 64
    (['--prompt', 'x', '--temperature=-0.5'], ['temperature']),
], ids=['empty-prompt', 'beyond-context', 'negative-temperature'])
def test_decode_bad_arguments(good_ckpt, decode_cli, extra, needles):
    proc = decode_cli(good_ckpt, *extra)
    assert proc.returncode == 2
    assert_clean_error(proc, *needles)


def test_train_data_missing_path_real_process(tmp_path):
    proc = run_py(['train.py', *TINY, '--data', str(tmp_path / 'missing'), '--out-dir',
                   str(tmp_path / 'out')])
    assert proc.returncode == 2
    assert_clean_error(proc, '--data', 'missing')


@pytest.mark.parametrize('content', ['empty', 'binary'])
def test_train_data_folder_without_text(tmp_path, train_cli, content):
    folder = tmp_path / 'data'
    folder.mkdir()
    if content == 'binary':
        (folder / 'blob.bin').write_bytes(b'\x00\x01\x02\xff' * 2048)
    proc = train_cli('--data', folder, '--out-dir', tmp_path / 'out')
    assert proc.returncode == 2
    assert_clean_error(proc, 'no text')
