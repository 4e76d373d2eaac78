"""
The papers' findings at small scale, measured on this machine.

    python bench.py            # CPU-sized default (about half an hour on 2 cores)
    python bench.py --quick    # a few minutes: smaller models, fewer prompts and repeats
    python bench.py --full --device cuda   # the one-GPU sweep
    python bench.py --gpu-check --device cuda --compile   # minutes: the speed table only

Trains what it needs when checkpoints are missing (through train.py, under --ckpt-dir), then:
  0. speed at a glance (--tables speed): tokens/s, tau and speedup, greedy k = 2..10 and sampling
  1. BPD table (paper Table 1, p.9): k x {frozen, joint} x {corpus, distilled}
  2. lossy acceptance (BPD §5): top-N and minimum-block
  3. DBlast table: T x drafter, the K ablation and the Z_T sweep
  4. where a step's time goes (BPD §6.3), t(k-token forward) / t(1-token forward), ceiling speedup
Prints markdown tables, writes bench/results.json and (with matplotlib) bench/*.png.

Method: the same held-out prompts for every row, decoded one request at a time by default (--batch
1, the papers' latency setting; a batch advances at the pace of its slowest row); a warm-up run
excluded (with --compile, it compiles the graphs); the median of --repeats timed runs, prefill
included; tau counts the bonus token; speedup is against plain decoding of the same target and
prompts (compiled too under --compile), timed interleaved with it (round after round) so that load
on a shared machine hits both alike.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import train
from decode import generate, load_drafter, pick_device
from model import BadInput, load_target, run_script

BPD_KS = [2, 4, 6, 8, 10]
TEMPS = [0.7, 1.0, 1.5]


# ----------------------------------------------------------------------------- measuring

def sync(device):
    if str(device).startswith('cuda'):
        torch.cuda.synchronize()


def timed(fns, repeats, device):
    """Median wall-clock seconds of each fn over `repeats` rounds, after one warm-up round.
    The fns run interleaved, round after round, so a busy spell on a shared machine hits them
    alike and their ratio stays fair. Returns (medians, each fn's last result)."""
    results = [fn() for fn in fns]
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            results[i] = fn()
            sync(device)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times], results


class Bench:
    def __init__(self, args, device, prompts, val):
        self.args, self.device, self.prompts, self.val = args, device, prompts, val
        self.plain_runs = {}   # (target id, temperature) -> plain decoding's (out, stats)

    def decode_all(self, model, drafter=None, k=None, temperature=0.0, accept='exact'):
        """Every prompt, --batch rows per generate() call (default 1: per-request latency, as the
        papers measure). Returns outputs and the calls' stats merged."""
        g = torch.Generator(device=self.device).manual_seed(0)
        outs, calls, taus, acc = [], 0, [], 0.0
        for chunk in self.prompts.split(self.args.batch):
            out, s = generate(model, chunk, self.args.max_new, drafter=drafter, k=k, temperature=temperature,
                              accept=accept, generator=g, compile=self.args.compile)
            outs.append(out)
            calls += s['calls']
            taus += s['accept_lengths']
            acc = acc + np.asarray(s['accept_rate']) * len(s['accept_lengths'])  # weight by steps
        return torch.cat(outs), dict(calls=calls, accept_lengths=taus,
                                     accept_rate=(np.atleast_1d(acc) / len(taus)).tolist())

    def plain(self, model, temperature):
        """Plain decoding's output and stats (the reference each row is compared with)."""
        key = (id(model), temperature)
        if key not in self.plain_runs:
            self.plain_runs[key] = self.decode_all(model, temperature=temperature)
        return self.plain_runs[key]

    def row(self, model, drafter, k, temperature=0.0, accept='exact', zt=None):
        """tau, acceptance per position, calls and speedup over plain decoding, timed together."""
        if zt is not None:
            drafter.zt = zt
        (dt, dt0), ((out, stats), (base_out, base_stats)) = timed(
            [lambda: self.decode_all(model, drafter, k, temperature, accept),
             lambda: self.decode_all(model, temperature=temperature)], self.args.repeats, self.device)
        taus = stats['accept_lengths']
        return dict(k=k, tau=float(np.mean(taus)), accept_rate=[round(a, 4) for a in stats['accept_rate']],
                    calls=stats['calls'], plain_calls=base_stats['calls'], seconds=dt, plain_seconds=dt0,
                    speedup=dt0 / dt), out, base_out


