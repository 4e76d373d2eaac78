"""gpu_check.py at tiny sizes on a CPU (--quick): every part runs and lands in gpu_check.json and
parts.jsonl; a failed, crashed or hung part is recorded and the next one runs; a killed check keeps
the parts it finished; flags it cannot take are one error line."""
import json
import math
import os
import shutil
import subprocess
import sys
import time
import types

import pytest
import torch

import bench
import gpu_check
from conftest import ROOT, Proc, assert_clean_error, env, run_main


@pytest.mark.slow
def test_gpu_check_quick_on_cpu(tmp_path, corpus_file):
    """gpu_check.py --quick: every part runs (those that need CUDA, and compiled training, are
    skipped with the reason), passes, is printed and lands in gpu_check.json."""
    out, backend_before = tmp_path / 'gc', gpu_check.runner.BACKEND
    code, stdout, stderr = run_main('gpu_check.py', ['--quick', '--device', 'cpu', '--out', out,
                                            '--data', corpus_file, '--parts', 'a,h,k,j,c,d,e,f,g,i,b,l'])
    assert code == 0, stderr[-3000:]
    res = json.loads((out / 'gpu_check.json').read_text())
    parts = res['parts']
    assert {k: p['status'] for k, p in parts.items()} == dict(a='pass', h='pass', k='pass', j='pass', c='pass',
                                                              d='pass', e='pass', f='skipped', g='skipped', i='pass',
                                                              b='skipped', l='pass')
    assert list(parts) == list('ahkjcdefgibl')   # the speed figures early, as --parts orders them
    assert res['failed'] == [] and 'aot_eager' in res['compiled_decoding']
    assert res['meta']['command'].startswith('python gpu_check.py --quick --device cpu')   # the command that ran
    # every part's record, a line of parts.jsonl the moment it ended, names what it ran on
    lines = [json.loads(x) for x in (out / 'parts.jsonl').read_text().splitlines()]
    assert [r['part'] for r in lines] == list('ahkjcdefgibl') and lines == list(parts.values())
    assert [(r['config'], r['mode']) for r in parts['i']['rows']] == [(gpu_check.PLAIN, 'eager'), (gpu_check.HEADS, 'eager'),
                                                                       (gpu_check.PLAIN, 'compiled'), (gpu_check.HEADS, 'compiled')]
    for r in lines:
        assert r['torch'] == torch.__version__ and 'cuda' in r and r['device'] == 'cpu' and r['device_name']
        assert r['dtype'] and r['time_limit'] > 0 and r['graphs_compiled'] >= 0 and r['cudagraph_skips'] == 0
    assert parts['h']['graphs_compiled'] >= 3 and parts['a']['graphs_compiled'] == 0
    assert all(f"\n## {k}. " in stdout and f"\n{k}: {p['status']}" in stdout for k, p in parts.items())
    # a: one train.main call per stage, each timed; no memory figure without CUDA
    assert [r['stage'] for r in parts['a']['rows']] == ['ckpt', 'heads_frozen_distill', 'dblast_K4_T1.0_al',
                                                        'dblast_K1_T1.0_nll']
    assert all(r['seconds'] > 0 and r['added_memory_mib'] is None for r in parts['a']['rows'])
    assert 'C++' in parts['b']['skipped'] and parts['f']['skipped'] == parts['g']['skipped'] == 'no CUDA'
    # c: nothing compiled in the identical second call (the warm-up compiles nothing either: part h,
    # run before it, compiled the same configurations)
    assert [r['config'] for r in parts['c']['rows']] == [gpu_check.PLAIN, gpu_check.HEADS, gpu_check.SAMPLED]
    assert all(r['warmup_graphs'] == r['new_graphs'] == r['new_captures'] == 0 for r in parts['c']['rows'])
    # j: every way of running the steps on a CPU, plain and k = 8, each with its time and operations per call
    ways = ['eager', 'compiled, 1 step a host call', f"compiled, {gpu_check.runner.UNIT['cpu plain']} (plain) or "
            f"{gpu_check.runner.UNIT['cpu']} steps a host call"]
    assert [(r['way'], r['config']) for r in parts['j']['rows']] == [(w, c) for w in ways
                                                                     for c in (gpu_check.PLAIN, gpu_check.HEADS)]
    assert all(r['us_per_call'] > 0 and r['ops_per_call'] > 0 and r['first_call_s'] > 0 for r in parts['j']['rows'])
    assert all(math.isfinite(r['us_per_further_call']) for r in parts['j']['rows'] + parts['l']['rows'])
    assert parts['j']['attention'] is None   # the attention kernels are compared on CUDA
    # l: without and with coordinate-descent tuning, each compiled anew (not the units part j left)
    assert [(r['coordinate_descent_tuning'], r['config']) for r in parts['l']['rows']] == [
        (tuned, c) for tuned in (False, True) for c in (gpu_check.PLAIN, gpu_check.HEADS)]
    assert all(r['us_per_call'] > 0 and r['first_call_s'] > 0 for r in parts['l']['rows'])
    assert parts['l']['graphs_compiled'] >= 4
    # k: one path, trees and paths, each with its tau and speedup
    sampled = list(bench.fitted(bench.SAMPLED_TREES[1], 4))   # as JSON keeps it
    assert [(r['drafter'], r['paths'], r['nodes'], r['branching']) for r in parts['k']['rows']] == [
        ('BPD heads', 1, None, None), ('BPD heads', 1, 8, None), ('BPD heads', 1, 32, None),
        ('BPD heads', 1, 64, None), ('DBlast K=4', 1, None, None), ('DBlast K=4', 8, None, None),
        ('DBlast K=4', 1, 24, None), ('DBlast K=4', 1, None, sampled),
        ('prompt lookup', 1, None, None), ('prompt lookup', 1, bench.TREE_OF, None)]
    assert all(r['tau'] >= 1 and r['speedup'] > 0 for r in parts['k']['rows'])
    assert all(0 <= r['identical_tokens'] <= 1 for r in parts['d']['rows'])
    assert [r['mode'] for r in parts['e']['rows']] == ['eager', 'compiled']
    # h: three speed tables, the greedy rows with their identical-token share, the sampled without
    tables = parts['h']['tables']
    assert list(tables) == ['eager, float32', 'compiled, float32', 'eager, bfloat16 autocast']
    for t in tables.values():
        assert [(r['drafter'], r['k']) for r in t['rows']] == [('BPD heads', 8), ('independent K=1 NLL', 4),
                                                                ('DBlast K=4 AL', 4)]
        assert 0 <= t['rows'][0]['identical_tokens'] <= 1 and t['rows'][1]['identical_tokens'] is None
        # compiled: what compiling gains, from eager runs timed in the same rounds
        assert all((r.get('compile_gain', 0) > 0 and r['plain_compile_gain'] > 0) == (t['mode'] == 'compiled')
                   for r in t['rows'])
    assert '### 0. Speed (compiled, float32, ' in stdout
    assert gpu_check.runner.BACKEND == backend_before   # aot_eager for this run only


