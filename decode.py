"""
Decoding: plain autoregressive, blockwise parallel (BPD, greedy and lossy), and lossless
speculative sampling with a block drafter (BPD heads or DBlast).

Everything runs through one function, `merged_step` (DESIGN §2): the pending block
[bonus, d_1 .. d_{k-1}] goes through the target in one call; the same call verifies the drafts,
picks the next bonus and drafts the next block from the hidden state at the first rejection.
Plain decoding is the same step with k = 1 and no drafter.

    python decode.py --ckpt out/ckpt.pt --prompt "def " --max-new-tokens 200
    python decode.py --ckpt out/ckpt.pt --heads out/heads.pt --k 8
    python decode.py --ckpt out/ckpt.pt --drafter out/dblast.pt --temperature 1.0 --zt 1.0
"""
import argparse
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F

from model import BadInput, GPTConfig, load_checkpoint, load_target, run_script


# ------------------------------------------------------------------------- sampling helpers

def span(name):
    """A named region for torch.profiler (bench.py splits a step's time by these); near free
    when no profiler is running, and left out of a compiled step (the compiler ignores it)."""
    if torch.compiler.is_compiling():
        return nullcontext()
    return torch.profiler.record_function('step.' + name)


def upcast(t):
    """At least float32 (bf16 logits are upcast; float64 stays float64 for exactness tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def sample(weights, generator=None):
    """One index per row of non-negative `weights` (..., V), by inverse CDF.

    The weights need not be normalised: u is scaled by the row's total. It is a single rand and a
    searchsorted, so it needs no host sync on CUDA (torch.multinomial may) and honours `generator`.
    """
    cdf = weights.cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return idx.clamp_(max=weights.size(-1) - 1).squeeze(-1)


def residual(p, q, drafts):
    """Where a draft was rejected the bonus comes from norm(max(0, p - q)) (Leviathan et al. /
    Chen et al.). p (B, n, V), q (B, n, V) or None for point-mass (argmax) drafts, drafts (B, n).
    A point mass puts all of q on the draft, so the residual is p without the draft's mass.
    Returned unnormalised (`sample` normalises); an all-zero row (p == q, where rejection has
    probability zero) falls back to p so it can never divide by zero."""
    if q is None:
        r = p.scatter(-1, drafts.unsqueeze(-1), 0.0)
    else:
        r = (p - q).clamp_(min=0.0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def parse_accept(accept):
    """'exact' | 'topk:N' | 'minblock:N' -> (mode, N)."""
    mode, _, n = accept.partition(':')
    if mode == 'exact' and not n:
        return mode, 0
    if mode in ('topk', 'minblock') and n.isdigit() and int(n) >= 1:
        return mode, int(n)
    raise BadInput(f"accept={accept!r}: use 'exact', 'topk:N' or 'minblock:N' with N >= 1")


# ------------------------------------------------------------------------- the merged step

def merged_step(model, drafter, cache, block, q_block, active, temperature=0.0,
                accept=('exact', 0), generator=None):
    """One target call: verify `block` (B, k) = [bonus, drafts], commit, propose the next block.

    q_block (B, k-1, V): the proposal's conditionals Q_i(.) given the drafts before position i,
    as the drafter returned them (for a mixture they depend on the drafted prefix; for independent
    drafts they are the drafter's own q), or None for point-mass drafts. The step does not know
    which drafter it has: any proposal verified against its own conditionals is lossless.
    active (B,) bool: rows still generating; the others do not advance.
    Returns (n_acc (B,), accepted (B, k-1) bool, next block (B, k), its q).
    Static shapes, no Python loop over positions, no host sync.
    """
    B, k = block.shape
    with span('target_forward'):
        h = model.forward_cached(block, cache)                  # (B, k, C)  BPD §3: one call
        logits = upcast(model.lm_head(h))
    with span('verify'):
        drafts = block[:, 1:]                                   # (B, k-1)
        if temperature == 0.0:
            # BPD §3 verify: draft j+1 must be the target's argmax after position j
            target = logits.argmax(-1)                          # (B, k)
            mode, n = accept
            if mode == 'topk':       # BPD §5: accept any draft inside the target's top-n
                ok = (logits[:, :-1].topk(n, dim=-1).indices == drafts.unsqueeze(-1)).any(-1)
            else:
                ok = drafts == target[:, :-1]
                if mode == 'minblock':  # BPD §5: the first n-1 drafts are taken whatever they are
                    ok = ok | (torch.arange(1, k, device=block.device) < n)
            candidates = target                                 # bonus after each position
        else:
            # Lossless speculative sampling (DESIGN §2), the same temperature on p and q
            p = F.softmax(logits / temperature, dim=-1)         # (B, k, V) p_target
            p_d = p[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            q_d = 1.0 if q_block is None else q_block.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
            u = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p.dtype)
            ok = u * q_d < p_d                                  # accept w.p. min(1, p/q)
            # every position's candidate bonus is drawn now, so the step stays one call without
            # a sync: residual after a rejection at j, a plain sample from p after the last one
            weights = torch.cat([residual(p[:, :-1], q_block, drafts), p[:, -1:]], dim=1)
            candidates = sample(weights, generator)             # (B, k)
        accepted = ok.long().cumprod(-1).bool()                 # nothing counts past a rejection
        n_acc = accepted.sum(-1)                                # (B,) accepted drafts
        bonus = candidates.gather(1, n_acc[:, None]).squeeze(1)  # (B,)
    with span('cache'):
        cache.lengths += (n_acc + 1) * active                   # commit b, d_1 .. d_{n_acc}
    if drafter is None:
        return n_acc, accepted, bonus[:, None], None
    with span('draft'):
        # BPD §3 merged propose: draft from the hidden state of the last accepted position.
        # Gathering that row first and drafting once equals drafting at every j, then gathering.
        h_acc = h.gather(1, n_acc[:, None, None].expand(B, 1, h.size(-1))).squeeze(1)  # (B, C)
        new_drafts, q = drafter.draft(h_acc, bonus, model, k, temperature, generator)
    return n_acc, accepted, torch.cat([bonus[:, None], new_drafts], dim=1), q


def check_args(model, prompt, max_new_tokens, drafter, k, temperature, accept):
    """Every user error generate() can meet, as a one-line BadInput."""
    if prompt.dim() != 2 or prompt.size(1) == 0:
        raise BadInput("prompt is empty: give at least one token")
    if max_new_tokens < 1:
        raise BadInput(f"max_new_tokens={max_new_tokens}: must be >= 1")
    limit = model.config.block_size
    if prompt.size(1) + max_new_tokens > limit:
        raise BadInput(f"prompt ({prompt.size(1)} tokens) + max_new_tokens ({max_new_tokens}) "
                       f"exceeds the model's context of {limit} tokens")
    if temperature < 0:
        raise BadInput(f"temperature={temperature}: must be >= 0 (0 = greedy)")
    mode, n = parse_accept(accept)
    if mode == 'topk' and n > model.config.vocab_size:
        raise BadInput(f"accept={accept!r}: N must be <= the vocabulary size {model.config.vocab_size}")
    if mode != 'exact' and temperature > 0:
        raise BadInput(f"accept={accept!r} is lossy and greedy-only; use accept='exact' "
                       f"with temperature > 0")
    if drafter is not None:
        if k < 2:
            raise BadInput(f"k={k}: a drafter needs k >= 2 (1 bonus + at least one draft)")
        if k > drafter.k:
            raise BadInput(f"k={k} but the drafter was trained for k <= {drafter.k}")
    return mode, n


_COMPILED = {}


def compiled_step(device_type):
    """merged_step under torch.compile with static shapes; on CUDA as CUDA graphs
    ("reduce-overhead"), so the step is one graph replay with no host round trip (generate's loop
    around it keeps a few small ops and its one sync per step).
    Each k, temperature, acceptance rule and drafter class is its own graph; a sweep such as
    bench.py's needs a few dozen, past dynamo's default limit of 8, after which it would run
    eager with no more than a logged warning."""
    if device_type not in _COMPILED:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        mode = 'reduce-overhead' if device_type == 'cuda' else None
        _COMPILED[device_type] = torch.compile(merged_step, mode=mode, dynamic=False)
    return _COMPILED[device_type]


@contextmanager
def global_rng_from(generator, device):
    """The compiled step draws its random numbers from the global RNG: a torch.Generator passed
    into a compiled function splits the graph at every draw. So for the length of one generate()
    the global RNG of `device` is forked, seeded from `generator`, and restored afterwards: the
    caller's global state is untouched and the same generator seed gives the same output."""
    if generator is None:
        yield
        return
    seed = int(torch.randint(2 ** 62, (), generator=generator, device=generator.device))
    cuda = device.type == 'cuda'
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        yield


def static_cache(model, B, k):
    """For the compiled step, as gpt-fast does: a cache sized by the context rather than the
    request, kept on the model and reused across calls, so shapes and buffer addresses never
    change and the compiled graphs (CUDA graphs on GPU) are recorded once. The spare room (2k,
    see generate) is rounded up to a multiple of 64, so plain decoding and every k up to 32
    share the same buffers, as bench.py's interleaved timing needs. One cache per batch size."""
    max_len = -(-(model.config.block_size + 2 * k) // 64) * 64
    w = model.lm_head.weight
    key = (B, max_len, w.dtype, w.device)
    caches = model.__dict__.setdefault('_static_caches', {})   # a plain attribute, not a buffer
    if key not in caches:
        caches[key] = model.new_cache(B, max_len)
        for buf in (caches[key].k, caches[key].v, caches[key].lengths):
            torch._dynamo.mark_static_address(buf)
    cache = caches[key]
    cache.lengths.zero_()
    return cache


@torch.no_grad()
def generate(model, prompt, max_new_tokens, drafter=None, k=None, temperature=0.0,
             accept="exact", generator=None, compile=False):
    """Generate max_new_tokens after prompt (B, T0) -> (out (B, T0 + max_new_tokens), stats).

    drafter=None: plain decoding, one target call per token. With a drafter (BlockHeads or
    DBlastDrafter) every call verifies a block of k = 1 bonus + k-1 drafts. Greedy (temperature 0)
    output equals plain greedy exactly under accept='exact'; sampled output has exactly the
    target's distribution.
    stats: calls (prefill included), accept_lengths (tau of every step of every row, bonus
    included), accept_rate (per draft position, share of steps it was accepted).
    compile=True runs the step compiled (the first calls pay the compilation: warm up first).
    """
    k = 1 if drafter is None else (drafter.k if k is None else k)
    accept = check_args(model, prompt, max_new_tokens, drafter, k, temperature, accept)
    B, T0 = prompt.shape
    total = T0 + max_new_tokens
    dev = prompt.device
    # spare room past the end: a row may overshoot `total` by k-1 tokens, and a finished row still
    # runs (and writes) one block per step until every row is done; none of it is kept
    out = torch.zeros(B, total + 2 * k, dtype=torch.long, device=dev)
    out[:, :T0] = prompt
    if compile:  # the compiled step draws from the global RNG, seeded below (global_rng_from)
        step, cache, step_generator = compiled_step(dev.type), static_cache(model, B, k), None
    else:
        step, cache, step_generator = merged_step, model.new_cache(B, total + 2 * k), generator

    # prefill (call 1): the prompt's last hidden state gives the first bonus and drafts
    h = model.forward_cached(prompt, cache)[:, -1]              # (B, C)
    cache.lengths += T0
    logits = upcast(model.lm_head(h))
    if temperature == 0.0:
        bonus = logits.argmax(-1)
    else:
        bonus = sample(F.softmax(logits / temperature, dim=-1), generator)
    block, q = bonus[:, None], None
    if drafter is not None:
        drafts, q = drafter.draft(h, bonus, model, k, temperature, generator)
        block = torch.cat([block, drafts], dim=1)

    n_out = torch.full((B,), T0, dtype=torch.long, device=dev)  # committed tokens per row
    offs = torch.arange(k, device=dev)
    taus, accs, actives = [], [], []
    calls = 1
    with global_rng_from(generator if compile else None, dev):
        while True:
            with span('host_sync'):
                active = n_out < total
                if not bool(active.any()):  # the one host sync per step: are all rows done?
                    break
            with span('cache'):
                # write the whole pending block; what is not accepted is overwritten by the next
                out.scatter_(1, n_out[:, None] + offs, block)
            if compile:
                torch.compiler.cudagraph_mark_step_begin()
            n_acc, accepted, block, q = step(model, drafter, cache, block, q, active,
                                             temperature, accept, step_generator)
            if compile:  # a CUDA graph's outputs are overwritten by its next replay: keep copies
                n_acc, accepted, block = n_acc.clone(), accepted.clone(), block.clone()
                q = None if q is None else q.clone()
            calls += 1
            n_out += (n_acc + 1) * active
            taus.append(n_acc + 1)
            accs.append(accepted)
            actives.append(active)

    act = torch.stack(actives).cpu()                            # (steps, B)
    tau = torch.stack(taus).cpu()[act]
    acc = torch.stack(accs).cpu()[act]                          # (n, k-1)
    stats = dict(calls=calls, accept_lengths=tau.tolist(),
                 accept_rate=acc.float().mean(0).tolist() if k > 1 else [])
    return out[:, :total], stats


# ------------------------------------------------------------------------- loading drafters

def set_drafting(drafter, branches='sampled', verify='mixture', zt=None):
    """How a drafter drafts under sampling: 'sampled' from its q (DBlast: sampled branches) or
    'greedy' by argmax (DBlast: greedy branches); for DBlast also what the drafts are verified
    against ('mixture' or 'branch') and Z_T. Returns the drafter."""
    if hasattr(drafter, 'branches'):
        drafter.branches, drafter.verify = branches, verify
        if zt is not None:
            drafter.zt = zt
    else:
        drafter.sample_drafts = branches == 'sampled'
    return drafter


def load_drafter(path, target):
    """A BlockHeads or DBlastDrafter checkpoint, checked against the target it was trained for."""
    from heads import BlockHeads
    from dblast import DBlastDrafter
    ckpt = load_checkpoint(path)
    kind = ckpt.get('kind')
    if kind not in ('heads', 'dblast'):
        raise BadInput(f"{path} is not a drafter checkpoint (kind={kind!r}); "
                       f"use out/heads.pt or out/dblast_K4.pt")
    if ckpt.get('base_fingerprint') != target.fingerprint():
        raise BadInput(f"{path} was trained for another base model (fingerprint "
                       f"{ckpt.get('base_fingerprint')} != {target.fingerprint()}); retrain it")
    try:
        cfg = GPTConfig.from_dict(ckpt['model_args'])
        if kind == 'heads':
            drafter = BlockHeads(cfg, ckpt['k'], ckpt['d_hidden'])
        else:
            drafter = DBlastDrafter(cfg, ckpt['k'], ckpt['K'], ckpt['d_hidden'])
        drafter.load_state_dict(ckpt['drafter'])
    except Exception as e:  # missing fields, wrong shapes
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise BadInput(f"drafter checkpoint {path} is malformed ({first})")
    p = target.lm_head.weight
    return drafter.to(p.device, p.dtype).eval()


# ------------------------------------------------------------------------- CLI

def encode(text):
    return list(text.encode('utf-8'))


def decode_bytes(tokens):
    return bytes(int(t) for t in tokens).decode('utf-8', errors='replace')


def colour_blocks(tokens, taus, colour):
    """Text with each step's committed block in alternating colours (ANSI)."""
    if not colour:
        return decode_bytes(tokens)
    parts, i = [], 0
    for s, t in enumerate(taus):
        if i >= len(tokens):
            break
        code = '\033[30;46m' if s % 2 else '\033[30;43m'
        parts.append(code + decode_bytes(tokens[i:i + t]) + '\033[0m')
        i += t
    return ''.join(parts)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--ckpt', default='out/ckpt.pt', help='target checkpoint (ours or nanoGPT)')
    ap.add_argument('--prompt', default='def ', help='prompt text (UTF-8 bytes)')
    ap.add_argument('--max-new-tokens', type=int, default=200)
    ap.add_argument('--temperature', type=float, default=0.0, help='0 = greedy')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--heads', default=None, help='BPD heads checkpoint: blockwise parallel decoding')
    ap.add_argument('--drafter', default=None, help='DBlast drafter checkpoint')
    ap.add_argument('--k', type=int, default=None, help='block size (default: what the drafter was trained for)')
    ap.add_argument('--accept', default='exact', help="exact | topk:N | minblock:N (greedy only)")
    ap.add_argument('--zt', type=float, default=1.0, help='DBlast category temperature Z_T (0 = argmax branch)')
    ap.add_argument('--sample-drafts', action=argparse.BooleanOptionalAction, default=True,
                    help='under sampling, draw each draft from the drafter\'s q instead of its argmax '
                         '(DBlast: sampled branches)')
    ap.add_argument('--verify', default='mixture', choices=['mixture', 'branch'],
                    help="DBlast: verify against the mixture's conditionals, or the drawn branch's alone (ablation)")
    ap.add_argument('--no-color', action='store_true', help='plain text even on a terminal')
    ap.add_argument('--device', default=None, help='cpu | cuda | mps (default: best available)')
    ap.add_argument('--compile', action='store_true',
                    help='torch.compile the step (CUDA graphs on GPU); warm-up excluded from timing')
    run_cli(ap.parse_args(argv))


def pick_device(name=None):
    if name:
        return name
    if torch.cuda.is_available():
        return 'cuda'
    if getattr(torch.backends, 'mps', None) is not None and torch.backends.mps.is_available():
        return 'mps'
    return 'cpu'


def run_cli(args):
    if args.heads and args.drafter:
        raise BadInput("give --heads or --drafter, not both")
    device = pick_device(args.device)
    model = load_target(args.ckpt, device)
    if not args.prompt:
        raise BadInput("prompt is empty: give at least one character with --prompt")
    prompt = torch.tensor([encode(args.prompt)], dtype=torch.long, device=device)
    drafter = None
    if args.heads or args.drafter:
        drafter = load_drafter(args.heads or args.drafter, model)
        if args.zt < 0:
            raise BadInput(f"--zt {args.zt}: must be >= 0 (0 = argmax branch)")
        set_drafting(drafter, 'sampled' if args.sample_drafts else 'greedy', args.verify, args.zt)
    kw = dict(temperature=args.temperature, compile=args.compile)

    def gen(**extra):
        g = torch.Generator(device=device).manual_seed(args.seed)
        return timed_generate(model, prompt, args.max_new_tokens, **kw, **extra, generator=g)

    if drafter is None:
        check_args(model, prompt, args.max_new_tokens, None, 1, args.temperature, args.accept)
        gen()  # warm-up
        out, stats, dt = gen()
        print(decode_bytes(out[0].tolist()))
        print(f"\n--- {args.max_new_tokens} tokens in {dt:.3f}s: {args.max_new_tokens / dt:.1f} tokens/s, "
              f"{stats['calls']} calls")
        return
    spec = dict(drafter=drafter, k=args.k, accept=args.accept)
    gen(**spec)  # warm-up both paths so neither pays first-call costs in the timing
    gen()
    out, stats, dt = gen(**spec)
    _, base_stats, dt_base = gen()
    colour = sys.stdout.isatty() and not args.no_color
    T0 = prompt.size(1)
    print(decode_bytes(out[0, :T0].tolist()) + colour_blocks(out[0, T0:].tolist(), stats['accept_lengths'], colour))
    taus = stats['accept_lengths']
    plain = 'greedy' if args.temperature == 0 else 'sampling'
    print(f"\n--- k={args.k or drafter.k} accept={args.accept}: mean tau {sum(taus) / len(taus):.2f}, "
          f"{stats['calls']} calls (plain: {base_stats['calls']}), "
          f"{args.max_new_tokens / dt:.1f} tokens/s vs {args.max_new_tokens / dt_base:.1f} plain {plain}: "
          f"speedup {dt_base / dt:.2f}x")
    print("acceptance per draft position: " + " ".join(f"{a:.2f}" for a in stats['accept_rate']))


if __name__ == '__main__':
    run_script(main)
