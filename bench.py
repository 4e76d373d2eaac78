"""
The papers' findings at small scale, measured on this machine.

    python bench.py            # the CPU-sized default, tables 1-4 (19 minutes at 27b4347 on 2 cores)
    python bench.py --quick    # a few minutes: smaller models, fewer prompts and repeats
    python bench.py --full --device cuda              # the one-GPU sweep
    python bench.py --tables speed --compile --out bench/speed --ckpt-dir bench/ckpt   # any tables, anywhere

Trains what it needs when checkpoints are missing (through train.py, under --ckpt-dir), then:
  0. speed at a glance (speed): tokens/s, tau and speedup, greedy k = 2..10 and sampling
  1. BPD table (the paper's Table 1, §7.1 "Machine Translation"): k x {frozen, joint} x {corpus, distilled}
  2. lossy acceptance (BPD §5 "Approximate Inference"): top-J and minimum-block
  3. speculative sampling at T = 0.7, 1.0, 1.5: every drafter and way of drafting by the exact
     expected-tau evaluator; the headline rows decoded and timed; K ablation, Z_T sweep, curve
  4. where a step's time goes (BPD §7.3 "Wall-Clock Speedup"), t(k-token forward) / t(1-token forward), ceiling speedup
  5. several drafted paths per call (paths): N = --paths-list, independent and DBlast
  6. threads (threads): 1 against the default, quiet and beside busy processes
  7. what a call costs (calls): a target that computes next to nothing, each way of running its
     steps (eager, compiled, several steps a host call; on CUDA by hand or torch.compile's graphs)
  8. token trees (trees): trees grown from the drafters' distributions against one path and N paths
  9. every drafter behind one verifier (drafters): a draft model, prompt lookup, BPD heads, heads and
     lookup in one call, beside Hugging Face's greedy, prompt lookup and assisted generation on the
     same target converted to transformers' GPT-2 (where transformers is installed)
Prints markdown tables and writes them to OUT/RESULTS.md under the commit, command, machine and
torch that made them, with OUT/results.json and (with matplotlib, for tables 1-4) OUT/bench.png. Decoding runs at
--dtype (default float32; bfloat16 by autocast) and, on CUDA, --tf32; training keeps train.py's own.
The instruments (timing, Bench, the profiler's regions, the files) are measure.py's; a first run on
a GPU is gpu_check.py.

Method: the same held-out prompts for every row, decoded one request at a time by default (--batch
1, the papers' latency setting; a batch advances at the pace of its slowest row); with --compile
or on a GPU a warm-up run excluded (it compiles the graphs); the median of --repeats timed runs,
prefill included; tau counts the bonus token; speedup is against plain decoding of the same target and
prompts (compiled too under --compile), timed interleaved with it (round after round) so that load
on a shared machine hits both alike.
"""
import os
import signal
import sys

if __name__ == '__main__' and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ctrl-C while the imports below load (seconds on a busy machine): the one line cli.run_script
    # prints later too, not a traceback from inside torch's import
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write('\ninterrupted\n'), os._exit(130)))

import argparse
import copy
import functools
import statistics
import subprocess
import time
from contextlib import redirect_stdout

import torch

import train
import trainer
from arguments import MAX_PATHS
from cli import (DTYPES, SMALL_MODEL, ArgumentParser, BadInput, check_compiler, check_number, decoding_precision,
                 intra_op_threads, num_threads, pick_device, run_script)
from data import PROMPT_LEN, load_checkpoint, load_target
from decode import generate
from drafters import MixedPaths, PromptLookup, load_draft_model, load_drafter
from heads import BlockHeads, tree_size
from measure import (DRAFTING, TINY_TARGET, Bench, Tee, call_costs, command_line, common_flags, forward_ratio, hf_assistant,
                     hf_generate, identical, md_row, md_table, meta, output_nll, parse_list, prepare, results_md,
                     runner_settings, time_split, timed, to_hf, token_tree_ratio, train_args, tree_ratio,
                     ways_of_calling, write_json, write_text)
from model import GPT

BPD_KS = [2, 4, 6, 8, 10]
TEMPS = [0.7, 1.0, 1.5]
T_ABLATION = 1.5            # the high-entropy setting DBlast headlines (+12.1% tau at T = 1.5)
ABLATION_KS = [1, 2, 4, 8, 16]
ZTS = [0.0, 0.5, 1.0, 2.0]
PAPER_GAIN = {1.5: 12.1}    # DBlast vs independent drafting, % tau, Qwen3-8B (macro average)


# ----------------------------------------------------------------------------- checkpoints

def trainings(args, resume=True):
    """(checkpoint name, train.py argv) of the target and every drafter the chosen tables need, in
    order; with resume, each is skipped once trained. Table 'calls' needs none (TINY_TARGET)."""
    if not set(args.tables) - {'calls'}:
        return []
    runs = [('ckpt', train_args(args, 'base', resume=resume))]
    heads = [(False, True)] if 'bpd' not in args.tables else [(j, d) for j in (False, True) for d in (False, True)]
    heads = heads if set(args.tables) - {'paths', 'threads', 'calls'} else []    # tables 5, 6 and 7 need none
    for joint, distill in heads:
        runs.append((f'heads{heads_tag(joint, distill)}', train_args(
            args, 'heads', '--k', str(max(BPD_KS)), '--joint' if joint else '--frozen',
            '--distill' if distill else '--no-distill', '--tag', heads_tag(joint, distill), resume=resume)))
    if 'drafters' in args.tables:     # a draft model for the target, on its greedy continuations
        runs.append(('draft', train_args(args, 'draft', resume=resume)))
    for extra in dblast_trainings(args):
        K, tag = (extra[extra.index(flag) + 1] for flag in ('--branches', '--tag'))
        runs.append((f'dblast_K{K}{tag}', train_args(args, 'dblast', '--dblast-k', str(args.dblast_k), *extra,
                                                     resume=resume)))
    return runs


