"""
The scripts in a hostile environment, where tests/test_cli.py gives them hostile flags: their output
going nowhere (stdout closed, a pipe whose reader is gone, a full device), stderr closed, a write
that fails halfway (a full disk), a file name the file system cannot hold, SIGTERM during a save,
--compile where no C++ compiler is found, gpu_check.py over another run's folders, and a folder given
where a checkpoint file goes. Each ends as a Unix tool does: one line and a nonzero exit (a closed
pipe: quietly, exit code 141), nothing half-written, no checkpoint changed.

Most cases run in this process, through the cli.run_script every script's `__main__` runs. The
end to end cases (`scripts`, slow tier) run the scripts themselves, as `python script.py args` runs
them, in child processes forked from one driver process that imported torch and the scripts' modules
once (`python tests/test_hostile.py CASES RESULTS`, at the end of this file): each child gets its own
stdout and stderr at the file-descriptor level (closed, a pipe with no reader, /dev/full, a file),
environment and limits, then runs the script as its `__main__`, exit code and interpreter shutdown
included. A process each would cost a torch import each (1.6 s on a 2-core machine).
"""
import atexit
import contextlib
import errno
import io
import json
import os
import resource
import runpy
import signal
import subprocess
import sys
import time
import traceback
import types
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest
import torch

import cli
import data
import gpu_check
import train
import trainer
from bench import trainings
from cli import BadInput, OutputLost, check_replaceable, run_script
from conftest import corpus_text, env, in_process
from data import heldout_prompts_of, load_checkpoint, save_checkpoint
from heads import BlockHeads
from measure import SIZES
from model import GPT, GPTConfig


# ----------------------------------------------------------------------------- a tiny run, made without training

TINY = GPTConfig(block_size=64, vocab_size=256, n_layer=1, n_head=2, n_embd=16)


def tiny_run(folder, corpus):
    """ckpt.pt (a seeded target recording `corpus` as its data) and heads.pt for it, as train.py
    names them; no step trained."""
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    target = GPT(TINY)
    save_checkpoint(dict(model=target.state_dict(), model_args=asdict(TINY), config=dict(data=str(corpus)),
                         vocab=data.Vocab('bytes').state()), os.path.join(folder, 'ckpt.pt'))
    heads = BlockHeads(TINY, 4)
    save_checkpoint(dict(kind='heads', drafter=heads.state_dict(), k=4, d_hidden=heads.d_hidden,
                         model_args=asdict(TINY), base_fingerprint=target.eval().fingerprint()),
                    os.path.join(folder, 'heads.pt'))
    return folder


def listing(folder):
    """Every file under folder with its bytes: what a refused run must leave as it was."""
    out = {}
    for d, _, names in os.walk(folder):
        for n in names:
            with open(os.path.join(d, n), 'rb') as f:
                out[os.path.relpath(os.path.join(d, n), folder)] = f.read()
    return out


def one_error_line(err, *needles):
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ----------------------------------------------------------------------------- stdout and stderr, in this process

class Failing(io.RawIOBase):
    """A stream's file that refuses every write with `err` (EPIPE: the pipe's reader is gone;
    ENOSPC: a full device). It has no file descriptor, so nothing of this process is redirected."""

    def __init__(self, err):
        self.err = err

    def writable(self):
        return True

    def write(self, b):
        if self.err is None:   # healed: what is still buffered goes nowhere
            return len(b)
        raise OSError(self.err, os.strerror(self.err))


@pytest.fixture
def streams(monkeypatch):
    """use(stdout, stderr=''): this process's own streams (sys.__stdout__ too, as a script's are),
    each '' (a StringIO), an errno (a Failing writer) or None (closed); returns them by name."""
    failing = []

    def use(stdout, stderr=''):
        made = {}
        for name, how in (('stdout', stdout), ('stderr', stderr)):
            stream = io.StringIO() if how == '' else None if how is None else \
                io.TextIOWrapper(io.BufferedWriter(Failing(how)), write_through=True)
            failing.extend([stream] * isinstance(how, int))
            made[name] = stream
            monkeypatch.setattr(sys, name, stream)
            monkeypatch.setattr(sys, f'__{name}__', stream)
        return made
    yield use
    for stream in failing:   # closed without a complaint about what it still holds
        stream.buffer.raw.err = None
        stream.close()


