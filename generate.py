"""
Decode from the command line: plain, blockwise parallel (BPD heads), or with a DBlast drafter, a
draft model or prompt lookup, greedy or sampled, timed against plain decoding of the same target
and prompt. The decoding itself is decode.py's (`generate`); this script loads the checkpoints
(drafters.load_drafter, load_draft_model), checks the flags and prints. The same timing makes
train.py's closing demos (`closing_demos`).

    python generate.py --ckpt out/ckpt.pt --prompt "def " --max-new-tokens 200
    python generate.py --ckpt out/ckpt.pt --heads out/heads.pt --k 8
    python generate.py --ckpt out/ckpt.pt --drafter out/dblast_K4.pt --temperature 1.5
    python generate.py --ckpt out/ckpt.pt --drafter out/dblast_K4.pt --temperature 1.5 --paths 4
    python generate.py --ckpt out/ckpt.pt --heads out/heads.pt --k 8 --nodes 32      # a token tree a call
    python generate.py --ckpt out/ckpt.pt --drafter out/dblast_K4.pt --temperature 1.5 --branching 4,4,4  # sampled
    python generate.py --ckpt out/ckpt.pt --draft-model out/draft.pt --k 6          # a small draft model
    python generate.py --ckpt out/ckpt.pt --draft-model out/draft.pt --k 6 --nodes 16  # its tree
    python generate.py --ckpt out/ckpt.pt --lookup 2 --k 11                         # prompt lookup
    python generate.py --ckpt out/ckpt.pt --lookup 2 --k 11 --nodes 16              # every repeat, a tree
    python generate.py --ckpt out/ckpt.pt --heads out/heads.pt --lookup 2 --k 8     # both, one path each

Several drafters (any of --heads, --drafter, --draft-model, --lookup) draft one path each, all
verified in the one call (drafters.MixedPaths).
"""
import os
import signal
import sys

if __name__ == '__main__' and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ctrl-C while the imports below load (seconds on a busy machine): the one line cli.run_script
    # prints later too, not a traceback from inside torch's import
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write('\ninterrupted\n'), os._exit(130)))

import argparse
import time

import torch

import runner
from arguments import MAX_NODES, MAX_PATHS, check_accept, check_args
from cli import (DTYPES, SMALL_MODEL, ArgumentParser, BadInput, check_compiler, check_number, decoding_precision,
                 intra_op_threads, pick_device, run_script)
from data import load_checkpoint, target_from, vocab_for
from dblast import PATHS_FROM, VERIFY
from decode import generate
from drafters import MixedPaths, PromptLookup, load_draft_model, load_drafter
from verification import parse_accept

# the default block of the drafters that can draft any length: gpt-fast drafts 5 tokens with its
# draft model, Hugging Face's prompt lookup examples 10
DRAFT_MODEL_K, LOOKUP_K = 6, 11
CKPT = 'out/ckpt.pt'   # the target python train.py writes
ANY_DRAFTER = 'a drafter (--heads, --drafter, --draft-model or --lookup)'


# ------------------------------------------------------------------------- timing

def timed_generate(*args, **kw):
    """generate() and its wall-clock seconds (synchronising CUDA so the time is real)."""
    prompt = args[1]
    if prompt.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out, stats = generate(*args, **kw)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return out, stats, time.perf_counter() - t0


def merged_stats(runs):
    """The stats of several generate() calls (a list of their stats) as one call's: calls and tokens
    summed, mean_tau and the acceptance per position over every step of every call."""
    taus = [t for s in runs for t in s['accept_lengths']]
    calls, tokens = sum(s['calls'] for s in runs), sum(s['tokens'] for s in runs)
    width = max((len(s['accept_rate']) for s in runs), default=0)
    rate = [sum(s['accept_rate'][j] * len(s['accept_lengths']) for s in runs if len(s['accept_rate']) > j)
            / max(1, sum(len(s['accept_lengths']) for s in runs if len(s['accept_rate']) > j)) for j in range(width)]
    return dict(calls=calls, tokens=tokens, tokens_per_call=tokens / max(1, calls),
                mean_tau=sum(taus) / len(taus) if taus else float('nan'), accept_lengths=taus, accept_rate=rate)


def agreement(out, base, T0):
    """'n/m tokens': how many generated tokens of `out` equal plain decoding's `base` (B, T)."""
    same = (out[:, T0:] == base[:, T0:])
    return f"{int(same.sum())}/{same.numel()} tokens"


# ------------------------------------------------------------------------- demos