def ensure_checkpoints(args):
    """Train the target and every drafter the chosen tables need (skipped when already there). A
    checkpoint in --ckpt-dir made with other settings is one line in bench's own flags."""
    for _, argv in trainings(args):
        try:
            train.main(argv, says_resume=False)          # bench passes --resume itself (train_args)
        except trainer.Mismatch as e:
            raise BadInput(other_run(args, e)) from None


# what bench.py calls a setting train.py's --resume compares (the rest bench fixes itself)
BENCH_FLAGS = dict(n_layer='--n-layer', n_head='--n-head', n_embd='--n-embd', block_size='--block-size',
                   vocab_size='--data', k='--dblast-k')


def other_run(args, e):
    """The line for a checkpoint of --ckpt-dir that train.py refused to resume (trainer.Mismatch)."""
    name = os.path.basename(e.path)
    if e.key in ('trained_from', 'base_fingerprint'):
        return (f"--ckpt-dir {args.ckpt_dir}: its {name} was trained for another target than its ckpt.pt; remove it "
                f"or use another --ckpt-dir")
    have, want = (e.have, e.want) if isinstance(e.want, dict) else ({e.key: e.have}, {e.key: e.want})
    have = have if isinstance(have, dict) else {}
    keys = [key for key in want if have.get(key) != want[key]]
    said = ', '.join(f"{key}={have.get(key)} (this run: {want[key]})" for key in keys)
    ours = [key for key in keys if key in BENCH_FLAGS and key != 'vocab_size'
            and not (key == 'k' and name.startswith('heads'))]      # the heads' k is bench's own
    flags = [f"{BENCH_FLAGS[key]} {have.get(key)}" for key in ours]
    flags += ["the --data it was trained on"] * ('vocab_size' in keys)
    return (f"--ckpt-dir {args.ckpt_dir}: its {name} was made by another run ({said}); "
            + (f"give {', '.join(flags)}, or use another --ckpt-dir" if flags else "use another --ckpt-dir"))


def dblast_trainings(args):
    """train.py flags of every DBlast drafter the chosen tables need. Table 3: at each T, K = 4 and
    the K = 1 baseline with the same loss, NLL and AL; at T_ABLATION also K = 4 with the
    branch-conditional AL, K = 2, 8, 16 (AL), and a K = 4 run of twice the preset's steps whose
    held-out curve shows how far training has converged."""
    def job(T, loss, K, baseline, tag_extra='', *more):
        return ('--temperature', str(T), '--dblast-loss', loss, '--branches', str(K), '--baseline-loss', baseline,
                '--tag', dblast_tag(T, loss) + tag_extra) + more
    jobs = []
    if 'dblast' in args.tables:
        jobs += [job(T, loss, 4, loss) for T in TEMPS for loss in ('nll', 'al')]
        jobs += [job(T_ABLATION, 'al-branch', 4, 'none')]
        jobs += [job(T_ABLATION, 'al', K, 'none') for K in ABLATION_KS if K not in (1, 4)]
        iters = train.parse_args(train_args(args, 'dblast')).dblast_iters
        jobs += [job(T_ABLATION, 'al', 4, 'none', '_long', '--dblast-iters', str(2 * iters))]
    elif 'speed' in args.tables:
        jobs += [job(1.0, 'al', 4, 'none'), job(1.0, 'nll', 1, 'none')]
    if {'paths', 'threads', 'trees'} & set(args.tables) and 'dblast' not in args.tables:   # else table 3's at T_ABLATION
        jobs += [job(T_ABLATION, 'al', 4, 'none'), job(T_ABLATION, 'nll', 1, 'none')]
    return jobs


def heads_tag(joint, distill):
    return f"_{'joint' if joint else 'frozen'}_{'distill' if distill else 'corpus'}"


def dblast_tag(T, loss):
    return f'_T{T}_{loss}'


# ----------------------------------------------------------------------------- tables