@pytest.fixture
def quick_run(tmp_path, corpus_file):
    """A folder of a finished train.py run, every stage at gpu_check --quick's sizes."""
    out = tmp_path / 'run'
    code, _, stderr = run_main('train.py', ['--device', 'cpu', '--data', corpus_file, '--out-dir', out, '--no-demo',
                                            '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64',
                                            '--batch-size', '4', '--max-iters', '20', '--heads-iters', '4',
                                            '--dblast-iters', '4', '--distill-samples', '4', '--dblast-samples', '4',
                                            '--dblast-eval-samples', '4'])
    assert code == 0, stderr[-2000:]
    return out


@pytest.mark.slow
def test_gpu_check_on_the_checkpoints_train_py_made(tmp_path, corpus_file, quick_run):
    """--trained DIR: the parts run on train.py's target and drafters in DIR (its DBlast drafters at
    their own temperature), part a is skipped saying so, and nothing is trained or written there."""
    before = sorted(os.listdir(quick_run))
    out = tmp_path / 'gc'
    code, stdout, stderr = run_main('gpu_check.py', ['--quick', '--device', 'cpu', '--out', out, '--data', corpus_file,
                                            '--trained', quick_run, '--parts', 'a,e'])
    assert code == 0, stderr[-3000:]
    parts = json.loads((out / 'gpu_check.json').read_text())['parts']
    assert parts['a']['status'] == 'skipped' and str(quick_run) in parts['a']['skipped']
    assert parts['e']['status'] == 'pass' and [r['mode'] for r in parts['e']['rows']] == ['eager', 'compiled']
    assert sorted(os.listdir(quick_run)) == before