def ended(main):
    """run_script(main) -> its exit code."""
    with pytest.raises(SystemExit) as e:
        run_script(main)
    return e.value.code


@pytest.mark.parametrize('err', [errno.EPIPE, errno.ENOSPC, errno.EIO])
def test_output_that_cannot_be_written_ends_the_run_as_a_unix_tool(streams, err):
    """A write to stdout that fails: a closed pipe ends quietly with 141; a full device or an I/O
    error is one line on stderr naming stdout and why, exit code 1; no traceback. Whatever the
    print's place: inside main, or in the output flushed at its end (argparse's --help exits first)."""
    for main in (lambda: print('x' * 100, flush=True), lambda: print('x'), lambda: sys.exit(print('usage: ...'))):
        made = streams(err)
        code = ended(main)
        said = made['stderr'].getvalue()
        if err == errno.EPIPE:
            assert code == 141 and said == ''
        else:
            assert code == 1 and said == f"error: cannot write to stdout ({os.strerror(err)}); stopped, and what it " \
                                         f"printed is incomplete\n"


def test_a_closed_stdout_is_refused_before_any_work_and_a_closed_stderr_drops_what_goes_there(streams):
    """stdout closed (sys.stdout None): one line, exit code 2, main never runs. stderr closed: the
    run goes on (train.py's progress bar, notes) and ends as it would; its error line, if any, is
    dropped, its exit code is not."""
    ran = []
    made = streams(None)
    assert ended(lambda: ran.append(1)) == 2 and not ran
    one_error_line(made['stderr'].getvalue(), 'stdout is closed', '/dev/null')
    streams('', None)

    def work():
        for _ in trainer.progress(range(3), desc='stage'):
            print('note', file=sys.stderr)
        print('done')
        ran.append(1)
    assert ended(lambda: (work(), sys.exit(0))) == 0 and ran == [1]
    assert sys.stdout.getvalue() == 'done\n'

    def refused():
        raise BadInput('bad')
    assert ended(refused) == 2


def test_a_closed_pipe_ends_the_run_even_inside_a_gpu_check_part(tmp_path):
    """A failed write through a script's stream (cli.GuardedOutput) passes every `except Exception`
    on its way: a gpu_check part whose table cannot be printed ends the run (run_script then ends it
    quietly), it is not recorded as a failed part, and the next part does not run."""
    pipe = io.TextIOWrapper(io.BufferedWriter(Failing(errno.EPIPE)), write_through=True)

    def part(c):
        print('| a row |', file=cli.GuardedOutput(pipe, 'stdout'), flush=True)
    try:
        with pytest.raises(OutputLost) as e:
            gpu_check.run_parts(types.SimpleNamespace(device='cpu'), [('a', 'prints', part, 10),
                                                                      ('e', 'next', lambda c: dict(ok=True), 10)], {},
                                str(tmp_path / 'gpu_check.json'))
    finally:
        pipe.buffer.raw.err = None
        pipe.close()
    assert e.value.stream == 'stdout' and isinstance(e.value.error, BrokenPipeError)
    assert not (tmp_path / 'parts.jsonl').exists() and not (tmp_path / 'gpu_check.json').exists()


# ----------------------------------------------------------------------------- writes that fail