def speed_table(b, base, args, results, drafters=None):
    """The figures at a glance, one row printed as soon as it is measured: tokens/s of plain and
    blockwise decoding, greedy with the frozen distilled heads at k = 2..10 (gpu_check.py: 8),
    then sampling at T=1 with the independent K = 1 NLL drafter and DBlast K = 4 AL (sampled drafts,
    mixture verification). drafters: (heads, K = 1, K = 4, T) to use instead of bench's own
    checkpoints (gpu_check.py --trained: train.py's). Greedy rows also give the share of tokens
    identical to plain greedy decoding at the same precision: the rule is exact, the arithmetic
    need not be (bf16 most of all; MATH.md §2). With --compile, each row's eager runs are timed in
    the same rounds, and the table gives what compiling gains, plain and blockwise, as ratios
    inside the run."""
    if drafters is None:
        load = lambda K, loss: load_drafter(os.path.join(args.ckpt_dir, f"dblast_K{K}{dblast_tag(1.0, loss)}.pt"), base)
        drafters = (load_drafter(os.path.join(args.ckpt_dir, f"heads{heads_tag(False, True)}.pt"), base),
                    load(1, 'nll'), load(4, 'al'), 1.0)
    heads, k1, k4, T = drafters
    configs = [('BPD heads', heads, k, 0.0) for k in args.speed_ks]
    configs += [('independent K=1 NLL', k1, args.dblast_k, T), ('DBlast K=4 AL', k4, args.dblast_k, T)]
    n_tokens = args.n_prompts * args.max_new
    mode = 'compiled' if args.compile else 'eager'
    print(f"\n### 0. Speed ({mode}, {b.precision}, {args.n_prompts} prompts x {args.max_new} tokens, "
          f"batch {args.batch})\n")
    gains = ['plain: compiled / eager', 'blockwise: compiled / eager'] if args.compile else []
    print(md_table(['drafter', 'T', 'k', 'plain tok/s', 'blockwise tok/s', 'tau', 'calls', 'speedup',
                    'identical tokens'] + gains, []), flush=True)
    rows = []
    for name, drafter, k, T in configs:
        r, out, plain_out = b.row(base, drafter, k, temperature=T, against_eager=True)
        same = identical(out, plain_out, b.prompts.size(1)) if T == 0 else None   # sampled: another stream
        r.update(drafter=name, T=T, plain_tok_s=n_tokens / r['plain_seconds'], tok_s=n_tokens / r['seconds'],
                 identical_tokens=same)
        rows.append(r)
        if gains:
            r.update(plain_compile_gain=r['plain_eager_seconds'] / r['plain_seconds'],
                     compile_gain=r['eager_seconds'] / r['seconds'])
        print(md_row([name, T, k, f"{r['plain_tok_s']:.0f}", f"{r['tok_s']:.0f}", f"{r['tau']:.2f}", r['calls'],
                      f"{r['speedup']:.2f}x", '' if same is None else f"{same:.3f}"]
                     + ([f"{r['plain_compile_gain']:.2f}x", f"{r['compile_gain']:.2f}x"] if gains else [])), flush=True)
    results['speed'] = dict(mode=mode, precision=str(b.precision), rows=rows)


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
                r.update(variant=('joint' if joint else 'frozen'), data=('distilled' if distill else 'corpus'),
                         identical_to_greedy=float((out == plain_out).all(-1).float().mean()),
                         agreement_with_original=identical(out, ref, b.prompts.size(1)),
                         heldout_loss_change=drift)
                rows.append(r)
                table.append([r['variant'], r['data'], k, f"{r['tau']:.2f}",
                              ' '.join(f'{a:.2f}' for a in r['accept_rate']),
                              f"{r['identical_to_greedy']:.2f}", f"{r['agreement_with_original']:.2f}",
                              f"{r['heldout_loss_change']:+.3f}", r['calls'], f"{r['speedup']:.2f}x"])
    results['bpd'] = rows
    print(f'\n### 1. Blockwise parallel decoding (greedy, exact acceptance; {b.precision})\n')
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
        r.update(accept=accept, agreement_with_greedy=identical(out, ref, T0),
                 output_nll=output_nll(base, out, T0))
        rows.append(r)
        table.append([accept, f"{r['tau']:.2f}", f"{r['agreement_with_greedy']:.3f}", f"{r['output_nll']:.3f}",
                      f"{r['speedup']:.2f}x"])
    results['lossy'] = dict(k=k, greedy_output_nll=output_nll(base, ref, T0), rows=rows)
    print(f"\n### 2. Lossy acceptance (frozen distilled heads, k={k}; {b.precision}); "
          f"greedy output NLL {results['lossy']['greedy_output_nll']:.3f}\n")
    print(md_table(['accept', 'tau', 'agreement with greedy', 'output NLL (original model)', 'speedup'], table))


