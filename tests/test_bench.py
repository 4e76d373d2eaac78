"""bench.py on a tiny configuration: --quick and --gpu-check --quick run end to end and write valid
JSON; the speed table at another precision; the profiler's split reads the CPU-side rows; flags that
mean nothing are one error line."""
import json
import subprocess
import sys
import time
import types

import pytest
import torch

import bench
from conftest import ROOT, Proc, assert_clean_error, cli, env


TINY = ['--device', 'cpu', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64',
        '--batch-size', '4', '--max-iters', '20', '--heads-iters', '4', '--dblast-iters', '4',
        '--distill-samples', '4', '--dblast-samples', '4', '--n-prompts', '2', '--max-new', '16']


def test_bench_quick_tiny(tmp_path, corpus_file):
    out = tmp_path / 'bench'
    bench.main(['--quick', '--out', str(out), '--data', str(corpus_file)] + TINY)
    res = json.loads((out / 'results.json').read_text())
    assert res['meta']['torch'] and res['meta']['device'] == 'cpu' and res['meta']['precision'] == 'float32'
    bpd = res['bpd']
    assert len(bpd) == 5 * 4 and {r['k'] for r in bpd} == set(bench.BPD_KS)
    for r in bpd:
        assert 1 <= r['tau'] <= r['k'] and r['speedup'] > 0 and len(r['accept_rate']) == r['k'] - 1
        assert r['identical_to_greedy'] == 1.0   # exact acceptance = its target's greedy, always
    assert [r['accept'] for r in res['lossy']['rows']][0] == 'exact'
    # table 3: at each T, heads / K=1 NLL / K=1 AL two ways, K=4 NLL / AL four ways; the
    # branch-conditional AL form four ways at T_ABLATION
    assert len(res['dblast']) == 3 * (3 * 2 + 2 * 4) + 4
    assert all(1 <= r['expected_tau'] <= 4 for r in res['dblast'])
    decoded = res['dblast_decoded']
    assert len(decoded) == 3 * 4 and all(1 <= r['tau'] <= 4 and r['speedup'] > 0 for r in decoded)
    assert [g['T'] for g in res['dblast_gain']] == bench.TEMPS
    assert [a['K'] for a in res['dblast_K_ablation']] == bench.ABLATION_KS
    assert [z['zt'] for z in res['dblast_zt_sweep']] == bench.ZTS
    curve = res['dblast_curve']
    assert curve['long'][-1][0] == 2 * curve['preset'][-1][0]   # twice the preset's steps
    assert all(r['t_k_over_t_1'] > 0 for r in res['time']['rows'])
    md = (out / 'RESULTS.md').read_text()   # the tables as printed, under the commit and command
    assert md.startswith('# Results') and 'python bench.py' in md and '### 1. ' in md and '### 4. ' in md
    split = res['time']['split_k8']
    assert {'target_forward', 'verify', 'draft', 'cache', 'host_sync'} <= set(split)
    assert split['target_forward'] > 0


def test_gpu_check_quick_on_cpu(tmp_path, corpus_file):
    """--gpu-check --quick: every part runs (those that need CUDA, and compiled training, are
    skipped with the reason), passes, is printed and lands in gpu_check.json."""
    out, compiled_before = tmp_path / 'gc', dict(bench.decode._COMPILED)
    code, stdout, stderr = cli('bench.py', ['--gpu-check', '--quick', '--device', 'cpu', '--out', out,
                                            '--data', corpus_file, '--parts', 'a,h,c,d,e,f,g,i,b'])
    assert code == 0, stderr[-3000:]
    res = json.loads((out / 'gpu_check.json').read_text())
    parts = res['parts']
    assert {k: p['status'] for k, p in parts.items()} == dict(a='pass', h='pass', c='pass', d='pass', e='pass',
                                                              f='skipped', g='skipped', i='pass', b='skipped')
    assert list(parts) == list('ahcdefgib')   # the speed figures early, as --parts orders them
    assert res['failed'] == [] and 'aot_eager' in res['compiled_decoding']
    # every part's record, a line of parts.jsonl the moment it ended, names what it ran on
    lines = [json.loads(x) for x in (out / 'parts.jsonl').read_text().splitlines()]
    assert [r['part'] for r in lines] == list('ahcdefgib') and lines == list(parts.values())
    assert [(r['config'], r['mode']) for r in parts['i']['rows']] == [(bench.PLAIN, 'eager'), (bench.HEADS, 'eager'),
                                                                       (bench.PLAIN, 'compiled'), (bench.HEADS, 'compiled')]
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
    assert [r['config'] for r in parts['c']['rows']] == [bench.PLAIN, bench.HEADS, bench.SAMPLED]
    assert all(r['warmup_graphs'] == 0 and r['new_graphs'] == 0 for r in parts['c']['rows'])
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
    assert bench.decode._COMPILED == compiled_before   # the aot_eager step was this run's only


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
        bench.run_parts(types.SimpleNamespace(device='cpu'), parts, {}, str(path))
    res = json.loads(path.read_text())
    assert {k: p['status'] for k, p in res['parts'].items()} == dict(a='pass', b='fail', c='fail', e='fail',
                                                                     d='skipped')
    assert res['parts']['b']['error'] == 'RuntimeError: boom' and res['failed'] == ['b', 'c', 'e']
    assert res['parts']['e']['error'] == 'PartTimeout: over its time limit of 0.3 s'
    assert res['parts']['e']['seconds'] < 5
    assert len((tmp_path / 'parts.jsonl').read_text().splitlines()) == 5
    assert '| 1.5 |' in capsys.readouterr().out