@torch.no_grad()
def output_nll(model, out, T0):
    """Mean NLL (nats/token) the model gives the generated part of `out`."""
    logits, _ = model(out[:, :-1])
    lp = F.log_softmax(logits.float(), -1).gather(-1, out[:, 1:, None]).squeeze(-1)
    return float(-lp[:, T0 - 1:].mean())


@torch.no_grad()
def forward_ratio(model, k, device, B, ctx=96, repeats=200):
    """t(k-token cached forward) / t(1-token cached forward), B rows at a context of ctx tokens
    (about the middle of a bench decode)."""
    cache = model.new_cache(B, ctx + k)
    cache.lengths.fill_(ctx)

    blocks = [torch.zeros(B, n, dtype=torch.long, device=device) for n in (1, k)]
    (t1, tk), _ = timed([lambda: model.forward_cached(blocks[0], cache),
                         lambda: model.forward_cached(blocks[1], cache)], repeats, device)
    return tk / t1


def time_split(run, device):
    """Share of run()'s time in each named region of the step (decode.span), by the profiler."""
    from torch.profiler import ProfilerActivity, profile
    cuda = str(device).startswith('cuda')
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    run()  # warm-up
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run()
        sync(device)
        total = (time.perf_counter() - t0) * 1e6
    split = {}
    for ev in prof.key_averages():
        if ev.key.startswith('step.'):
            us = ev.device_time_total if cuda and ev.key != 'step.host_sync' else ev.cpu_time_total
            split[ev.key[5:]] = us / total
    split['other (python, prefill)'] = max(0.0, 1 - sum(split.values()))
    return split


# ----------------------------------------------------------------------------- checkpoints

def train_args(args, *extra):
    """train.py argv for the bench's sizes."""
    a = ['--out-dir', args.ckpt_dir, '--resume', '--no-demo', '--seed', str(args.seed)]
    if args.device:
        a += ['--device', args.device]
    if args.data:
        a += ['--data', args.data]
    for flag in ('n_layer', 'n_head', 'n_embd', 'block_size', 'max_iters', 'heads_iters', 'dblast_iters',
                 'distill_samples', 'dblast_samples', 'batch_size'):
        v = getattr(args, flag)
        if v is not None:
            a += ['--' + flag.replace('_', '-'), str(v)]
    return a + list(extra)


def ensure_checkpoints(args):
    """Train the target and every drafter the chosen tables need (skipped when already there)."""
    train.main(train_args(args, '--stages', 'base'))
    heads = [(False, True)] if 'bpd' not in args.tables else [(j, d) for j in (False, True) for d in (False, True)]
    for joint, distill in heads:
        train.main(train_args(args, '--stages', 'heads', '--k', str(max(BPD_KS)),
                              '--joint' if joint else '--frozen', '--distill' if distill else '--no-distill',
                              '--tag', heads_tag(joint, distill)))
    dblast = [(T, loss, K) for T in TEMPS for loss in ('nll', 'al')
              for K in ([4] if T != 1.0 or loss != 'al' else [2, 4, 8])] if 'dblast' in args.tables else []
    if 'speed' in args.tables:
        dblast.append((1.0, 'al', 4))
    for T, loss, K in dblast:  # each call trains K and the K = 1 baseline (skipped once trained)
        train.main(train_args(args, '--stages', 'dblast', '--K', str(K), '--temperature', str(T),
                              '--dblast-loss', loss, '--dblast-k', str(args.dblast_k), '--tag', dblast_tag(T, loss)))