def dblast_tables(b, base, args, results):
    """Table 3: speculative sampling with every drafter and way of drafting, at each T. Expected tau
    by the exact evaluator (dblast.expected_tau) on held-out target samples for the whole grid;
    decoding, timed against plain sampling, for the headline rows. Then the K ablation, the Z_T
    sweep and the training curve, by the evaluator."""
    ck, kd = args.ckpt_dir, args.dblast_k
    heads = load_drafter(os.path.join(ck, f"heads{heads_tag(False, True)}.pt"), base)

    @functools.cache   # each checkpoint loaded once: the evaluator takes the way of drafting as
    def drafter(T, loss, K, extra=''):   # arguments, and decoded rows set it on the drafter first
        return load_drafter(os.path.join(ck, f'dblast_K{K}{dblast_tag(T, loss)}{extra}.pt'), base)

    def grid(T):   # (name, drafter, ways of drafting) of table 3 at temperature T
        one, four = ['argmax', 'sampled'], ['greedy, mixture', 'sampled, mixture', 'greedy, branch-cond.',
                                            'sampled, branch-cond.']
        rows = [('BPD heads (distilled)', heads, one), ('K=1 NLL', drafter(T, 'nll', 1), one),
                ('K=1 AL', drafter(T, 'al', 1), one), ('K=4 NLL', drafter(T, 'nll', 4), four),
                ('K=4 AL', drafter(T, 'al', 4), four)]
        if T == T_ABLATION:
            rows.append(('K=4 AL, branch-cond. form', drafter(T, 'al-branch', 4), four))
        return rows

    # 3a: the grid by the evaluator
    grid_rows = []
    for T in TEMPS:
        for name, d, ways in grid(T):
            for way in ways:
                grid_rows.append(dict(T=T, drafter=name, drafts=way, expected_tau=b.expected_tau(base, d, T, way)))
    results['dblast'] = grid_rows
    keys = list(dict.fromkeys((r['drafter'], r['drafts']) for r in grid_rows))
    by = {(r['drafter'], r['drafts'], r['T']): r['expected_tau'] for r in grid_rows}
    print(f"\n### 3. Speculative sampling, k={kd}: expected tau on held-out target samples (exact evaluator; "
          f"{b.precision})\n")
    print(md_table(['drafter', 'drafts, verification'] + [f'T={T}' for T in TEMPS],
                   [[n, w] + [f"{by[n, w, T]:.2f}" if (n, w, T) in by else '' for T in TEMPS] for n, w in keys]))

    # 3b: decoded and timed, the paper's comparison: DBlast (K = 4, AL) against the independent
    # sampled K = 1 NLL drafter; then the paper's drafting (greedy branches) with our mixture
    # verification, and the paper's inference end to end (greedy branches, each verified alone)
    decoded, table = [], []
    for T in TEMPS:
        for name, d, way in [('independent K=1 NLL', drafter(T, 'nll', 1), 'sampled'),
                             ('DBlast K=4 AL', drafter(T, 'al', 4), 'sampled, mixture'),
                             ('DBlast K=4 AL', drafter(T, 'al', 4), 'greedy, mixture'),
                             ('DBlast K=4 AL', drafter(T, 'al', 4), 'greedy, branch-cond.')]:
            d.sample_drafts, d.verify = DRAFTING[way]
            r, _, _ = b.row(base, d, kd, temperature=T)
            r.update(T=T, drafter=name, drafts=way, expected_tau=b.expected_tau(base, d, T, way))
            decoded.append(r)
            table.append([T, name, way, f"{r['tau']:.2f}", f"{r['expected_tau']:.2f}", r['calls'],
                          f"{r['speedup']:.2f}x"])
    results['dblast_decoded'] = decoded
    print(f"\nDecoded ({args.n_prompts} prompts x {args.max_new} tokens), against plain sampling:\n")
    print(md_table(['T', 'drafter', 'drafts, verification', 'tau (decoded)', 'tau (evaluator)', 'calls',
                    'speedup'], table))
    gains = []
    for T in TEMPS:
        ind, dep = (next(r for r in decoded if r['T'] == T and r['drafter'] == n and r['drafts'] == w)
                    for n, w in [('independent K=1 NLL', 'sampled'), ('DBlast K=4 AL', 'sampled, mixture')])
        gains.append(dict(T=T, decoded=dep['tau'] / ind['tau'] - 1, evaluator=dep['expected_tau'] / ind['expected_tau'] - 1,
                          speedup_ratio=dep['speedup'] / ind['speedup'], paper=PAPER_GAIN.get(T)))
    results['dblast_gain'] = gains
    print("\nDBlast K=4 AL vs independent K=1 NLL, tau gain: " + '; '.join(
        f"T={g['T']}: {g['decoded']:+.1%} decoded, {g['evaluator']:+.1%} evaluator"
        + (f" (paper: +{g['paper']}%)" if g['paper'] else '') for g in gains))

    # 3c-e: K ablation, Z_T sweep, training curve (evaluator, T_ABLATION)
    T = T_ABLATION
    ways = ['sampled, mixture', 'greedy, mixture', 'sampled, branch-cond.']
    abl = [dict(K=K, **{w: b.expected_tau(base, drafter(T, 'al', K), T, w) for w in ways}) for K in ABLATION_KS]
    zts = [dict(zt=zt, **{w: b.expected_tau(base, drafter(T, 'al', 4), T, w, zt) for w in ways[:2]}) for zt in ZTS]
    long = load_checkpoint(os.path.join(ck, f"dblast_K4{dblast_tag(T, 'al')}_long.pt"), 'dblast')
    preset = load_checkpoint(os.path.join(ck, f"dblast_K4{dblast_tag(T, 'al')}.pt"), 'dblast')
    results['dblast_K_ablation'], results['dblast_zt_sweep'] = abl, zts
    results['dblast_curve'] = dict(long=long['history'], preset=preset['history'])
    print(f"\nK ablation (AL loss, T={T}, expected tau):\n")
    print(md_table(['K'] + ways, [[a['K']] + [f"{a[w]:.2f}" for w in ways] for a in abl]))
    print(f"\nZ_T sweep (K=4 AL, T={T}, expected tau):\n")
    print(md_table(['Z_T'] + ways[:2], [[z['zt']] + [f"{z[w]:.2f}" for w in ways[:2]] for z in zts]))
    print(f"\nTraining curve (K=4 AL, T={T}, held-out expected tau, sampled branches, mixture): "
          f"{long['iter_num']} steps: " + ', '.join(f"{it}: {v:.3f}" for it, v in long['history'])
          + f"; the preset's {preset['iter_num']} steps end at {preset['history'][-1][1]:.3f}")


def paths_table(b, base, args, results):
    """Table 5: several drafted paths per call (MATH.md §9) at each T, for the independent K = 1
    drafter (i.i.d. paths) and DBlast K = 4 (i.i.d. paths of the mixture, and one path per branch),
    N in --paths-list: tau, calls, speedup over plain sampling (with --compile: compiled, its eager
    runs timed in the same rounds), t(tree block) / t(k-token block), the eager step's time split
    for DBlast's i.i.d. paths at T = 1.5, and the ceiling
    tau * t(1) / t(block) this machine allows (the drafter's own time left out). Drafters:
    train.py's at T = 1.5."""
    kd = args.dblast_k
    load = lambda K, loss: load_drafter(os.path.join(args.ckpt_dir, f'dblast_K{K}{dblast_tag(T_ABLATION, loss)}.pt'), base)  # noqa: E731
    k1, k4 = load(1, 'nll'), load(4, 'al')
    ways = [('independent K=1', k1, 'iid'), ('DBlast K=4, i.i.d.', k4, 'iid'),
            ('DBlast K=4, per branch', k4, 'branches')]
    t1 = forward_ratio(base, kd, b.device, args.batch)                      # t(k) / t(1)
    ratio = {N: tree_ratio(base, N, kd, b.device, args.batch) for N in args.paths_list}
    mode = 'compiled' if args.compile else 'eager'
    gains = ['compiled / eager'] if args.compile else []
    print(f"\n### 5. Several paths per call, k={kd} ({mode}, {b.precision}, {args.n_prompts} prompts x "
          f"{args.max_new} tokens)\n")
    print(md_table(['T', 'drafter, paths', 'N', 'tau', 'calls', 'speedup', 't(block)/t(k)', 'ceiling'] + gains, []),
          flush=True)
    rows = []
    for T in args.paths_temps:
        for name, d, way in ways:
            for N in args.paths_list:
                if N == 1 and way == 'branches':   # one path per branch, N = 1: the i.i.d. row in law
                    continue
                d.paths_from = way   # one path per branch is verified against its own branch (generate.py's rule)
                d.verify = 'branch' if way == 'branches' else 'mixture'
                r, _, _ = b.row(base, d, kd, temperature=T, against_eager=True, paths=N)
                r.update(T=T, drafter=name, paths=N, t_block_over_t_k=ratio[N],
                         ceiling=r['tau'] / (ratio[N] * t1))
                if not args.compile and T == T_ABLATION and way == 'iid' and d is k4:   # the profiler's
                    r['split'] = time_split(lambda: b.decode_all(base, d, kd, T, paths=N), b.device)   # regions
                if gains:
                    r['compile_gain'] = r['eager_seconds'] / r['seconds']
                rows.append(r)
                print(md_row([T, name, N, f"{r['tau']:.2f}", r['calls'], f"{r['speedup']:.2f}x", f"{ratio[N]:.2f}",
                              f"{r['ceiling']:.2f}x"] + ([f"{r['compile_gain']:.2f}x"] if gains else [])), flush=True)
    k4.paths_from, k4.verify = 'iid', 'mixture'
    results['paths'] = dict(mode=mode, precision=str(b.precision), t_k_over_t_1=t1, rows=rows)
    for r in rows:
        if 'split' in r:
            print(f"share of decode time, {r['drafter']}, N={r['paths']}, T={r['T']}: "
                  + ', '.join(f'{n} {v:.0%}' for n, v in r['split'].items()))
    for T in args.paths_temps:
        best = max((r for r in rows if r['T'] == T), key=lambda r: r['speedup'])
        print(f"best at T={T}: {best['drafter']}, N={best['paths']}: tau {best['tau']:.2f}, "
              f"{best['speedup']:.2f}x over plain sampling (t(k)/t(1) = {t1:.2f})")


