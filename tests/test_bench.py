"""bench.py on a tiny configuration: --quick runs end to end and writes valid JSON and RESULTS.md;
the speed table at another precision; the profiler's split reads the CPU-side rows; flags that mean
nothing are one error line."""
import json
import math
import types

import pytest
import torch

import bench
import measure
import runner
from conftest import Proc, assert_clean_error, run_main, run_py


TINY = ['--device', 'cpu', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64',
        '--batch-size', '4', '--max-iters', '20', '--heads-iters', '4', '--dblast-iters', '4',
        '--distill-samples', '4', '--dblast-samples', '4', '--n-prompts', '2', '--max-new', '16']


@pytest.mark.slow
def test_bench_quick_tiny(tmp_path, corpus_file):
    out = tmp_path / 'bench'
    code, _, stderr = run_main('bench.py', ['--quick', '--out', out, '--data', corpus_file] + TINY)
    assert code == 0, stderr[-3000:]
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
    assert res['meta']['command'].startswith('python bench.py --quick --out ')
    assert md.startswith('# Results') and 'python bench.py' in md and '### 1. ' in md and '### 4. ' in md
    split = res['time']['split_k8']
    assert {'target_forward', 'verify', 'draft', 'cache', 'host_sync'} <= set(split)
    assert split['target_forward'] > 0


@pytest.mark.slow
def test_calls_table_times_every_way_of_running_the_steps(monkeypatch, capsys):
    """Table 7 on the CPU (traced by dynamo alone: the ways, not inductor's code, are what is tested):
    plain and k = 8 for eager, one step and a unit of steps a host call, each with its time,
    operations and tau per call; the unit's calls are the eager loop's."""
    monkeypatch.setattr(runner, 'BACKEND', 'eager')
    monkeypatch.setattr(bench, 'CALLS_TOKENS', 24)
    monkeypatch.setattr(bench, 'CALLS_FEWER', 8)
    monkeypatch.setattr(bench, 'CALLS_BEST_OF', 1)
    results = {}
    bench.calls_table(types.SimpleNamespace(device='cpu'), None, types.SimpleNamespace(seed=0, repeats=1), results)
    rows = results['calls']['rows']
    assert [(r['way'], r['k']) for r in rows] == [(w, k) for w in measure.ways_of_calling('cpu') for k in (1, 8)]
    assert all(r['us_per_call'] > 0 and r['ops_per_call'] > 0 and 1 <= r['tau'] <= r['k'] for r in rows)
    assert all(math.isfinite(r['us_per_further_call']) for r in rows)   # a difference of two timings
    assert len({(r['k'], r['calls']) for r in rows}) == 2     # every way makes the same calls
    assert '### 7. What a call costs' in capsys.readouterr().out


def test_a_further_call_is_the_difference_of_two_decodes(monkeypatch):
    """measure.call_costs' cost of one more call: (t(long) - t(short)) / (calls(long) - calls(short)),
    from the best of each, with perf_counter faked (each decode takes 1 ms of fixed cost plus 10 us a
    call); a shorter decoding that makes as many calls is refused."""
    clock = [0.0]

    def decoding(calls):
        def decode():
            clock[0] += 1e-3 + calls * 1e-5
            return None, dict(calls=calls, tokens=calls, mean_tau=1.0)
        return decode
    monkeypatch.setattr(measure.time, 'perf_counter', lambda: clock[0])
    r = measure.call_costs(decoding(100), 'cpu', 2, decoding(20))
    assert r['us_per_call'] == pytest.approx(20.0) and r['us_per_further_call'] == pytest.approx(10.0)
    with pytest.raises(ValueError, match='not fewer'):
        measure.call_costs(decoding(20), 'cpu', 1, decoding(20))


@pytest.mark.slow
def test_trees_table_at_tiny_sizes(tmp_path, corpus_file):
    """Table 8 end to end at tiny sizes: for the heads greedy and each drafter at each T, one path,
    several paths and sampled trees (sampling only) and every tree size, each row with its tau, calls, tokens per
    call and the block's cost over one path's; greedy trees are exact (their output is checked by
    tests/test_trees.py), and a tree's tau is measured against its own drafter's one path."""
    out = tmp_path / 'trees'
    code, _, stderr = run_main('bench.py', ['--tables', 'trees', '--repeats', '1', '--paths-temps', '1.5', '--out', out,
                                            '--data', corpus_file] + TINY)
    assert code == 0, stderr[-3000:]
    rows = json.loads((out / 'results.json').read_text())['trees']['rows']
    trees = [f'tree of {n}' for n in bench.TREE_NODES]
    assert [r['block'] for r in rows if r['T'] == 0] == ['1 path'] + trees
    k = rows[-1]['k']
    sampled = [f"sampled {','.join(map(str, w))} ({bench.tree_size(w)})" for w in
               (bench.fitted(widths, k) for widths in bench.SAMPLED_TREES)]
    assert [r['block'] for r in rows if r['drafter'] == 'DBlast K=4'] == ['1 path', '2 paths', '4 paths', '8 paths'] + \
        trees + sampled
    for r in rows:
        assert 1 <= r['tau'] <= r['k'] and r['calls'] > 0 and r['t_block_over_t_path'] > 0 and r['speedup'] > 0
        assert r['tokens_per_call'] == pytest.approx(2 * 16 / r['calls'])