def heads_tag(joint, distill):
    return f"_{'joint' if joint else 'frozen'}_{'distill' if distill else 'corpus'}"


def dblast_tag(T, loss):
    return f'_T{T}_{loss}'


# ----------------------------------------------------------------------------- tables

def md_row(cells):
    return '| ' + ' | '.join(str(c) for c in cells) + ' |'


def md_table(headers, rows):
    return '\n'.join([md_row(headers), '|' + '---|' * len(headers)] + [md_row(r) for r in rows])


def speed_table(b, base, args, results):
    """The figures at a glance, one row printed as soon as it is measured: tokens/s of plain and
    blockwise decoding, greedy with the frozen distilled heads at k = 2..10, then sampling at T=1
    with the DBlast drafters (AL loss, K = 1 and K = 4)."""
    heads = load_drafter(os.path.join(args.ckpt_dir, f"heads{heads_tag(False, True)}.pt"), base)
    dblast = lambda K: load_drafter(os.path.join(args.ckpt_dir, f"dblast_K{K}{dblast_tag(1.0, 'al')}.pt"), base)
    configs = [('BPD heads', heads, k, 0.0) for k in BPD_KS]
    configs += [(f'DBlast K={K} AL', dblast(K), args.dblast_k, 1.0) for K in (1, 4)]
    n_tokens = args.n_prompts * args.max_new
    mode = 'compiled' if args.compile else 'eager'
    print(f"\n### 0. Speed ({mode}, {args.n_prompts} prompts x {args.max_new} tokens, batch {args.batch})\n")
    print(md_table(['drafter', 'T', 'k', 'plain tok/s', 'blockwise tok/s', 'tau', 'calls', 'speedup'], []), flush=True)
    rows = []
    for name, drafter, k, T in configs:
        r, _, _ = b.row(base, drafter, k, temperature=T)
        r.update(drafter=name, T=T, plain_tok_s=n_tokens / r['plain_seconds'], tok_s=n_tokens / r['seconds'])
        rows.append(r)
        print(md_row([name, T, k, f"{r['plain_tok_s']:.0f}", f"{r['tok_s']:.0f}", f"{r['tau']:.2f}", r['calls'],
                      f"{r['speedup']:.2f}x"]), flush=True)
    results['speed'] = dict(mode=mode, rows=rows)


def bpd_tables(b, base, args, results):
    ck = args.ckpt_dir
    rows, table = [], []
    val_loss0 = train.heldout_loss(base, b.val, 8, 8)
    for joint in (False, True):
        for distill in (False, True):
            tag = heads_tag(joint, distill)
            target = load_target(os.path.join(ck, f'ckpt_joint{tag}.pt'), b.device) if joint else base
            heads = load_drafter(os.path.join(ck, f'heads{tag}.pt'), target)
            drift = train.heldout_loss(target, b.val, 8, 8) - val_loss0
            for k in BPD_KS:
                r, out, plain_out = b.row(target, heads, k)
                ref = b.plain(base, 0.0)[0]     # the original model's greedy output
                gen_part = slice(b.prompts.size(1), None)
                r.update(variant=('joint' if joint else 'frozen'), data=('distilled' if distill else 'corpus'),
                         identical_to_greedy=float((out == plain_out).all(-1).float().mean()),
                         agreement_with_original=float((out[:, gen_part] == ref[:, gen_part]).float().mean()),
                         heldout_loss_change=drift)
                rows.append(r)
                table.append([r['variant'], r['data'], k, f"{r['tau']:.2f}",
                              ' '.join(f'{a:.2f}' for a in r['accept_rate']),
                              f"{r['identical_to_greedy']:.2f}", f"{r['agreement_with_original']:.2f}",
                              f"{r['heldout_loss_change']:+.3f}", r['calls'], f"{r['speedup']:.2f}x"])
    results['bpd'] = rows
    print('\n### 1. Blockwise parallel decoding (greedy, exact acceptance)\n')
    print(md_table(['target', 'heads data', 'k', 'tau', 'acceptance per position', 'identical to its greedy',
                    'agreement with original greedy', 'held-out loss change', 'calls', 'speedup'], table))