def test_gpu_check_names_the_failed_parts(tmp_path, capsys):
    """A part that fails, crashes or runs past its time limit is recorded as failed, the parts after
    it still run, the JSON is written, and the run ends with one line naming the failed parts."""
    def crash(c):
        raise RuntimeError('boom\nsecond line')

    def hang(c):
        while True:
            time.sleep(0.01)
    parts = [('a', 'fine', lambda c: dict(ok=True, rows=[dict(x=1.5)]), 10), ('b', 'crashes', crash, 10),
             ('c', 'fails', lambda c: dict(ok=False), 10), ('e', 'hangs', hang, 0.3),
             ('d', 'skipped', lambda c: dict(skipped='no CUDA'), 10)]
    path = tmp_path / 'gpu_check.json'
    with pytest.raises(SystemExit, match=r'^gpu check: failed parts b, c, e \(see .*gpu_check.json\)$'):
        gpu_check.run_parts(types.SimpleNamespace(device='cpu'), parts, {}, str(path))
    res = json.loads(path.read_text())
    assert {k: p['status'] for k, p in res['parts'].items()} == dict(a='pass', b='fail', c='fail', e='fail',
                                                                     d='skipped')
    assert res['parts']['b']['error'] == 'RuntimeError: boom' and res['failed'] == ['b', 'c', 'e']
    assert res['parts']['e']['error'] == 'PartTimeout: over its time limit of 0.3 s'
    assert res['parts']['e']['seconds'] < 5
    assert len((tmp_path / 'parts.jsonl').read_text().splitlines()) == 5
    assert '| 1.5 |' in capsys.readouterr().out


@pytest.mark.slow
def test_a_killed_gpu_check_keeps_the_parts_it_finished(tmp_path, corpus_file):
    """gpu_check.py --quick killed right after its first part: that part's record is on disk,
    in parts.jsonl and in gpu_check.json. The test waits for the record to appear, not for a time."""
    out = tmp_path / 'gc'
    proc = subprocess.Popen([sys.executable, 'gpu_check.py', '--quick', '--device', 'cpu', '--out', str(out),
                             '--data', str(corpus_file), '--parts', 'a,h'], cwd=ROOT, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lines = out / 'parts.jsonl'
    try:
        deadline = time.monotonic() + 240
        while not (lines.exists() and lines.read_text().endswith('\n')) and proc.poll() is None:
            assert time.monotonic() < deadline, "part a never ended"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    first = json.loads(lines.read_text().splitlines()[0])
    assert first['part'] == 'a' and first['status'] == 'pass'
    assert json.loads((out / 'gpu_check.json').read_text())['parts']['a'] == first


@pytest.mark.parametrize('flags,needles', [
    (['--compile'], ['--compile']),
    (['--parts', 'a,z'], ['--parts']),
    (['--parts', 'a,a'], ['--parts']),
    (['--speed-ks', '1,8'], ['--speed-ks']),
    (['--trained', 'no/such/folder'], ['--trained no/such/folder: no ckpt.pt there'])])
def test_bad_flags_are_one_error_line(tmp_path, flags, needles):
    """Refused before any work: nothing is written."""
    out = tmp_path / 'out'
    code, stdout, stderr = run_main('gpu_check.py', flags + ['--quick', '--device', 'cpu', '--out', out])
    assert_clean_error(Proc(code, stdout, stderr), *needles)
    assert not out.exists()


@pytest.mark.slow
def test_trained_checkpoints_that_cannot_serve_are_one_error_line(tmp_path, corpus_file, quick_run):
    """--trained DIR whose heads.pt is not BPD heads for blocks of 8 (here a DBlast drafter): one
    line before any part runs, not a traceback per part (gpu_check.check_trained)."""
    folder = tmp_path / 'copy'
    shutil.copytree(quick_run, folder)
    shutil.copy(folder / 'dblast_K4.pt', folder / 'heads.pt')
    flags = ['--quick', '--device', 'cpu', '--out', tmp_path / 'gc', '--trained', folder, '--parts', 'd']
    code, stdout, stderr = run_main('gpu_check.py', flags + ['--data', corpus_file])
    assert_clean_error(Proc(code, stdout, stderr), 'heads.pt is not BPD heads for blocks of 8')