TREE_NODES = [8, 16, 24, 32, 64]   # table 8's node budgets (24: as many drafted tokens as 8 paths at k = 4)
# table 8's sampled trees under sampling, the spine's widths at k = 4 (heads.sample_tree; at another k the
# first k-1, then 1s): 9, 21 and 29 drafted tokens
SAMPLED_TREES = [(2, 2, 2), (4, 4, 4), (6, 5, 4)]


def fitted(widths, k):
    """A sampled tree's widths for k - 1 drafted positions: the first k - 1, then 1s."""
    return (tuple(widths) + (1,) * k)[:k - 1]


def trees_table(b, base, args, results):
    """Table 8: token trees grown from the drafters' own distributions (MATH.md §10) beside one path
    and several (MATH.md §9): BPD heads greedy at k = 8 (frozen, distilled), and the independent
    K = 1 and DBlast K = 4 drafters sampling at each T of --paths-temps, k = --dblast-k (train.py's
    drafters at T = 1.5), with best-first trees and sampled ones (SAMPLED_TREES, walked by recursive
    rejection sampling): tau, calls, tokens per call and speedup over plain decoding (with
    --compile: compiled), t(block) / t(one path's block) measured in this run, and tau over one
    path's tau, the speedup the tree would give where a wider call costs nothing more."""
    kd = args.dblast_k
    heads = load_drafter(os.path.join(args.ckpt_dir, f"heads{heads_tag(False, True)}.pt"), base)
    load = lambda K, loss: load_drafter(os.path.join(args.ckpt_dir, f'dblast_K{K}{dblast_tag(T_ABLATION, loss)}.pt'), base)  # noqa: E731
    configs = [('BPD heads', heads, 8, 0.0)] + [(name, d, kd, T) for T in args.paths_temps
                                                for name, d in (('independent K=1', load(1, 'nll')),
                                                                ('DBlast K=4', load(4, 'al')))]
    mode = 'compiled' if args.compile else 'eager'
    print(f"\n### 8. Token trees against paths ({mode}, {b.precision}, {args.n_prompts} prompts x {args.max_new} "
          f"tokens)\n")
    print(md_table(['drafter', 'T', 'k', 'block', 'tau', 'calls', 'tokens/call', 'speedup', 't(block)/t(path)',
                    'tau / one path\'s'], []), flush=True)
    rows, ratios = [], {}
    for name, d, k, T in configs:
        sampling = T > 0
        shapes = [('1 path', 1, None, None)] + [(f'{N} paths', N, None, None) for N in (2, 4, 8) if sampling]
        shapes += [(f'tree of {N}', 1, N, None) for N in TREE_NODES]
        shapes += [(f"sampled {','.join(map(str, w))} ({tree_size(w)})", 1, None, w)
                   for w in (fitted(widths, k) for widths in SAMPLED_TREES) if sampling]
        one = None
        for shape, paths, nodes, branching in shapes:
            # the block's tokens (one path's: k)
            size = 1 + (tree_size(branching) if branching else nodes if nodes else paths * (k - 1))
            if (size, k) not in ratios:   # what a block of `size` tokens costs does not depend on its shape
                ratios[size, k] = token_tree_ratio(base, size - 1, k, b.device, args.batch) if size > k else 1.0
            r, _, _ = b.row(base, d, k, temperature=T, paths=paths, nodes=nodes, branching=branching)
            one = one or r['tau']
            r.update(drafter=name, T=T, block=shape, tokens_per_call=args.n_prompts * args.max_new / r['calls'],
                     t_block_over_t_path=ratios[size, k], tau_over_one_path=r['tau'] / one)
            rows.append(r)
            print(md_row([name, T, k, shape, f"{r['tau']:.2f}", r['calls'], f"{r['tokens_per_call']:.2f}",
                          f"{r['speedup']:.2f}x", f"{ratios[size, k]:.2f}", f"{r['tau_over_one_path']:.2f}"]), flush=True)
    results['trees'] = dict(mode=mode, precision=str(b.precision), rows=rows)


LOOKUP_NGRAM, LOOKUP_K, DRAFT_K = 2, 11, 6   # table 9: Hugging Face's default n-gram, 10 drafts; gpt-fast's 5
TREE_OF = 16   # table 9's trees: the draft model's, and of the text's repeats