@pytest.mark.slow
def test_profiling_on_a_cpu_writes_nothing_between_the_tables():
    """On a CPU, measure's profiling (call_costs, time_split) adds no line of the profiler's own
    to stderr, where its backend wrote profiler_start / profiler_stop at each use, between the rows
    of bench's printed tables; what the user set in KINETO_LOG_LEVEL is kept."""
    code = ("import torch, measure\n"
            "for _ in range(2):\n"
            "    with measure.profiled('cpu') as p:\n"
            "        torch.ones(3) + 1\n"
            "    assert any(e.name == 'aten::add' for e in p.events())\n"
            "print('profiled')")
    proc = run_py(['-c', code])
    assert proc.returncode == 0 and proc.stdout == 'profiled\n' and proc.stderr == '', proc.stderr
    kept = run_py(['-c', "import os, measure; os.environ['KINETO_LOG_LEVEL'] = '2'; measure.profiled('cpu'); "
                         "print(os.environ['KINETO_LOG_LEVEL'])"])
    assert kept.stdout == '2\n', kept.stderr


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
        assert measure.step_times(order, cuda=True) == {'verify': 7, 'host_sync': 5}
        assert measure.step_times(order, cuda=False) == {'verify': 10, 'host_sync': 5}


@pytest.mark.slow
def test_speed_table_in_bfloat16_on_cpu(tmp_path, corpus_file):
    out = tmp_path / 'bf16'
    code, stdout, stderr = run_main('bench.py', ['--tables', 'speed', '--dtype', 'bfloat16', '--repeats', '1',
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
    (['--gpu-check'], ['python gpu_check.py']),
    (['--dtype', 'float16'], ['--dtype']),
    (['--parts', 'a'], ['--parts']),
    (['--speed-ks', '1,8'], ['--speed-ks'])])
def test_flags_that_mean_nothing_are_one_error_line(tmp_path, flags, needles):
    """Refused before any work: nothing is written."""
    out = tmp_path / 'out'
    code, stdout, stderr = run_main('bench.py', flags + ['--device', 'cpu', '--out', out])
    assert_clean_error(Proc(code, stdout, stderr), *needles)
    assert not out.exists()


@pytest.mark.slow
def test_paths_table_at_tiny_sizes(tmp_path, corpus_file):
    """Table 5 end to end at tiny sizes: every way of drawing paths runs (one path per DBlast branch
    is verified against its own branch, as generate.py sets it), and the drafter is left as it was."""
    out = tmp_path / 'paths'
    code, _, stderr = run_main('bench.py', ['--tables', 'paths', '--repeats', '1', '--paths-temps', '1.5',
                                            '--paths-list', '1,2', '--out', out, '--data', corpus_file] + TINY)
    assert code == 0, stderr[-3000:]
    rows = json.loads((out / 'results.json').read_text())['paths']['rows']
    assert [(r['drafter'], r['paths']) for r in rows] == [('independent K=1', 1), ('independent K=1', 2),
                                                         ('DBlast K=4, i.i.d.', 1), ('DBlast K=4, i.i.d.', 2),
                                                         ('DBlast K=4, per branch', 2)]


@pytest.mark.slow
def test_drafters_table_at_tiny_sizes(tmp_path, corpus_file):
    """Table 9 end to end at tiny sizes: every drafter greedy and at T = 1.0, the draft model's and
    the lookup's trees among them, each with its tau and tokens per call; our greedy rows are the target's own tokens
    (Hugging Face's rows, where transformers is installed, say how many of theirs are)."""
    out = tmp_path / 'drafters'
    code, _, stderr = run_main('bench.py', ['--tables', 'drafters', '--repeats', '1', '--out', out,
                                            '--data', corpus_file] + TINY)
    assert code == 0, stderr[-3000:]
    rows = json.loads((out / 'results.json').read_text())['drafters']['rows']
    ours = ['draft model', f'draft model, a tree of {bench.TREE_OF}', 'prompt lookup',
            f'prompt lookup, a tree of {bench.TREE_OF}', 'BPD heads', 'BPD heads + lookup']
    assert [r['drafter'] for r in rows if r['T'] == 0 and not r['drafter'].startswith('Hugging Face')] == ours
    for r in rows:
        assert r['tokens_per_call'] == pytest.approx(2 * 16 / r['calls']) and r['tok_s'] > 0
        assert r['tau'] is None or 1 <= r['tau'] <= r['k']
        hf = r['drafter'].startswith('Hugging Face')
        assert r['same'] == '-' if r['T'] else (0 <= r['same'] <= 1 if hf else r['same'] == 1.0)


def test_an_interrupted_training_says_what_bench_does_next(monkeypatch, tmp_path):
    """Ctrl-C (or a handout's exercise not written yet) inside one of bench's trainings: train.py's
    line would tell to add --resume, which bench.py lacks (it passes it itself, train.main's
    says_resume=False): the line says to run the same command again."""
    out = str(tmp_path / 'ck')
    args = types.SimpleNamespace(tables=['speed'], ckpt_dir=out)
    monkeypatch.setattr(bench, 'trainings', lambda args: [('ckpt', ['--out-dir', out, '--device', 'cpu', '--resume'])])
    for error, want in ((KeyboardInterrupt(), f"interrupted: every checkpoint in {out}/ is as of its last save; "
                                              f"continue with the same command"),
                        (NotImplementedError("exercise 3: write"), f"exercise 3: write; every checkpoint in {out}/ is "
                                                                   f"as of its last save: write it, then the same "
                                                                   f"command continues")):
        def run(args, error=error):
            raise error
        monkeypatch.setattr(bench.train, 'run', run)
        with pytest.raises(type(error)) as raised:
            bench.ensure_checkpoints(args)
        assert str(raised.value) == want