def lossy_table(b, base, args, results):
    heads = load_drafter(os.path.join(args.ckpt_dir, f"heads{heads_tag(False, True)}.pt"), base)
    k = 8
    ref = b.plain(base, 0.0)[0]
    T0 = b.prompts.size(1)
    rows, table = [], []
    for accept in ['exact', 'topk:2', 'topk:3', 'topk:5', 'minblock:2', 'minblock:3']:
        r, out, _ = b.row(base, heads, k, accept=accept)
        r.update(accept=accept, agreement_with_greedy=float((out[:, T0:] == ref[:, T0:]).float().mean()),
                 output_nll=output_nll(base, out, T0))
        rows.append(r)
        table.append([accept, f"{r['tau']:.2f}", f"{r['agreement_with_greedy']:.3f}", f"{r['output_nll']:.3f}",
                      f"{r['speedup']:.2f}x"])
    results['lossy'] = dict(k=k, greedy_output_nll=output_nll(base, ref, T0), rows=rows)
    print(f"\n### 2. Lossy acceptance (frozen distilled heads, k={k}); "
          f"greedy output NLL {results['lossy']['greedy_output_nll']:.3f}\n")
    print(md_table(['accept', 'tau', 'agreement with greedy', 'output NLL (original model)', 'speedup'], table))


def dblast_tables(b, base, args, results):
    ck, kd = args.ckpt_dir, args.dblast_k
    bpd = load_drafter(os.path.join(ck, f"heads{heads_tag(False, True)}.pt"), base)
    drafter = lambda T, loss, K: load_drafter(os.path.join(ck, f'dblast_K{K}{dblast_tag(T, loss)}.pt'), base)
    rows, table = [], []
    for T in TEMPS:
        line = [T]
        for name, d in [('BPD heads', bpd), ('K=1 NLL', drafter(T, 'nll', 1)), ('K=1 AL', drafter(T, 'al', 1)),
                        ('K=4 NLL', drafter(T, 'nll', 4)), ('K=4 AL', drafter(T, 'al', 4))]:
            r, _, _ = b.row(base, d, kd, temperature=T)
            r.update(T=T, drafter=name)
            rows.append(r)
            line.append(f"{r['tau']:.2f} ({r['speedup']:.2f}x)")
        table.append(line)
    results['dblast'] = rows
    print(f"\n### 3. Speculative sampling, k={kd}: tau (speedup over plain sampling)\n")
    print(md_table(['T', 'BPD heads', 'K=1 NLL', 'K=1 AL', 'K=4 NLL', 'K=4 AL'], table))

    abl = []
    for K in (1, 2, 4, 8):
        r, _, _ = b.row(base, drafter(1.0, 'al', K), kd, temperature=1.0)
        abl.append(dict(K=K, tau=r['tau'], speedup=r['speedup']))
    zts = []
    for zt in (0.0, 0.5, 1.0, 2.0):
        r, _, _ = b.row(base, drafter(1.0, 'al', 4), kd, temperature=1.0, zt=zt)
        zts.append(dict(zt=zt, tau=r['tau'], speedup=r['speedup']))
    results['dblast_K_ablation'], results['dblast_zt_sweep'] = abl, zts
    print("\nK ablation (AL loss, T=1.0): " + ', '.join(f"K={a['K']}: {a['tau']:.2f}" for a in abl))
    print("Z_T sweep (K=4 AL, T=1.0): " + ', '.join(f"Z_T={z['zt']}: {z['tau']:.2f}" for z in zts))


