"""`python -m exercises` given what a user's hands meet: every flag is checked before any work, and
anything wrong is one `error:` line (what was wrong, what is allowed), exit code 2; a handout that
cannot be written leaves nothing behind; `try` sets a planted wrong answer beside a reference it
cannot reach. Each case runs the command's main in this process (conftest.in_process, CUDA
hidden), on a few tiny checkpoints written here."""
import dataclasses
import errno
import inspect
import os
import re

import pytest
import torch

from conftest import corpus_text, in_process
from data import Vocab, save_checkpoint
from exercises import handout, harness
from exercises.__main__ import main as exercises_main
from heads import BlockHeads
from model import GPT, GPTConfig

pytestmark = pytest.mark.second_process   # balances the two processes (conftest.py)

HAVE_SOLUTIONS = all(harness.solution_path(n) for n in harness.exercises())


def redrawn(module, seed, std=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def write_out_dir(folder, **change):
    """A tiny out/ as train.py writes one: ckpt.pt (a random byte-level target, its data a small text
    file) and heads.pt (its BPD heads, k = 8). change: checkpoint fields replaced, for hostile cases."""
    os.makedirs(folder, exist_ok=True)
    corpus = os.path.join(folder, 'corpus.txt')
    with open(corpus, 'w') as f:
        f.write(corpus_text())
    cfg = GPTConfig(block_size=64, vocab_size=256, n_layer=1, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = redrawn(GPT(cfg), 0).eval()
    ckpt = dict(model=model.state_dict(), model_args=dataclasses.asdict(cfg), config=dict(data=corpus),
                vocab=Vocab('bytes').state())
    save_checkpoint({**ckpt, **change}, os.path.join(folder, 'ckpt.pt'))
    heads = BlockHeads(cfg, 8)
    save_checkpoint(dict(kind='heads', drafter=heads.state_dict(), k=8, d_hidden=heads.d_hidden,
                         model_args=dataclasses.asdict(cfg), base_fingerprint=model.fingerprint(),
                         vocab=Vocab('bytes').state()), os.path.join(folder, 'heads.pt'))
    return folder


@pytest.fixture(scope='module')
def out_dir(tmp_path_factory):
    return write_out_dir(str(tmp_path_factory.mktemp('out')))


def one_error(argv, *needles, cwd=None):
    """The command refuses argv with one `error:` line holding every needle, exit code 2."""
    code, out, err = in_process(lambda: exercises_main(argv), **({'cwd': cwd} if cwd else {}))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith('error: ') and 'Traceback' not in err, (code, err)
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize('argv,needles', [
    (['try', '1', '--device', 'nonsense'], ('--device', 'not a device')),
    (['try', '1', '--device', 'cuda'], ('--device cuda', 'CUDA device')),      # CUDA hidden: no GPU
    (['try', '1', '--device', 'cpu:1'], ('--device cpu:1', 'use cpu')),
    (['try', '1', '--device', ''], ('--device', 'not a device')),
    (['list', '3'], ('list 3', 'takes nothing')),
    (['list', '--solution'], ('--solution', 'list takes no flags')),
    (['check', '1', '--out-dir', 'x'], ('--out-dir', 'means nothing')),
    (['check', '1', '--device', 'cpu'], ('--device', 'means nothing')),
    (['handout', 'x', '--prompts', '3'], ('--prompts', 'handout takes no flags')),
    (['check', '1', '--solution', '--control', 'x'], ('--solution and --control',)),
    (['check', '1', '--control', ''], ('--control',)),
    (['try', '1', '--prompts', '100000'], ('--prompts', '<= 10000')),
    (['check', '1.5'], ('not an exercise number',)),
    (['check', '0'], ('exercise 0', 'choose one of')),
    (['handout', ''], ('handout', "folder's name is empty")),
])
def test_a_bad_flag_is_one_line(argv, needles):
    one_error(argv, *needles)


def test_try_checks_what_its_checkpoint_records(tmp_path, out_dir):
    """A checkpoint whose model_args is a list, whose config is no dict, or whose recorded data path
    is a number: one line naming the file, not a traceback from the harness; --out-dir a file too."""
    for name, change, needle in (('list', dict(model_args=[['n_layer', 1]]), "its 'model_args' is list"),
                                 ('config', dict(config=['data']), "its 'config' is list"),
                                 ('data', dict(config=dict(data=5)), "its 'config' holds 'data': int 5")):
        folder = write_out_dir(str(tmp_path / name), **change)
        one_error(['try', '1', '--out-dir', folder], os.path.join(folder, 'ckpt.pt'), needle)
    one_error(['try', '1', '--out-dir', os.path.join(out_dir, 'corpus.txt')], '--out-dir', 'not a folder')


def unwritable(tmp_path):
    """An empty folder no write can go into: one made read-only, or, where that stops nothing (root),
    a new folder under /proc, where nothing can be made."""
    folder = tmp_path / 'read-only'
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / 'probe').write_text('x')
    except OSError:
        return str(folder)
    (folder / 'probe').unlink()
    return '/proc/no-handout-here'


def test_a_handout_where_nothing_can_be_written_is_refused(tmp_path):
    """An empty read-only folder (or, as root, a folder under /proc), and a folder under a file:
    one line each, before anything is read or written."""
    where = unwritable(tmp_path)
    try:
        one_error(['handout', where], f"handout {where}", 'cannot write')
        assert not os.path.exists(where) or os.listdir(where) == []
    finally:
        (tmp_path / 'read-only').chmod(0o755)
    (tmp_path / 'a_file').write_text('mine')
    one_error(['handout', str(tmp_path / 'a_file' / 'course')], 'is a file')
    assert (tmp_path / 'a_file').read_text() == 'mine'


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout cannot make a handout")
@pytest.mark.parametrize('failure', [OSError(errno.ENOSPC, 'No space left on device'), KeyboardInterrupt()])
def test_a_handout_that_fails_halfway_leaves_nothing(tmp_path, monkeypatch, failure):
    copied, real = [], handout.shutil.copy2

    def copy2(src, dst):
        if len(copied) == 10:
            raise failure
        copied.append(dst)
        return real(src, dst)
    monkeypatch.setattr(handout.shutil, 'copy2', copy2)
    for dest in (tmp_path / 'new', tmp_path / 'empty'):
        if dest.name == 'empty':
            dest.mkdir()
        code, _, err = in_process(lambda: exercises_main(['handout', str(dest)]))
        if isinstance(failure, OSError):
            assert code == 2 and err.strip().startswith('error: handout ') and 'No space left' in err, err
        else:
            assert code == 130, err
        assert (not dest.exists()) if dest.name == 'new' else os.listdir(dest) == [], sorted(os.listdir(dest))
        copied.clear()


def table(out):
    """{first cell: the row's cells} of the markdown table `try` printed."""
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.splitlines() if line.startswith('| ')]
    return {r[0]: r for r in rows[1:]}


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="the reference rows need exercises/solutions/")
def test_try_sets_a_planted_wrong_answer_beside_the_reference(out_dir):
    """A verify_greedy that takes the bonus one position late, through `try 1`: the reference's row
    is plain greedy decoding's (every token the same), the wrong answer's is not."""
    code, out, err = in_process(lambda: exercises_main(
        ['try', '1', '--control', 'bonus one position late', '--out-dir', out_dir, '--prompts', '2',
         '--max-new', '16']))
    assert code == 0, err
    rows = table(out)
    # the planted answer's rows are named by what ran them, as `try --solution`'s are
    reference, planted = rows['reference, BPD heads, k = 8'], rows["control 'bonus one position late', BPD heads, k = 8"]
    assert reference[5] == '32/32' and planted[5] != reference[5], out