def demo(model, prompts, drafter, k, temperature, label, max_new=128, log=print, paths=1, threads='auto',
         compile=False):
    """tau and wall-clock speedup over plain decoding of the same model and prompts, one request
    at a time (latency, as the papers measure it), timed in the same run after a warm-up of both
    (it compiles, with compile=True); under greedy decoding, how many tokens equal plain greedy's.
    threads: generate()'s (default: the scripts' choice for decoding). Returns the outputs."""
    def run(**extra):  # -> outputs, stats of every prompt, seconds in all
        g = torch.Generator(device=prompts.device).manual_seed(0)
        runs = [timed_generate(model, p[None], max_new, temperature=temperature, generator=g, threads=threads,
                               compile=compile, **extra) for p in prompts]
        return torch.cat([r[0] for r in runs]), [r[1] for r in runs], sum(r[2] for r in runs)
    run(drafter=drafter, k=k, paths=paths)  # warm-up, both ways
    run()
    out, stats, dt = run(drafter=drafter, k=k, paths=paths)
    base, base_stats, dt0 = run()
    stats, base_stats = merged_stats(stats), merged_stats(base_stats)
    same = f", same as plain greedy: {agreement(out, base, prompts.size(1))}" if temperature == 0 else ''
    log(f"{label}, blocks of k={k}{f', {paths} paths a call' if paths > 1 else ''}: mean tau "
        f"{stats['mean_tau']:.2f}, {stats['calls']} calls for {len(prompts)} prompts x {max_new} tokens "
        f"(plain: {base_stats['calls']}), speedup {dt0 / dt:.2f}x{same}")
    return out


DEMO_PATHS = 4   # paths per call in train.py's closing demo of several paths (bench.py's paths table)


def closing_demos(model, prompts, vocab, heads, k, dblast, dblast_k, temperature, log=print, threads='auto',
                  compile=False):
    """train.py's closing demos on held-out prompts: BPD heads against plain greedy, then each
    (label, drafter) of `dblast` against plain sampling at `temperature`, then the first of them
    with DEMO_PATHS i.i.d. paths per call (MATH.md §9). threads, compile: generate()'s."""
    shown = ([k] if heads is not None else []) + ([dblast_k] if dblast else [])   # the blocks decoded
    max_new = min(128, model.config.block_size - prompts.size(1) - max(shown, default=0))
    if compile:
        log("\n(decoding compiled, plain decoding too: the step compiled, several steps a host call"
            + (f", replayed as CUDA graphs of up to {runner.UNIT['cuda']} steps: the fastest way here"
               if prompts.is_cuda else "") + ")")
    if heads is not None:
        log("\n=== blockwise parallel decoding, held-out prompts, greedy")
        out = demo(model, prompts, heads, k, 0.0, "BPD heads", max_new, log, threads=threads, compile=compile)
        log(f"--- sample ---\n{vocab.decode(out[0].tolist())}\n--------------")
    if dblast:
        log(f"\n=== speculative sampling at T={temperature}, held-out prompts: the dependent drafter "
            f"against the independent one (sampled drafts, mixture verification)")
    for label, drafter in dblast:
        demo(model, prompts, drafter, dblast_k, temperature, label, max_new, log, threads=threads, compile=compile)
    for label, drafter in dblast[:1]:
        try:
            demo(model, prompts, drafter, dblast_k, temperature, label, max_new, log, paths=DEMO_PATHS,
                 threads=threads, compile=compile)
        except NotImplementedError as e:   # a handout leaves several paths per call out (exercise 8's answer)
            log(f"{label}, {DEMO_PATHS} paths: skipped, {e}")


# ------------------------------------------------------------------------- the command line

def colour_blocks(vocab, tokens, taus, colour):
    """Text with each step's committed block in alternating colours (ANSI)."""
    if not colour:
        return vocab.decode(tokens)
    parts, i = [], 0
    for s, t in enumerate(taus + [len(tokens)]):   # the last bonus, written without a step, ends it
        if i >= len(tokens):
            break
        code = '\033[30;46m' if s % 2 else '\033[30;43m'
        parts.append(code + vocab.decode(tokens[i:i + t]) + '\033[0m')
        i += t
    return ''.join(parts)