def test_a_save_that_fails_inside_torchs_writer_is_one_line_with_the_systems_reason(tmp_path):
    """torch.save to a path reports a failed write as a RuntimeError without the reason ('unexpected
    pos ...'). A file size limit stops it halfway, as a full disk does: one line naming the file and
    the system's reason, the previous checkpoint's bytes as they were, no temporary file."""
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(dict(iter_num=1), str(path))
    old = path.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard))
    try:
        with pytest.raises(BadInput) as e:
            save_checkpoint(dict(w=torch.zeros(50000)), str(path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value) == (f"cannot write the checkpoint {path} (File too large); nothing half-written is left, "
                            f"and the previous one is as it was")
    assert path.read_bytes() == old and os.listdir(tmp_path) == ['ckpt.pt']
    with pytest.raises(BadInput, match=r"cannot write the checkpoint .*/nowhere/ckpt.pt \(No such file or directory\); "
                                       r".*there is none"):
        save_checkpoint(dict(iter_num=1), str(tmp_path / 'nowhere' / 'ckpt.pt'))


def test_a_name_the_file_system_cannot_hold_is_refused_before_the_work(tmp_path, corpus_file):
    """--tag long enough that heads{tag}.pt (or its temporary file) is longer than the file system
    allows: refused by train.py before any stage runs (once a stage had trained, the save failed in
    a traceback). The longest name that fits is taken."""
    run = tiny_run(tmp_path / 'run', corpus_file)
    before = listing(run)
    limit = os.pathconf(run, 'PC_NAME_MAX')
    suffix = len(f"heads.pt.{os.getpid()}.tmp")
    t0 = time.monotonic()
    code, _, err = in_process(lambda: train.main(['--device', 'cpu', '--no-demo', '--data', str(corpus_file),
                                                  '--out-dir', str(run), '--stages', 'heads',
                                                  '--tag', 'x' * (limit - suffix + 1)]))
    assert code == 2 and time.monotonic() - t0 < 10, err
    one_error_line(err, f"cannot write the checkpoint {run}/heads{'x' * 4}", f"more than the {limit}",
                   'nothing was done')
    assert listing(run) == before
    check_replaceable(os.path.join(run, 'heads' + 'x' * (limit - suffix) + '.pt'))


@pytest.fixture
def sigterm_handled():
    """SIGTERM at its default for the test, as a script starts (run_script installs its own);
    afterwards as it was."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def test_sigterm_during_a_save_finishes_the_save_then_ends_with_one_line(tmp_path, monkeypatch, sigterm_handled,
                                                                          streams):
    """SIGTERM (a scheduler's) while torch.save writes: the write finishes and replaces the file,
    then the run ends with one line and exit code 143; a second SIGTERM stops the write at once and
    leaves the previous file. Never a temporary file."""
    path = tmp_path / 'ckpt.pt'
    save_checkpoint(dict(iter_num=1), str(path))
    real = torch.save

    def terminated(times):
        def save(obj, f):   # half a file written, then SIGTERM (`times` of them), then the rest
            real(obj, f)
            with open(f, 'r+b') as fh:
                fh.truncate(os.path.getsize(f) // 2)
            assert callable(signal.getsignal(signal.SIGTERM)), "SIGTERM would kill the test process"
            for _ in range(times):
                signal.raise_signal(signal.SIGTERM)
            real(obj, f)
        return save
    for times, kept in ((1, 2), (2, 2)):
        made = streams('')
        monkeypatch.setattr(torch, 'save', terminated(times))

        def main():
            try:
                save_checkpoint(dict(iter_num=times + 1), str(path))
            except KeyboardInterrupt:   # as train.py says what was kept
                raise KeyboardInterrupt("interrupted: every checkpoint is as of its last save") from None
        assert ended(main) == 143
        assert made['stderr'].getvalue() == "\nterminated (SIGTERM): every checkpoint is as of its last save\n"
        assert torch.load(path, weights_only=True) == dict(iter_num=kept) and os.listdir(tmp_path) == ['ckpt.pt']
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL      # given back


# ----------------------------------------------------------------------------- --compile without a C++ compiler

def test_a_compiler_missing_inside_torch_compile_is_one_line(streams):
    """Where no check ran first: inductor's InvalidCxxCompiler, as dynamo wraps it, ends the run with
    one line saying what is missing and how to run without it; any other error stays a traceback."""
    from torch._inductor.exc import InvalidCxxCompiler

    def compiled():
        try:
            raise InvalidCxxCompiler()
        except InvalidCxxCompiler as e:
            raise RuntimeError("backend='inductor' raised") from e
    made = streams('')
    assert ended(compiled) == 2
    one_error_line(made['stderr'].getvalue(), 'needs a C++ compiler', '$CXX', 'without --compile')
    with pytest.raises(ZeroDivisionError):
        run_script(lambda: 1 / 0)


# ----------------------------------------------------------------------------- gpu_check over another run's folders

def gpu_args(ckpt_dir, corpus):
    """gpu_check --quick's flags as its main settles them, for check_ckpt_dir."""
    args = types.SimpleNamespace(ckpt_dir=str(ckpt_dir), seed=1337, device='cpu', threads=None, data=str(corpus),
                                 tables=['speed'], dblast_k=4, **dict.fromkeys(SIZES))
    for key, v in gpu_check.QUICK.items():
        setattr(args, key, v)
    return args


def test_gpu_check_refuses_a_ckpt_dir_of_another_run_before_any_work(tmp_path, corpus_file):
    """Part a trains afresh into --ckpt-dir: a ckpt.pt there made with other flags (other sizes, as
    bench.py refuses it; other steps), or beside drafters part a does not train (a train.py run's),
    is one line before any work, naming what differs and what to do; the folder is left as it was.
    A folder of an earlier check with the same flags is taken."""
    run = tiny_run(tmp_path / 'run', corpus_file)
    args = gpu_args(run, corpus_file)
    same = vars(train.parse_args(gpu_check.train_args(args, 'base')))   # what this check's part a records
    ckpt = torch.load(run / 'ckpt.pt', weights_only=True)
    torch.save(dict(ckpt, config=dict(same, n_embd=32)), run / 'ckpt.pt')
    before = listing(run)
    out = tmp_path / 'gc'
    code, _, err = in_process(lambda: gpu_check.main(['--quick', '--device', 'cpu', '--out', str(out), '--ckpt-dir',
                                                      str(run), '--data', str(corpus_file)]))
    assert code == 2, err
    one_error_line(err, f"--ckpt-dir {run}: its ckpt.pt was made by another run (n_embd=32 (this run: 16)), which "
                        f"part a would replace with a target of its own: use another --ckpt-dir")
    assert listing(run) == before and not out.exists()
    torch.save(dict(ckpt, config=dict(same, max_iters=250)), run / 'ckpt.pt')
    with pytest.raises(BadInput, match=r"made by another run \(max_iters=250 \(this run: 20\)\)"):
        gpu_check.check_ckpt_dir(args, str(run), 'a')
    torch.save(dict(ckpt, config=same), run / 'ckpt.pt')    # this check's flags, beside heads.pt it does not train
    with pytest.raises(BadInput, match=r"it holds heads.pt, which part a does not train: its new ckpt.pt would leave "
                                       r"them trained for the old target"):
        gpu_check.check_ckpt_dir(args, str(run), 'a')
    os.remove(run / 'heads.pt')
    for name, _ in trainings(args, resume=False):
        (run / f'{name}.pt').touch()
    gpu_check.check_ckpt_dir(args, str(run), 'a')


def test_gpu_check_records_name_their_run_and_a_new_run_starts_afresh(tmp_path):
    """parts.jsonl and gpu_check.json hold the same run: a new run's first record replaces what an
    earlier run (another commit) left, and every record names its run's commit and start time."""
    path = str(tmp_path / 'gpu_check.json')
    parts = [('a', 'fine', lambda c: dict(ok=True), 10), ('e', 'fine too', lambda c: dict(ok=True), 10)]
    for commit, started in (('1' * 40, '2025-01-01T00:00:00+0000'), ('2' * 40, '2025-01-02T00:00:00+0000')):
        gpu_check.run_parts(types.SimpleNamespace(device='cpu'), parts, dict(meta=dict(git_commit=commit),
                                                                             started=started), path)
        lines = [json.loads(x) for x in (tmp_path / 'parts.jsonl').read_text().splitlines()]
        assert [(r['part'], r['commit'], r['run_started']) for r in lines] == [('a', commit, started),
                                                                              ('e', commit, started)]
        assert lines == list(json.loads((tmp_path / 'gpu_check.json').read_text())['parts'].values())


# ----------------------------------------------------------------------------- wording

def test_a_folder_given_as_a_checkpoint_says_so(tmp_path, corpus_file):
    """A folder where a checkpoint file goes is named as a folder, with the file to give;
    heldout_prompts_of takes a run's folder or its target's checkpoint file alike; --resume on
    a checkpoint of other sizes says so in words."""
    run = tiny_run(tmp_path / 'run', corpus_file)
    with pytest.raises(BadInput) as e:
        load_checkpoint(str(run))
    assert str(e.value) == f"{run} is a folder; give a checkpoint file, e.g. {run}/ckpt.pt (it holds ckpt.pt, heads.pt)"
    with pytest.raises(BadInput) as e:
        load_checkpoint(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path} is a folder; give a checkpoint file")
    assert torch.equal(heldout_prompts_of(str(run / 'ckpt.pt'), n=2), heldout_prompts_of(str(run), n=2))
    args = types.SimpleNamespace(resume=True)
    with pytest.raises(trainer.Mismatch, match=r"was made with other model flags \(--n-layer, ...\) \(model_args="):
        trainer.resume_state(args, str(run / 'ckpt.pt'), dict(model_args=dict(asdict(TINY), n_embd=32)), 'model')
    with pytest.raises(trainer.Mismatch, match=r"was made with another target \(trained_from=None"):
        trainer.resume_state(args, str(run / 'heads.pt'), dict(trained_from='abc'))


# ----------------------------------------------------------------------------- the scripts end to end (slow)

def train_argv(out, corpus, *extra):
    return ['train.py', '--device', 'cpu', '--no-demo', '--threads', '1', '--data', str(corpus), '--out-dir', str(out),
            '--stages', 'base', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64',
            '--batch-size', '4', '--max-iters', '6', '--eval-iters', '1', '--eval-interval', '1000',
            '--warmup-iters', '1', *extra]


def script_cases(run, corpus, work):
    """(id, argv, stdout, stderr, options): stdout / stderr 'file', 'closed', 'pipe' (its reader
    gone) or 'full' (/dev/full); options: env to set, names to unset, fsize (RLIMIT_FSIZE), and
    sigterm_in_save (SIGTERM arrives halfway through the first torch.save)."""
    ckpt, heads = str(run / 'ckpt.pt'), str(run / 'heads.pt')
    gen = ['generate.py', '--device', 'cpu', '--ckpt', ckpt, '--max-new-tokens', '4']
    scripts = {'generate': gen, 'blockwise': gen + ['--heads', heads], 'train': 'train',
               'bench': ['bench.py', '--help'], 'gpu_check': ['gpu_check.py', '--help'], 'exercises': ['-m', 'exercises']}
    cases = []
    for out in ('file', 'closed', 'pipe', 'full'):
        for name, argv in scripts.items():
            if (out == 'closed' and name == 'generate') or (out in ('pipe', 'full') and name == 'blockwise'):
                continue
            cid = f'{name}-stdout-{out}'
            argv = train_argv(work / cid, corpus) if argv == 'train' else argv
            cases.append((cid, argv, out, 'file', {}))
    cases += [('train-stderr-closed', train_argv(work / 'train-stderr-closed', corpus), 'file', 'closed', {}),
              ('blockwise-stderr-closed', gen + ['--heads', heads], 'file', 'closed', {})]
    no_compiler = dict(env=dict(PATH=str(work / 'empty')), unset=['CXX'])
    cases += [('generate-compile', gen + ['--compile'], 'file', 'file', no_compiler),
              ('train-compile', train_argv(work / 'train-compile', corpus, '--compile'), 'file', 'file', no_compiler),
              ('bench-compile', ['bench.py', '--quick', '--device', 'cpu', '--tables', 'speed', '--compile', '--out',
                                 str(work / 'bench-compile')], 'file', 'file', no_compiler),
              ('gpu_check-compile', ['gpu_check.py', '--device', 'cpu', '--parts', 'c', '--out',
                                     str(work / 'gpu_check-compile')], 'file', 'file', no_compiler)]
    cases += [('train-disk-full', train_argv(work / 'train-disk-full', corpus), 'file', 'file', dict(fsize=20000)),
              ('train-sigterm-in-save', train_argv(work / 'train-sigterm-in-save', corpus, '--ckpt-interval', '3'),
               'file', 'file', dict(sigterm_in_save=True))]
    return cases


@pytest.fixture(scope='module')
def scripts(tmp_path_factory):
    """Every case of script_cases, run by one driver process: {id: its exit code, stdout, stderr,
    folder, and what the folder held before}."""
    if not sys.platform.startswith('linux'):   # /dev/full, and forking after torch's import
        pytest.skip("the driver forks after importing torch and writes to /dev/full: Linux only")
    root = tmp_path_factory.mktemp('hostile')
    corpus = root / 'corpus.txt'
    corpus.write_text(corpus_text())
    run = tiny_run(root / 'run', corpus)
    work = root / 'cases'
    (work / 'empty').mkdir(parents=True)
    before = {'train-disk-full': listing(tiny_run(work / 'train-disk-full', corpus))}   # must stay as it was
    cases = [dict(id=cid, argv=[str(a) for a in argv], stdout=o, stderr=e, files=str(work / f'{cid}.'), **opts)
             for cid, argv, o, e, opts in script_cases(run, corpus, work)]
    (root / 'cases.json').write_text(json.dumps(cases))
    driver_env = env()
    driver_env.pop('PYTHONUNBUFFERED')   # the streams as a user's run has them: buffered away from a terminal
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(root / 'cases.json'),
                           str(root / 'results.json')], cwd=ROOT, env=driver_env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads((root / 'results.json').read_text())

    def text(path):
        return open(path, errors='replace').read() if os.path.exists(path) else ''
    return {c['id']: types.SimpleNamespace(code=codes[c['id']], out=text(c['files'] + 'out'),
                                           err=text(c['files'] + 'err'), folder=work / c['id'],
                                           before=before.get(c['id']))
            for c in cases}


NAMES = ('generate', 'blockwise', 'train', 'bench', 'gpu_check', 'exercises')


@pytest.mark.slow
@pytest.mark.parametrize('name', NAMES)
def test_scripts_with_their_output_going_nowhere(scripts, name):
    """Every script, its stdout a file (the control: it works), closed (`>&-`: one line, exit code
    2, before any work), a pipe whose reader is gone (`| true`, `| head -c 10`: quiet, exit code
    141) or a full device (`> /dev/full`: one line, exit code 1); stderr closed (`2>&-`): the run
    as it would be. Never a traceback or the interpreter's 'Exception ignored'."""
    for cid, r in scripts.items():
        if not cid.startswith(name + '-') or 'compile' in cid or cid.startswith(('train-disk', 'train-sigterm')):
            continue
        said = f"{cid}: exit code {r.code}\nstderr: {r.err[-2000:]}"
        assert 'Traceback' not in r.err and 'Exception ignored' not in r.err, said
        if cid.endswith(('stdout-file', 'stderr-closed')):
            assert r.code == 0 and r.out, said
        elif cid.endswith('stdout-closed'):
            assert r.code == 2, said
            one_error_line(r.err, 'stdout is closed')
        elif cid.endswith('stdout-pipe'):
            assert r.code == 141 and r.err == '', said
        else:
            assert r.code == 1, said
            one_error_line(r.err, 'cannot write to stdout (No space left on device)')
        if name == 'train':   # trained only where it could print: stopped at its first line, before the work
            left = os.listdir(r.folder) if os.path.isdir(r.folder) else []
            assert ('ckpt.pt' in left) == (r.code == 0) and not [n for n in left if n.endswith('.tmp')], said


@pytest.mark.slow
def test_scripts_with_compile_and_no_compiler(scripts):
    """--compile on a CPU with no C++ compiler on PATH and $CXX unset: generate.py, train.py,
    bench.py and gpu_check.py (without --quick, where inductor compiles) refuse it in one line before
    any work, saying what is missing and how to run without it."""
    for cid in ('generate-compile', 'train-compile', 'bench-compile', 'gpu_check-compile'):
        r = scripts[cid]
        assert r.code == 2, f"{cid}: {r.err[-2000:]}"
        one_error_line(r.err, '--compile on a CPU needs a C++ compiler', '(g++ did not run)', 'without --compile')
        assert not os.path.exists(r.folder), cid


@pytest.mark.slow
def test_train_py_on_a_full_disk_and_under_sigterm(scripts):
    """A save that fails halfway (a file size limit standing in for a full disk): one line naming
    the file and why, exit code 2, the previous ckpt.pt as it was, no temporary file. SIGTERM in
    the middle of a save: the save finishes (ckpt.pt loads, at the step it saved), then one line
    saying what was kept, exit code 143, no temporary file."""
    r = scripts['train-disk-full']
    errors = [x for x in r.err.splitlines() if x.startswith('error:')]
    assert r.code == 2 and 'Traceback' not in r.err and len(errors) == 1, r.err[-2000:]
    assert errors[0] == (f"error: cannot write the checkpoint {r.folder}/ckpt.pt (File too large); nothing "
                         f"half-written is left, and the previous one is as it was")
    assert {n: b for n, b in listing(r.folder).items() if not n.startswith('data')} == r.before   # no *.tmp
    r = scripts['train-sigterm-in-save']
    lines = [x for x in r.err.splitlines() if x.strip()]
    assert r.code == 143 and 'Traceback' not in r.err, r.err[-2000:]
    assert lines[-1] == (f"terminated (SIGTERM): every checkpoint in {r.folder}/ is as of its last save; continue "
                         f"with the same command and --resume")
    assert load_checkpoint(str(r.folder / 'ckpt.pt'))['iter_num'] == 3
    assert sorted(os.listdir(r.folder)) == ['ckpt.pt', 'data']


# ----------------------------------------------------------------------------- the driver

def drive(cases_path, results_path):
    """Run each case in a child forked from this process (torch and the scripts' modules imported
    once, here, before any tensor work: a fork then carries no thread pool), one at a time; write
    {id: exit code (-N: killed by signal N)}."""
    import torch  # noqa: F401
    import bench, data, generate, gpu_check, train  # noqa: F401,E401
    import exercises.handout, exercises.harness  # noqa: F401,E401  (what `python -m exercises` imports)
    from torch._inductor import cpp_builder  # noqa: F401  (the compiler check's; nothing searched yet)
    with open(cases_path) as f:
        cases = json.load(f)
    codes = {}
    for case in cases:
        pid = os.fork()
        if pid == 0:
            finish(lambda: start(case))
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[case['id']] = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[case['id']] = 'hung'
                break
            time.sleep(0.01)
    with open(results_path, 'w') as f:
        json.dump(codes, f)


def finish(run):
    """run() the script as `python script.py` runs it, then end this child as the interpreter ends
    as far as the output goes (CPython's Py_FinalizeEx): sys.exit's message printed, a traceback
    for an exception, atexit's functions, then sys.stdout and sys.stderr flushed, a failure there
    reported ('Exception ignored') with exit status 120. Then os._exit: tearing down torch's modules
    as the interpreter does would cost about a second a case, and writes nothing."""
    try:
        run()
        code = 0
    except SystemExit as e:
        code = 0 if e.code is None else e.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception as e:
            code = 120
            with contextlib.suppress(Exception):
                print(f"Exception ignored in: {stream!r}\n{type(e).__name__}: {e}", file=sys.stderr, flush=True)
    os._exit(code)


def start(case):
    """In the child: its stdout and stderr, environment and limits, then the script as `__main__`."""
    for fd, how, suffix in ((1, case['stdout'], 'out'), (2, case['stderr'], 'err')):
        if how == 'closed':
            os.close(fd)
            continue
        if how == 'pipe':
            r, new = os.pipe()
            os.close(r)
        else:
            new = os.open('/dev/full' if how == 'full' else case['files'] + suffix, os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(new, fd)
        os.close(new)
    if case['stdout'] == 'closed':   # as Python starts where fd 1 is closed
        sys.stdout = sys.__stdout__ = None
    if case['stderr'] == 'closed':
        sys.stderr = sys.__stderr__ = None
    os.environ.update(case.get('env', {}))
    for name in case.get('unset', []):
        os.environ.pop(name, None)
    if case.get('fsize'):
        resource.setrlimit(resource.RLIMIT_FSIZE, (case['fsize'], resource.RLIM_INFINITY))
    if case.get('sigterm_in_save'):
        import torch
        real = torch.save

        def save(obj, f):   # half the file written, SIGTERM, then the rest: the signal lands inside the save
            real(obj, f)
            with open(f, 'r+b') as fh:
                fh.truncate(os.path.getsize(f) // 2)
            os.kill(os.getpid(), signal.SIGTERM)
            real(obj, f)
        torch.save = save
    argv = case['argv']
    if argv[0] == '-m':
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name='__main__')


if __name__ == '__main__':
    drive(*sys.argv[1:3])