def drafters_table(b, base, args, results):
    """Table 9: the drafters a reader knows from elsewhere, behind the one verifier, greedy and at
    T = 1.0: tau, tokens per call, tokens/s and speedup over our plain decoding, and agreement with
    it (greedy). Beside them Hugging Face's generate on the same target (converted to its GPT-2,
    measure.to_hf): greedy, prompt lookup with the same n-gram and draft length, assisted generation
    with the same draft model's weights drafting the same number of tokens; timed in the same
    rounds, one prompt at a time (Hugging Face's speculative paths take one row)."""
    heads = load_drafter(os.path.join(args.ckpt_dir, f"heads{heads_tag(False, True)}.pt"), base)
    draft = load_draft_model(os.path.join(args.ckpt_dir, 'draft.pt'), base, k=DRAFT_K)
    lookup = PromptLookup(LOOKUP_NGRAM, LOOKUP_K)
    hf = to_hf(base)
    # (name, drafter, k, paths, nodes, Hugging Face's equivalent)
    rows_of = [('draft model', draft, DRAFT_K, 1, None, dict(assistant_model=hf and hf_assistant(draft.model, DRAFT_K))),
               (f'draft model, a tree of {TREE_OF}', draft, DRAFT_K, 1, TREE_OF, None),
               ('prompt lookup', lookup, LOOKUP_K, 1, None, dict(prompt_lookup_num_tokens=LOOKUP_K - 1,
                                                                 max_matching_ngram_size=LOOKUP_NGRAM)),
               (f'prompt lookup, a tree of {TREE_OF}', lookup, LOOKUP_K, 1, TREE_OF, None),
               ('BPD heads', heads, 8, 1, None, None),
               ('BPD heads + lookup', MixedPaths([heads, lookup]), 8, 2, None, None)]
    mode = 'compiled' if args.compile else 'eager'
    print(f"\n### 9. Every drafter behind one verifier ({mode}, {b.precision}, {args.n_prompts} prompts x "
          f"{args.max_new} tokens)\n")
    if hf is None:
        print("(transformers is not installed: the Hugging Face rows are left out; pip install transformers)\n")
    print(md_table(['drafter', 'T', 'k', 'tau', 'tokens/call', 'tokens/s', 'speedup', 'same as plain greedy'], []),
          flush=True)
    T0, total = b.prompts.size(1), args.n_prompts * args.max_new
    rows = []

    def hf_all(T, **how):      # every prompt through transformers' generate, one at a time
        runs = [hf_generate(hf, p[None], args.max_new, T, seed=i, **how) for i, p in enumerate(b.prompts)]
        return torch.cat([out for out, _ in runs]), sum(c for _, c in runs)

    def show(name, T, k, tau, calls, seconds, plain_seconds, out, base_out):
        same = identical(out, base_out, T0) if T == 0 else '-'
        r = dict(drafter=name, T=T, k=k, tau=tau, calls=calls, tokens_per_call=total / calls,
                 tok_s=total / seconds, speedup=plain_seconds / seconds, same=same)
        rows.append(r)
        print(md_row([name, T, k or '-', '-' if tau is None else f"{tau:.2f}", f"{total / calls:.2f}",
                      f"{r['tok_s']:.0f}", f"{r['speedup']:.2f}x", same]), flush=True)

    for T in (0.0, 1.0):
        for name, d, k, paths, nodes, how in rows_of:
            r, out, base_out = b.row(base, d, k, temperature=T, paths=paths, nodes=nodes)
            show(name, T, k, r['tau'], r['calls'], r['seconds'], r['plain_seconds'], out, base_out)
            if hf is not None and how is not None:
                (dt, dt0), ((hf_out, calls), (base_out, _)) = timed(
                    [lambda: hf_all(T, **how), lambda: b.decode_all(base, temperature=T)], args.repeats, b.device)
                show(f"Hugging Face {'assisted generation' if 'assistant_model' in how else name}", T, k, None,
                     calls, dt, dt0, hf_out, base_out)
        if hf is not None:
            (dt, dt0), ((hf_out, calls), (base_out, _)) = timed(
                [lambda: hf_all(T), lambda: b.decode_all(base, temperature=T)], args.repeats, b.device)
            show("Hugging Face, no drafter", T, None, None, calls, dt, dt0, hf_out, base_out)
    results['drafters'] = dict(mode=mode, precision=str(b.precision), rows=rows)