def main(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--ckpt', default=CKPT, help=f'target checkpoint, ours or nanoGPT\'s (default: {CKPT}, where '
                                                 f'python train.py writes it)')
    ap.add_argument('--meta', default=None, help="nanoGPT meta.pkl of a character-level target (default: "
                                                 "where nanoGPT's sample.py looks, or beside --ckpt)")
    ap.add_argument('--prompt', default='def ', help='prompt text')
    ap.add_argument('--max-new-tokens', type=int, default=None,
                    help="tokens to generate (default: 200, or what fits the model's context)")
    ap.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    ap.add_argument('--seed', type=int, default=None, help='seed of every random draw (default 0): sampling, and a '
                                                           'DBlast drafter\'s branches. --compile draws from another '
                                                           'stream: the same distribution, other text')
    ap.add_argument('--heads', default=None, help='BPD heads checkpoint: blockwise parallel decoding')
    ap.add_argument('--drafter', default=None, help='DBlast drafter checkpoint')
    ap.add_argument('--draft-model', default=None,
                    help='a small target checkpoint of the same vocabulary (train.py --stages base, or --stages '
                         'draft) as a draft model: k-1 tokens drafted one by one with its own KV cache')
    ap.add_argument('--lookup', type=int, default=None, metavar='N',
                    help='prompt lookup: draft what followed the last N-gram (down to 1) where it occurred before '
                         'in the text (Hugging Face\'s max_matching_ngram_size; 2 is its default)')
    ap.add_argument('--k', type=int, default=None,
                    help=f'block size (default: what the drafter was trained for; a draft model {DRAFT_MODEL_K}, '
                         f'prompt lookup {LOOKUP_K})')
    ap.add_argument('--accept', default='exact', help="exact | topk:N | minblock:N (greedy only)")
    ap.add_argument('--zt', type=float, default=None, help='DBlast category temperature Z_T (default 1; 0 = argmax branch)')
    ap.add_argument('--sample-drafts', action=argparse.BooleanOptionalAction, default=None,
                    help="under sampling, draw each draft from the drafter's q (default) or take its argmax "
                         "(--no-sample-drafts; DBlast: greedy branches, the paper's drafting; with --verify branch, "
                         "the paper's inference end to end)")
    ap.add_argument('--verify', default=None, choices=VERIFY,
                    help="DBlast: verify against the mixture's conditionals (default), or the drawn branch's "
                         "alone (ablation)")
    ap.add_argument('--paths', type=int, default=1,
                    help=f'drafted paths verified per call (default 1; up to {MAX_PATHS})')
    ap.add_argument('--nodes', type=int, default=None,
                    help=f'a token tree of at most N drafted tokens verified per call, grown from the drafter\'s '
                         f'distributions (--lookup: what followed every earlier occurrence of the n-gram) and walked '
                         f'with the target\'s own choices (up to {MAX_NODES})')
    ap.add_argument('--branching', default=None, type=parse_branching,
                    help="sampling: a sampled token tree verified per call, its children drawn without replacement "
                         "from the drafter, b_j for the bonus and the first-drawn child at depth j-1, one for every "
                         "other node, walked by recursive rejection sampling (k-1 widths: --k 4 --branching 4,4,4, "
                         "21 drafted tokens)")
    ap.add_argument('--paths-from', default=None, choices=PATHS_FROM,
                    help="DBlast, --paths > 1: i.i.d. samples of the mixture (default), or one path per branch, "
                         "the branches drawn without replacement from the prior")
    ap.add_argument('--no-color', action='store_true', help='plain text even on a terminal')
    ap.add_argument('--device', default=None, help='cpu | cuda | mps (default: best available)')
    ap.add_argument('--compile', action='store_true',
                    help='the steps compiled, several a host call (on a GPU: CUDA graphs captured once); '
                         'warm-up excluded from timing')
    ap.add_argument('--dtype', default='auto', choices=DTYPES,
                    help='compute precision (default auto: float32; bfloat16: autocast, on a CPU too)')
    ap.add_argument('--tf32', action='store_true', help='CUDA: let float32 matmuls use TF32 (default off)')
    ap.add_argument('--threads', type=int, default=None,
                    help=f'CPU threads (default: 1 for a model under {SMALL_MODEL // 10 ** 6}M parameters, else the '
                         f'cores not already busy)')
    run_cli(ap.parse_args(argv))


def parse_branching(text):
    """--branching 4,4,4 -> (4, 4, 4); check_args judges the numbers."""
    parts = text.split(',')
    if not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError("want whole numbers separated by commas, one a drafted position: 4,4,4")
    return tuple(int(p) for p in parts)