def wrong_verify_greedy():
    """The source of exercise 1's control 'bonus one position late', as a student.py."""
    solution = harness.load_file(harness.solution_path(1), 'exercise01_solution_source')
    source = inspect.getsource(solution.bonus_one_position_late)
    return re.sub(r'^def bonus_one_position_late', 'def verify_greedy', source)


def test_train_stopped_by_an_unwritten_exercise_says_resume_continues(tmp_path, monkeypatch):
    """In a handout, train.py stopped by an exercise not written yet says, in its one line, what
    the exercise's stub says (which exercises the stage needs) and that --resume continues; its
    closing demo of several paths per call (exercise 8's answer, left out of a handout) is skipped
    with a line, not a stop."""
    import generate
    import train
    stub = "exercise 6: write prefix_log_accept in exercises/06_al_loss/student.py (train.py's dblast stage)"

    def run(args):
        raise NotImplementedError(stub)
    monkeypatch.setattr(train, 'run', run)
    code, _, err = in_process(lambda: train.main(['--out-dir', str(tmp_path / 'out')]))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"not written yet: {stub}"), err
    assert '--resume continues' in lines[0], err

    logged = []

    def demo(*args, paths=1, **kw):
        if paths > 1:
            raise NotImplementedError("exercise 8: verification.tree_layout is part of exercise 8's answer")
        logged.append('demo')
    monkeypatch.setattr(generate, 'demo', demo)
    target = GPT(GPTConfig(block_size=64, vocab_size=8, n_layer=1, n_head=1, n_embd=8))
    generate.closing_demos(target, torch.zeros(1, 4, dtype=torch.long), None, None, 8, [('DBlast K=4', None)], 4, 1.5,
                        logged.append)
    assert logged[-1].startswith('DBlast K=4, 4 paths: skipped, exercise 8: ') and logged.count('demo') == 1, logged