def threads_table(b, base, args, results):
    """Table 6: one thread against os.cpu_count()'s, quiet and beside one and two busy processes: a
    training step of a copy of the target (batch 16 x its context) and 128-token decodes, plain
    greedy and DBlast K = 4 sampling at T = 1.5; interleaved, median of --repeats (at least 3)."""
    dblast = load_drafter(os.path.join(args.ckpt_dir, f"dblast_K4{dblast_tag(T_ABLATION, 'al')}.pt"), base)
    model = copy.deepcopy(base).train()
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    x = torch.randint(base.config.vocab_size, (16, base.config.block_size + 1), device=b.device)
    prompt = b.prompts[:1]

    def train_step():
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    work = {'training step': train_step, 'decode 128, plain greedy': lambda: generate(base, prompt, 128, threads=None),
            'decode 128, DBlast K=4 at T=1.5': lambda: generate(base, prompt, 128, drafter=dblast, temperature=1.5,
                                                                threads=None)}   # the threads set below
    default, rows = os.cpu_count() or 1, []
    print(f"\n### 6. Threads: 1 against {default} ({args.repeats} rounds, median)\n")
    print(md_table(['work', 'busy processes', '1 thread (ms)', f'{default} threads (ms)', 'ratio'], []), flush=True)
    for n_busy in (0, 1, 2):
        busy = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(n_busy)]
        try:
            for name, fn in work.items():
                times = {1: [], default: []}
                for _ in range(max(3, args.repeats)):   # interleaved: a busy spell hits both alike
                    for t in times:
                        torch.set_num_threads(t)
                        times[t].append(timed([fn], 1, b.device, warmup=False)[0][0])
                one, many = (statistics.median(times[t]) * 1000 for t in (1, default))
                rows.append(dict(work=name, busy=n_busy, one_thread_ms=one, default_threads_ms=many))
                print(md_row([name, n_busy, f'{one:.0f}', f'{many:.0f}', f'{many / one:.2f}']), flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    intra_op_threads(args.threads, small=base.get_num_params() < SMALL_MODEL)
    results['threads'] = dict(default=default, rows=rows)


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
    # the profiler's named regions do not exist inside a compiled step: split only an eager run
    split = None if args.compile else time_split(lambda: b.decode_all(base, heads, 8), b.device)
    results['time'] = dict(rows=rows, split_k8=split)
    print(f"\n### 4. Where the time goes (frozen distilled heads; t(k)/t(1) of the eager forward; {b.precision})\n")
    print(md_table(['k', 't(k)/t(1)', 'tau', 'ceiling tau*t(1)/t(k)', 'measured speedup'], table))
    if split:
        print("\nshare of decode time at k=8: " + ', '.join(f'{n} {v:.0%}' for n, v in split.items()))


# table 7: new tokens of its one prompt, the fewer its cost of one more call is found against, and
# the runs it takes the best of
CALLS_TOKENS, CALLS_FEWER, CALLS_BEST_OF = 256, 32, 5


def calls_table(b, base, args, results):
    """Where a target call's time goes, on a target that computes next to nothing (TINY_TARGET, with
    untrained heads at k = 8, one thread, one prompt of CALLS_TOKENS new tokens): its time per call
    is the host's cost of a call, for each way of running the steps (measure.ways_of_calling) and
    each plain and blockwise: per call of a whole generate(), and per call past its fixed costs (the
    prefill, the set-up), against generate() of CALLS_FEWER tokens (measure.call_costs). The best of
    max(CALLS_BEST_OF, --repeats) runs; on CUDA the GPU's busy time, kernels and host launches per
    call too, from the profiler; on a CPU the operations per call."""
    cuda = torch.device(b.device).type == 'cuda'
    torch.manual_seed(args.seed)
    tiny = GPT(TINY_TARGET).to(b.device).eval()
    heads = BlockHeads(TINY_TARGET, 8).to(b.device).eval()
    prompt = torch.randint(TINY_TARGET.vocab_size, (1, PROMPT_LEN), device=b.device)
    extra = ['GPU busy (us)', 'kernels', 'launches'] if cuda else ['ops']
    best_of = max(CALLS_BEST_OF, args.repeats)
    print(f"\n### 7. What a call costs: a target that computes next to nothing ({TINY_TARGET.n_layer} layer, width "
          f"{TINY_TARGET.n_embd}), 1 prompt x {CALLS_TOKENS} tokens, 1 thread, best of {best_of}; per target call\n")
    print(md_table(['way', 'k', 'us', 'us past the fixed costs', 'tokens/s', 'tau'] + extra, []), flush=True)
    rows = []
    with num_threads(1):
        for way, (compile, setting) in ways_of_calling(b.device).items():
            for k, kw in ((1, {}), (8, dict(drafter=heads, k=8))):
                profiled = torch._inductor.config.patch({'cpp.enable_kernel_profile': True})   # CPU: kernels named
                with runner_settings(b.device, **setting), profiled:
                    r = call_costs(lambda: generate(tiny, prompt, CALLS_TOKENS, compile=compile, threads=None, **kw),
                                   b.device, best_of,
                                   lambda: generate(tiny, prompt, CALLS_FEWER, compile=compile, threads=None, **kw))
                r.update(way=way, k=k)
                rows.append(r)
                costs = ([f"{r['gpu_busy_us_per_call']:.0f}", f"{r['kernels_per_call']:.0f}",
                          f"{r['launches_per_call']:.1f}"] if cuda else [f"{r['ops_per_call']:.0f}"])
                print(md_row([way, k, f"{r['us_per_call']:.0f}", f"{r['us_per_further_call']:.0f}",
                              f"{r['tokens_per_s']:.0f}", f"{r['tau']:.2f}"] + costs),
                      flush=True)
    results['calls'] = dict(target=vars(TINY_TARGET), rows=rows)


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
    for name in ['BPD heads (distilled)', 'K=1 NLL', 'K=1 AL', 'K=4 NLL', 'K=4 AL']:
        for way in ('sampled', 'sampled, mixture'):
            rs = [r for r in results['dblast'] if r['drafter'] == name and r['drafts'] == way]
            if rs:
                ax[2].plot([r['T'] for r in rs], [r['expected_tau'] for r in rs], 'o-', label=name)
    ax[2].set(xlabel='temperature', ylabel='expected tau (sampled drafts)', title='sampling: tau vs T, k=4')
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out_dir, 'bench.png')
    fig.savefig(path, dpi=100)
    print(f"plot -> {path}")


# ----------------------------------------------------------------------------- main

TABLES = ['speed', 'bpd', 'lossy', 'dblast', 'time', 'paths', 'threads', 'calls', 'trees', 'drafters']
QUICK = dict(n_layer=2, n_head=2, n_embd=64, block_size=160, max_iters=300, heads_iters=150,
             dblast_iters=100, distill_samples=64, dblast_samples=64, dblast_eval_samples=8, n_prompts=4,
             max_new=64, repeats=1, eval_samples=8)
DEFAULT = dict(n_prompts=16, max_new=128, repeats=3, eval_samples=64)
FULL = dict(n_prompts=32, max_new=256, repeats=5, eval_samples=256)