def check_cli(args):
    """Every flag, before anything is loaded: ranges, and options that mean nothing in this mode."""
    drafter = args.heads or args.drafter or args.draft_model or args.lookup is not None
    several = sum(x is not None for x in (args.heads, args.drafter, args.draft_model, args.lookup)) > 1
    check_number('--temperature', args.temperature, lo=0.0, note='0 = greedy')
    if args.lookup is not None:
        check_number('--lookup', args.lookup, lo=1, hi=64, note='the longest n-gram looked for')
    if args.seed is not None:
        check_number('--seed', args.seed, lo=0, hi=2 ** 63 - 1)
    if args.max_new_tokens is not None:
        check_number('--max-new-tokens', args.max_new_tokens, lo=1)
    if args.zt is not None:
        check_number('--zt', args.zt, lo=0.0, note='0 = argmax branch')
    if args.k is not None:
        check_number('--k', args.k, lo=2)
    check_number('--paths', args.paths, lo=1, hi=MAX_PATHS)
    if args.nodes is not None:
        check_number('--nodes', args.nodes, lo=1, hi=MAX_NODES)
    if args.threads is not None:
        check_number('--threads', args.threads, lo=1, hi=1024)
    parse_accept(args.accept, cli=True)
    meaningless = [   # (given, flag, what it applies to)
        (args.k is not None and not drafter, '--k', ANY_DRAFTER),
        (args.accept != 'exact' and not drafter, '--accept', ANY_DRAFTER),
        (args.paths > 1 and several, '--paths', 'one drafter (several draft one path each, --paths set to their number)'),
        (args.zt is not None and not args.drafter, '--zt', 'a DBlast --drafter'),
        (args.verify is not None and not args.drafter, '--verify', 'a DBlast --drafter'),
        (args.paths > 1 and not drafter, '--paths', ANY_DRAFTER),
        (args.nodes is not None and (several or not drafter), '--nodes',
         'one drafter (--heads, --drafter, --draft-model or --lookup: its distributions grow the tree)'),
        (args.branching is not None and (several or not drafter), '--branching',
         'one drafter (--heads, --drafter, --draft-model or --lookup: its distributions grow the tree)'),
        (args.paths_from is not None and (not args.drafter or args.paths == 1), '--paths-from',
         'a DBlast --drafter with --paths > 1'),
        (args.verify is not None and args.paths_from == 'branches', '--verify',
         'i.i.d. paths (with --paths-from branches each path is verified against its own branch)'),
        (args.verify is not None and args.temperature == 0, '--verify',
         'sampling (--temperature > 0): greedy decoding compares argmaxes, with nothing to verify against'),
        (args.sample_drafts is not None and (not (args.heads or args.drafter or args.draft_model)
                                             or args.temperature == 0), '--[no-]sample-drafts',
         'sampling with --heads, --drafter or --draft-model (prompt lookup drafts what the text holds)'),
        (args.seed is not None and args.temperature == 0 and not args.drafter, '--seed',
         'sampling, or a DBlast --drafter (its branches are drawn); greedy decoding draws nothing')]
    for given, flag, applies_to in meaningless:
        if given:
            raise BadInput(f"{flag} means nothing here: it applies to {applies_to}")


def load_drafters(args, model, vocab):
    """The drafters the flags name, in the order --heads, --drafter, --draft-model, --lookup."""
    drafters = []
    for path, kind in ((args.heads, 'heads'), (args.drafter, 'dblast')):
        if path is None:
            continue
        drafter = load_drafter(path, model, kind, vocab)
        drafter.sample_drafts = args.sample_drafts is not False
        if kind == 'dblast':   # a DBlast mixture (check_cli refused --verify and --zt otherwise)
            drafter.verify = args.verify or drafter.verify
            drafter.zt = drafter.zt if args.zt is None else args.zt
            drafter.paths_from = args.paths_from or drafter.paths_from
            if drafter.paths_from == 'branches':   # what one path per branch is verified against
                drafter.verify = 'branch'
        drafters.append(drafter)
    if args.draft_model is not None:
        drafter = load_draft_model(args.draft_model, model, vocab, k=args.k or DRAFT_MODEL_K)
        drafter.sample_drafts = args.sample_drafts is not False
        drafters.append(drafter)
    if args.lookup is not None:
        drafters.append(PromptLookup(args.lookup, k=args.k or LOOKUP_K))
    return drafters


def run_cli(args):
    check_cli(args)
    device = pick_device(args.device)
    if args.compile:
        check_compiler(device)
    with decoding_precision(args.dtype, device, args.tf32) as precision:
        decode_cli(args, device, precision)