def test_a_killed_gpu_check_keeps_the_parts_it_finished(tmp_path, corpus_file):
    """bench.py --gpu-check --quick killed right after its first part: that part's record is on disk,
    in parts.jsonl and in gpu_check.json. The test waits for the record to appear, not for a time."""
    out = tmp_path / 'gc'
    proc = subprocess.Popen([sys.executable, 'bench.py', '--gpu-check', '--quick', '--device', 'cpu', '--out', str(out),
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


def test_step_times_reads_the_cpu_side_rows():
    """On CUDA key_averages() holds a 'step.*' region twice (the CPU-side range, a GPU-side
    annotation); whichever comes last, the CPU-side row is read: its device time on CUDA (the
    host sync: its CPU time), its CPU time on a CPU."""
    CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def row(key, device_type, cpu, dev):
        return types.SimpleNamespace(key=key, device_type=device_type, cpu_time_total=cpu, device_time_total=dev)
    events = [row('step.verify', CPU, 10, 7), row('step.verify', CUDA, 1, 99), row('step.host_sync', CPU, 5, 0),
              row('step.host_sync', CUDA, 2, 3), row('aten::mm', CPU, 50, 40)]
    for order in (events, events[::-1]):
        assert bench.step_times(order, cuda=True) == {'verify': 7, 'host_sync': 5}
        assert bench.step_times(order, cuda=False) == {'verify': 10, 'host_sync': 5}


def test_speed_table_in_bfloat16_on_cpu(tmp_path, corpus_file):
    out = tmp_path / 'bf16'
    code, stdout, stderr = cli('bench.py', ['--tables', 'speed', '--dtype', 'bfloat16', '--repeats', '1',
                                            '--out', out, '--data', corpus_file] + TINY)
    assert code == 0, stderr[-3000:]
    res = json.loads((out / 'results.json').read_text())
    assert res['meta']['precision'] == res['speed']['precision'] == 'bfloat16 autocast'
    assert '### 0. Speed (eager, bfloat16 autocast, 2 prompts x 16 tokens' in stdout
    for r in res['speed']['rows']:
        assert (r['T'] == 0) == (r['identical_tokens'] is not None)
        assert r['identical_tokens'] is None or 0 <= r['identical_tokens'] <= 1


@pytest.mark.parametrize('flags,needles', [
    (['--tf32'], ['--tf32 means nothing here', 'float32 on a CUDA device']),
    (['--gpu-check', '--compile'], ['--compile means nothing with --gpu-check']),
    (['--gpu-check', '--dtype', 'bfloat16'], ['--dtype means nothing with --gpu-check']),
    (['--gpu-check', '--full'], ['--full means nothing with --gpu-check']),
    (['--dtype', 'float16'], ['--dtype']),
    (['--gpu-check', '--parts', 'a,z'], ['--parts']),
    (['--gpu-check', '--parts', 'a,a'], ['--parts']),
    (['--parts', 'a'], ['--parts means nothing here']),
    (['--speed-ks', '1,8'], ['--speed-ks'])])
def test_flags_that_mean_nothing_are_one_error_line(tmp_path, flags, needles):
    """Refused before any work: nothing is written."""
    out = tmp_path / 'out'
    code, stdout, stderr = cli('bench.py', flags + ['--device', 'cpu', '--out', out])
    assert_clean_error(Proc(code, stdout, stderr), *needles)
    assert not out.exists()