def settle(args, preset):
    """Fill in what the flags left to the preset and check every flag before any work: the bench's
    own, then train.py's for each stage. Returns the device."""
    for key, v in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, v)
    args.speed_ks = parse_ks(args.speed_ks or ','.join(map(str, BPD_KS)))
    args.tables = parse_tables(args.tables)
    args.ckpt_dir = args.ckpt_dir or os.path.join(args.out, 'ckpt')
    for name in ('n_prompts', 'max_new', 'repeats', 'eval_samples', 'batch'):
        check_number('--' + name.replace('_', '-'), getattr(args, name), lo=1)
    check_number('--dblast-k', args.dblast_k, lo=2, hi=64)
    if args.threads is not None:
        check_number('--threads', args.threads, lo=1, hi=1024)
    check_number('--seed', args.seed, lo=0, hi=2 ** 63 - 1)
    device = pick_device(args.device)
    block_size = train.parse_args(train_args(args, 'base')).block_size
    for stage in ('heads', 'dblast'):
        train.parse_args(train_args(args, stage))
    longest = max(max(BPD_KS), args.dblast_k)
    if PROMPT_LEN + args.max_new + longest > block_size:
        raise BadInput(f"--max-new {args.max_new}: a {PROMPT_LEN}-token prompt, {args.max_new} tokens and a "
                       f"block of up to {longest} must fit the context of {block_size} (--block-size)")
    return device


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument('--quick', action='store_true', help='a few minutes: small models, few prompts')
    size.add_argument('--full', action='store_true', help="the one-GPU sweep: 32 prompts x 256 tokens (the GPU "
                      "preset's context of 512 holds them; elsewhere give --block-size 512)")
    ap.add_argument('--tables', default='bpd,lossy,dblast,time',
                    help=f"comma-separated, from {','.join(TABLES)} (default: bpd,lossy,dblast,time)")
    ap.add_argument('--compile', action='store_true',
                    help='decode with the compiled steps, several a host call (CUDA graphs on GPU); compiling happens '
                         'in the warm-up round')
    ap.add_argument('--dtype', default=None, choices=DTYPES,
                    help='decoding precision (default auto: float32; bfloat16: autocast, on a CPU too)')
    ap.add_argument('--tf32', action='store_true', help='CUDA, float32: let matmuls use TF32 (default off)')
    ap.add_argument('--paths-list', default='1,2,4,8', help='table 5: drafted paths per call, comma-separated')
    ap.add_argument('--paths-temps', default=','.join(map(str, TEMPS)), help='table 5: temperatures, comma-separated')
    ap.add_argument('--gpu-check', action='store_true', help=argparse.SUPPRESS)
    common_flags(ap, 'bench')
    args = ap.parse_args(argv)
    args.command = command_line('bench.py', argv)
    if args.gpu_check:
        raise BadInput("--gpu-check is a script of its own: python gpu_check.py --device cuda (--help for its flags)")
    device = settle(args, QUICK if args.quick else FULL if args.full else DEFAULT)
    args.paths_list = parse_paths(args.paths_list)
    args.paths_temps = parse_temps(args.paths_temps)
    precision = decoding_precision(args.dtype or 'auto', device, args.tf32)
    if args.compile:
        check_compiler(device)
    if args.full and device != 'cuda':
        print("note: --full is sized for one GPU; on this device it will take long", file=sys.stderr)
    prompts, val = prepare(args, device)
    t_start = time.perf_counter()
    ensure_checkpoints(args)   # at train.py's own precision (and bench's --threads, when given)
    base = load_target(os.path.join(args.ckpt_dir, 'ckpt.pt'), device) if trainings(args) else None
    intra_op_threads(args.threads, small=base is None or base.get_num_params() < SMALL_MODEL)
    b = Bench(args, device, prompts, val, precision)
    torch.manual_seed(args.seed)
    results = dict(meta=meta(args, device, str(b.precision)), method=__doc__.split('Method: ')[1].strip())
    printed = Tee(sys.stdout)
    with b.precision, redirect_stdout(printed):   # every decode, evaluation and timing of the tables
        for name, table in [('speed', speed_table), ('bpd', bpd_tables), ('lossy', lossy_table),
                            ('dblast', dblast_tables), ('time', time_table), ('paths', paths_table),
                            ('threads', threads_table), ('calls', calls_table), ('trees', trees_table),
                            ('drafters', drafters_table)]:
            if name in args.tables:
                table(b, base, args, results)
    results['meta']['seconds'] = time.perf_counter() - t_start
    path = os.path.join(args.out, 'results.json')
    write_json(results, path)
    write_text(results_md(results['meta'], printed.text()), os.path.join(args.out, 'RESULTS.md'))
    print(f"\nresults -> {path} and RESULTS.md ({results['meta']['seconds']:.0f}s)")
    if {'bpd', 'dblast', 'time'} <= set(args.tables):
        plots(results, args.out)


def parse_tables(text):
    tables = [t.strip() for t in text.split(',') if t.strip()]
    bad = [t for t in tables if t not in TABLES]
    if bad or not tables:
        raise BadInput(f"--tables {text!r}: choose one or more of {','.join(TABLES)} (comma list)")
    if 'time' in tables and 'bpd' not in tables:
        raise BadInput("--tables: 'time' reads the BPD rows, so it needs 'bpd' too")
    return tables


def parse_ks(text):
    return parse_list('--speed-ks', text, int, lambda k: 2 <= k <= max(BPD_KS),
                      f"block sizes from 2 to {max(BPD_KS)} (the heads' k)")


def parse_paths(text):
    return parse_list('--paths-list', text, int, lambda p: 1 <= p <= MAX_PATHS,
                      f"whole numbers from 1 to {MAX_PATHS}")


def parse_temps(text):
    return parse_list('--paths-temps', text, float, lambda t: 0 < t < float('inf'), "temperatures > 0")


if __name__ == '__main__':
    run_script(main, 'interrupted: nothing half-written; checkpoints trained so far are kept and reused '
                     'by the next run')