def time_table(b, base, args, results):
    heads = load_drafter(os.path.join(args.ckpt_dir, f"heads{heads_tag(False, True)}.pt"), base)
    by_k = {r['k']: r for r in results['bpd'] if r['variant'] == 'frozen' and r['data'] == 'distilled'}
    rows, table = [], []
    for k in BPD_KS:
        ratio = forward_ratio(base, k, b.device, args.batch)
        r = by_k[k]
        ceiling = r['tau'] / ratio
        rows.append(dict(k=k, t_k_over_t_1=ratio, tau=r['tau'], ceiling_speedup=ceiling, speedup=r['speedup']))
        table.append([k, f'{ratio:.2f}', f"{r['tau']:.2f}", f'{ceiling:.2f}x', f"{r['speedup']:.2f}x"])
    # the profiler's named regions do not exist inside a compiled step: split the eager one
    split = None if args.compile else time_split(lambda: b.decode_all(base, heads, 8), b.device)
    results['time'] = dict(rows=rows, split_k8=split)
    print("\n### 4. Where the time goes (frozen distilled heads; t(k)/t(1) of the eager forward)\n")
    print(md_table(['k', 't(k)/t(1)', 'tau', 'ceiling tau*t(1)/t(k)', 'measured speedup'], table))
    if split:
        print("\nshare of decode time at k=8: " + ', '.join(f'{n} {v:.0%}' for n, v in split.items()))


def plots(results, out_dir):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots)")
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for (v, d) in [('frozen', 'corpus'), ('frozen', 'distilled'), ('joint', 'corpus'), ('joint', 'distilled')]:
        rs = [r for r in results['bpd'] if r['variant'] == v and r['data'] == d]
        ax[0].plot([r['k'] for r in rs], [r['tau'] for r in rs], 'o-', label=f'{v}, {d}')
    ax[0].plot(BPD_KS, [1.88, 3.27, 4.18, 4.69, 4.95], 'k--', label='paper (joint+distill, WMT)')
    ax[0].set(xlabel='k', ylabel='mean tau', title='tau vs k')
    ax[0].legend(fontsize=7)
    t = results['time']['rows']
    ax[1].plot([r['k'] for r in t], [r['speedup'] for r in t], 'o-', label='measured')
    ax[1].plot([r['k'] for r in t], [r['ceiling_speedup'] for r in t], 's--', label='ceiling tau*t(1)/t(k)')
    ax[1].set(xlabel='k', ylabel='speedup over greedy', title='speedup vs k (frozen, distilled)')
    ax[1].legend(fontsize=7)
    names = sorted({r['drafter'] for r in results['dblast']}, key=[r['drafter'] for r in results['dblast']].index)
    for n in names:
        rs = [r for r in results['dblast'] if r['drafter'] == n]
        ax[2].plot([r['T'] for r in rs], [r['tau'] for r in rs], 'o-', label=n)
    ax[2].set(xlabel='temperature', ylabel='mean tau', title='sampling: tau vs T')
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, 'bench.png')
    fig.savefig(path, dpi=100)
    print(f"plot -> {path}")


# ----------------------------------------------------------------------------- main

TABLES = ['speed', 'bpd', 'lossy', 'dblast', 'time']
QUICK = dict(n_layer=2, n_head=2, n_embd=64, block_size=160, max_iters=300, heads_iters=150,
             dblast_iters=100, distill_samples=64, dblast_samples=64, n_prompts=4, max_new=64, repeats=1)