def compiling(args):
    """With --compile, a line before the silent minute (on a CPU) that compiling takes."""
    if args.compile:
        print("note: --compile: compiling the decoding steps before the timed run (a minute or so on a 2-core CPU; "
              "each new setting compiles again)", file=sys.stderr, flush=True)


def decode_cli(args, device, precision):
    if args.meta and not os.path.isfile(args.meta):
        what = "not a regular file; give a nanoGPT meta.pkl" if os.path.exists(args.meta) else "no such file"
        raise BadInput(f"--meta {args.meta}: {what}")
    if args.ckpt == CKPT and not os.path.exists(CKPT):
        raise BadInput(f"no target at {CKPT}, the default --ckpt: run python train.py first (it writes {CKPT}), "
                       f"or give --ckpt")
    ckpt = load_checkpoint(args.ckpt)
    model = target_from(ckpt, args.ckpt, device)
    vocab = vocab_for(ckpt, args.ckpt, model.config.vocab_size, args.meta)
    del ckpt
    intra_op_threads(args.threads, small=model.get_num_params() < SMALL_MODEL)
    if not args.prompt:
        raise BadInput("prompt is empty: give at least one character with --prompt")
    ids = vocab.encode(args.prompt, 'the prompt')
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    room = model.config.block_size - prompt.size(1)
    max_new = args.max_new_tokens
    if max_new is None:
        max_new = min(200, room)
        if max_new < 1:
            raise BadInput(f"the prompt ({prompt.size(1)} tokens) fills the model's context of "
                           f"{model.config.block_size} tokens")
        if max_new < 200:
            print(f"note: generating {max_new} tokens, what fits the model's context of "
                  f"{model.config.block_size} after the {prompt.size(1)}-token prompt", file=sys.stderr)
    drafters = load_drafters(args, model, vocab)
    drafter = None if not drafters else drafters[0] if len(drafters) == 1 else MixedPaths(drafters)
    paths = args.paths if len(drafters) < 2 else len(drafters)
    # the drafter's own word on what means nothing here (heads.Drafter.meaningless), named as flags
    k = check_args(model, prompt, max_new, drafter, args.k, args.temperature, cli=True, paths=paths, nodes=args.nodes,
                   branching=args.branching)
    check_accept(args.accept, parse_accept(args.accept, model.config.vocab_size, cli=True)[1], args.temperature,
                 drafter, k, args.nodes, cli=True)
    kw = dict(temperature=args.temperature, compile=args.compile, threads=None)   # intra_op_threads' above

    def gen(**extra):
        g = torch.Generator(device=device).manual_seed(args.seed or 0)
        return timed_generate(model, prompt, max_new, **kw, **extra, generator=g)

    compiling(args)
    if drafter is None:
        gen()  # warm-up
        out, stats, dt = gen()
        print(vocab.decode(out[0].tolist()))
        print(f"\n--- {max_new} tokens in {dt:.3f}s: {max_new / dt:.1f} tokens/s, {stats['calls']} calls ({precision})")
        return
    spec = dict(drafter=drafter, k=args.k, accept=args.accept, paths=paths, nodes=args.nodes, branching=args.branching)
    gen(**spec)  # warm-up both paths so neither pays first-call costs in the timing
    gen()
    out, stats, dt = gen(**spec)
    base, base_stats, dt_base = gen()
    colour = sys.stdout.isatty() and not args.no_color
    T0 = prompt.size(1)
    print(vocab.decode(out[0, :T0].tolist()) + colour_blocks(vocab, out[0, T0:].tolist(), stats['accept_lengths'], colour))
    plain = 'greedy' if args.temperature == 0 else 'sampling'
    shape = (f"nodes={args.nodes}" if args.nodes else f"branching={','.join(map(str, args.branching))}"
             if args.branching else f"paths={paths}")
    print(f"\n--- k={args.k or drafter.k} {shape} accept={args.accept}: mean tau {stats['mean_tau']:.2f}, "
          f"{stats['calls']} calls (plain: {base_stats['calls']}), "
          f"{max_new / dt:.1f} tokens/s vs {max_new / dt_base:.1f} plain {plain}: speedup {dt_base / dt:.2f}x "
          f"({precision})")
    print("acceptance per draft position: " + " ".join(f"{a:.2f}" for a in stats['accept_rate']))
    if args.temperature == 0:   # measured: the rule is exact, floating point need not be (MATH.md §2)
        print(f"same as plain greedy decoding: {agreement(out, base, T0)}")


if __name__ == '__main__':
    run_script(main)
