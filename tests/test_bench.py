"""bench.py --quick and --gpu-check on a tiny configuration run end to end and write valid JSON."""
import json

import bench


TINY = ['--device', 'cpu', '--n-layer', '1', '--n-head', '2', '--n-embd', '16', '--block-size', '64',
        '--batch-size', '4', '--max-iters', '20', '--heads-iters', '4', '--dblast-iters', '4',
        '--distill-samples', '4', '--dblast-samples', '4', '--n-prompts', '2', '--max-new', '16']


def test_bench_quick_tiny(tmp_path, corpus_file):
    out = tmp_path / 'bench'
    bench.main(['--quick', '--out', str(out), '--data', str(corpus_file)] + TINY)
    res = json.loads((out / 'results.json').read_text())
    assert res['meta']['torch'] and res['meta']['device'] == 'cpu'
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
    assert len(decoded) == 3 * 3 and all(1 <= r['tau'] <= 4 and r['speedup'] > 0 for r in decoded)
    assert [g['T'] for g in res['dblast_gain']] == bench.TEMPS
    assert [a['K'] for a in res['dblast_K_ablation']] == bench.ABLATION_KS
    assert [z['zt'] for z in res['dblast_zt_sweep']] == bench.ZTS
    curve = res['dblast_curve']
    assert curve['long'][-1][0] == 2 * curve['preset'][-1][0]   # twice the preset's steps
    assert all(r['t_k_over_t_1'] > 0 for r in res['time']['rows'])
    split = res['time']['split_k8']
    assert {'target_forward', 'verify', 'draft', 'cache', 'host_sync'} <= set(split)
    assert split['target_forward'] > 0


def test_bench_gpu_check_tiny(tmp_path, corpus_file):
    """--gpu-check trains only what the speed table needs and fills it: k = 2..10, then sampling."""
    out = tmp_path / 'gpu'
    bench.main(['--gpu-check', '--out', str(out), '--data', str(corpus_file)] + TINY)
    res = json.loads((out / 'results.json').read_text())
    assert set(res) == {'meta', 'method', 'speed'} and res['speed']['mode'] == 'eager'
    rows = res['speed']['rows']
    assert [(r['drafter'], r['k']) for r in rows] == [('BPD heads', k) for k in bench.BPD_KS] + [
        ('independent K=1 NLL', 4), ('DBlast K=4 AL', 4)]
    for r in rows:
        assert r['tok_s'] > 0 and r['plain_tok_s'] > 0 and 1 <= r['tau'] <= r['k']
        assert abs(r['tok_s'] / r['plain_tok_s'] - r['speedup']) < 1e-9 * r['speedup']
    ckpts = sorted(p.name for p in (out / 'ckpt').glob('*.pt'))
    assert ckpts == ['ckpt.pt', 'dblast_K1_T1.0_nll.pt', 'dblast_K4_T1.0_al.pt', 'heads_frozen_distill.pt']