DEFAULT = dict(n_prompts=16, max_new=128, repeats=3)
FULL = dict(n_prompts=32, max_new=256, repeats=5)
# a few minutes on one GPU: the GPU preset's model, trained briefly, and the speed table only
GPU_CHECK = dict(max_iters=600, heads_iters=300, dblast_iters=300, distill_samples=512, dblast_samples=512,
                 n_prompts=8, max_new=192, repeats=2, tables='speed')


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument('--quick', action='store_true', help='a few minutes: small models, few prompts')
    size.add_argument('--full', action='store_true', help='the one-GPU sweep (GPU preset, more prompts)')
    size.add_argument('--gpu-check', action='store_true',
                      help='a few minutes on one GPU: the GPU preset trained briefly, the speed table only')
    ap.add_argument('--tables', default=None,
                    help=f"comma-separated, from {','.join(TABLES)} (default: all but speed; --gpu-check: speed)")
    ap.add_argument('--compile', action='store_true',
                    help='decode with the compiled step (CUDA graphs on GPU); compiling happens in the warm-up round')
    ap.add_argument('--device', default=None)
    ap.add_argument('--data', default=None, help='corpus (default: the stdlib .py files)')
    ap.add_argument('--out', default='bench', help='folder for results.json and plots')
    ap.add_argument('--ckpt-dir', default=None, help='checkpoints (default: OUT/ckpt)')
    ap.add_argument('--seed', type=int, default=1337)
    ap.add_argument('--dblast-k', type=int, default=4)
    ap.add_argument('--batch', type=int, default=1,
                    help='prompts per generate() call (1: per-request latency, as in the papers)')
    for name in ('n_prompts', 'max_new', 'repeats', 'n_layer', 'n_head', 'n_embd', 'block_size', 'batch_size',
                 'max_iters', 'heads_iters', 'dblast_iters', 'distill_samples', 'dblast_samples'):
        ap.add_argument('--' + name.replace('_', '-'), type=int, default=None)
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL if args.full else GPU_CHECK if args.gpu_check else DEFAULT
    for key, v in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, v)
    args.tables = parse_tables(args.tables or 'bpd,lossy,dblast,time')
    args.ckpt_dir = args.ckpt_dir or os.path.join(args.out, 'ckpt')
    device = pick_device(args.device)
    if args.full and device != 'cuda':
        print("note: --full is sized for one GPU; on this device it will take long", file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    ensure_checkpoints(args)
    base = load_target(os.path.join(args.ckpt_dir, 'ckpt.pt'), device)
    _, val = train.load_corpus(args.data, args.ckpt_dir)
    prompts = train.heldout_prompts(val, args.n_prompts, train.PROMPT_LEN).to(device)
    if prompts.size(1) + args.max_new > base.config.block_size:
        raise BadInput(f"--max-new {args.max_new} + prompt {prompts.size(1)} exceeds the context "
                       f"{base.config.block_size}")
    b = Bench(args, device, prompts, val)
    torch.manual_seed(args.seed)
    results = dict(meta=meta(args, device), method=__doc__.split('Method: ')[1].strip())
    for name, table in [('speed', speed_table), ('bpd', bpd_tables), ('lossy', lossy_table),
                        ('dblast', dblast_tables), ('time', time_table)]:
        if name in args.tables:
            table(b, base, args, results)
    results['meta']['seconds'] = time.perf_counter() - t_start
    path = os.path.join(args.out, 'results.json')
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)
    print(f"\nresults -> {path} ({results['meta']['seconds']:.0f}s)")
    if {'bpd', 'dblast', 'time'} <= set(args.tables):
        plots(results, args.out)


def parse_tables(text):
    tables = text.split(',')
    bad = [t for t in tables if t not in TABLES]
    if bad:
        raise BadInput(f"--tables: unknown {','.join(bad)}; choose from {','.join(TABLES)}")
    if 'time' in tables and 'bpd' not in tables:
        raise BadInput("--tables: 'time' reads the BPD rows, so it needs 'bpd' too")
    return tables


def meta(args, device):
    try:
        commit = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ''
    dev = torch.cuda.get_device_name() if device == 'cuda' else platform.processor() or platform.machine()
    return dict(command='python bench.py ' + ' '.join(sys.argv[1:]), machine=platform.platform(), device=device,
                device_name=dev, cpu_count=os.cpu_count(), torch=torch.__version__, git_commit=commit,
                threads=torch.get_num_threads(), args=vars(args))


if __name__ == '__main__':
    run_script(main)
