"""
Train the target GPT, then its drafters, in stages:

  base    the target: a byte-level GPT on the standard library's .py files (or --data)
  heads   BPD k-offset heads (frozen target by default, --joint to fine-tune it too), on the
          target's own greedy continuations (sequence-level distillation, --no-distill for corpus text)
  dblast  DBlast dependent drafters (K = --K and the K = 1 baseline) on the target's own samples

    python train.py                         # everything, CPU preset in about 10 minutes
    python train.py --stages heads --k 4    # only the heads, on the existing out/ckpt.pt
    torchrun --nproc_per_node 2 train.py    # data parallel (NCCL on CUDA, gloo on CPU)

Each stage writes its own checkpoint atomically; --resume continues an interrupted stage and
skips finished ones.
"""
import argparse
import functools
import hashlib
import math
import os
import random
import sysconfig
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
from tqdm import tqdm

from dblast import DBlastDrafter, expected_accepted
from decode import generate, pick_device
from heads import BlockHeads
from model import GPT, BadInput, GPTConfig, load_checkpoint, load_target, run_script, save_checkpoint

# Presets, picked by device. CPU: the whole `python train.py` in about 10 minutes on 2 cores.
PRESETS = {
    'cpu': dict(n_layer=4, n_head=4, n_embd=128, block_size=256, batch_size=16, max_iters=1300,
                lr=2e-3, warmup_iters=100, eval_interval=250, eval_iters=20,
                heads_iters=400, distill_samples=256, dblast_iters=3000, dblast_samples=1024,
                dblast_eval_samples=32),
    'gpu': dict(n_layer=6, n_head=6, n_embd=384, block_size=512, batch_size=64, max_iters=3000,
                lr=1e-3, warmup_iters=200, eval_interval=500, eval_iters=50,
                heads_iters=1500, distill_samples=4096, dblast_iters=3000, dblast_samples=4096,
                dblast_eval_samples=64),
}
PROMPT_LEN = 32       # corpus prompt in front of each generated training sequence


# ----------------------------------------------------------------------------- data

def corpus_files(path=None):
    """The default corpus: the interpreter's standard library .py files, sorted, without
    site-packages and test folders. With a path: that text file, or every file under that folder."""
    if path is None:
        root = sysconfig.get_paths()['stdlib']
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ('site-packages', 'dist-packages', 'test', 'tests',
                                                            'idle_test', '__pycache__'))
            files += [os.path.join(d, n) for n in names if n.endswith('.py')]
        return sorted(files)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
    raise BadInput(f"--data {path}: no such file or folder")


def load_corpus(data, out_dir):
    """(train, val) uint8 arrays of bytes, cached under out_dir/data. Held-out split by file: every
    20th file (a single file: its last 10%)."""
    files = corpus_files(data)
    # the cache key names the files and their sizes and dates: edit the corpus, get a new cache
    h = hashlib.sha1()
    for f in files:
        st = os.stat(f)
        h.update(f'{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}\n'.encode())
    key = ('stdlib' if data is None else 'data') + '-' + h.hexdigest()[:12]
    cache = os.path.join(out_dir, 'data')
    paths = [os.path.join(cache, f'{key}_{s}.bin') for s in ('train', 'val')]
    if all(os.path.exists(p) for p in paths):
        return tuple(np.fromfile(p, dtype=np.uint8) for p in paths)
    texts = []
    for f in files:
        with open(f, 'rb') as fh:
            b = fh.read()
        if b and b'\0' not in b[:4096]:  # skip binaries
            texts.append(b)
    if not texts or sum(map(len, texts)) < 1024:
        raise BadInput(f"--data {data}: holds no text (need at least 1 KiB of text files)")
    if len(texts) == 1:
        cut = int(len(texts[0]) * 0.9)
        train, val = texts[0][:cut], texts[0][cut:]
    else:
        train = b''.join(t for i, t in enumerate(texts) if i % 20 != 19)
        val = b''.join(t for i, t in enumerate(texts) if i % 20 == 19) or texts[-1]
    os.makedirs(cache, exist_ok=True)
    arrays = (np.frombuffer(train, dtype=np.uint8), np.frombuffer(val, dtype=np.uint8))
    for arr, p in zip(arrays, paths):
        tmp = f'{p}.{os.getpid()}.tmp'
        arr.tofile(tmp)
        os.replace(tmp, p)
    return arrays


def windows(data, n, length, gen):
    """n random windows (n, length) of a uint8 array, as a LongTensor."""
    ix = torch.randint(len(data) - length, (n,), generator=gen).numpy()
    return torch.from_numpy(np.stack([data[i:i + length] for i in ix]).astype(np.int64))


def heldout_prompts(val, n, length, seed=1234):
    """n held-out prompts that start at a line start: the same ones for every comparison."""
    starts = np.flatnonzero(val[:-length - 1] == ord('\n')) + 1
    if len(starts) < n:  # text with few lines: any position will do
        starts = np.arange(len(val) - length)
    rng = np.random.default_rng(seed)
    ix = rng.choice(starts, size=n, replace=False)
    return torch.from_numpy(np.stack([val[i:i + length] for i in ix]).astype(np.int64))


# ----------------------------------------------------------------------------- runtime

class Runtime:
    """Device, precision and the DDP process group (torchrun sets RANK / WORLD_SIZE)."""

    def __init__(self, device=None, seed=1337):
        self.ddp = int(os.environ.get('RANK', -1)) != -1
        if self.ddp:
            import torch.distributed as dist
            self.rank = int(os.environ['RANK'])
            self.world = int(os.environ['WORLD_SIZE'])
            local = int(os.environ.get('LOCAL_RANK', 0))
            use_cuda = torch.cuda.is_available() and device != 'cpu'
            dist.init_process_group(backend='nccl' if use_cuda else 'gloo')
            self.device = f'cuda:{local}' if use_cuda else 'cpu'
            if use_cuda:
                torch.cuda.set_device(self.device)
        else:
            self.rank, self.world = 0, 1
            self.device = pick_device(device)
        self.master = self.rank == 0
        self.kind = 'cuda' if 'cuda' in self.device else self.device
        if self.kind == 'cuda':
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        bf16 = self.kind == 'cuda' and torch.cuda.is_bf16_supported()
        self.autocast = torch.autocast('cuda', dtype=torch.bfloat16) if bf16 else nullcontext()
        torch.manual_seed(seed + self.rank)
        self.gen = torch.Generator().manual_seed(seed + self.rank)  # batch sampling, per rank

    def rng_states(self):
        """Every rank's RNG states (batch sampler and torch), so a resumed DDP run gives each
        rank its own stream back."""
        mine = (self.gen.get_state(), torch.get_rng_state())
        states = [mine]
        if self.ddp:
            import torch.distributed as dist
            states = [None] * self.world
            dist.all_gather_object(states, mine)
        return dict(gen=[s[0] for s in states], torch=[s[1] for s in states])

    def print(self, *a):
        if self.master:
            tqdm.write(' '.join(str(x) for x in a))


def lr_at(it, lr, warmup, total):
    """Linear warmup, then cosine decay to lr/10."""
    if it < warmup:
        return lr * (it + 1) / warmup
    ratio = min(1.0, (it - warmup) / max(1, total - warmup))
    return lr / 10 + 0.5 * (1 + math.cos(math.pi * ratio)) * (lr - lr / 10)


def make_optimizer(module, lr, weight_decay, device_kind):
    """AdamW; decay only matrices (not biases, LayerNorm weights)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device_kind == 'cuda')


def train_loop(rt, args, name, objective, batch_fn, iters, lr, save, resume=None, evaluate=None,
               tokens_per_step=0, eval_name='held-out loss'):
    """The loop every stage shares: AdamW, warmup + cosine, clipping, tqdm, periodic atomic
    checkpoints. objective(*batch) -> loss trains whatever parameters require grad.
    evaluate(step) -> a float, printed as `eval_name` every eval_interval steps and at the end.
    save(optimizer_state, iter_num, rng_states) writes the stage's checkpoint (rank 0 only)."""
    model = objective
    if rt.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(objective, device_ids=[int(rt.device.split(':')[1])] if rt.kind == 'cuda' else None)
    opt = make_optimizer(objective, lr, args.weight_decay, rt.kind)
    start = 0
    if resume is not None:
        opt.load_state_dict(resume['optimizer'])
        start = resume['iter_num']
        gens = resume['rng']['gen']      # one batch-sampling state per rank
        if len(gens) == rt.world:
            rt.gen.set_state(gens[rt.rank])
            torch.set_rng_state(resume['rng']['torch'][rt.rank])
    step = torch.compile(model) if args.compile else model
    bar = tqdm(range(start, iters), desc=name, disable=not rt.master, dynamic_ncols=True,
               initial=start, total=iters)
    t0, loss_val = time.perf_counter(), float('nan')
    for it in bar:
        for g in opt.param_groups:
            g['lr'] = lr_at(it, lr, args.warmup_iters, iters)
        batch = batch_fn()
        with rt.autocast:
            loss = step(*batch)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(objective.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it % 10 == 0 or it == iters - 1:
            loss_val = loss.item()
            dt = time.perf_counter() - t0
            t0 = time.perf_counter()
            tps = tokens_per_step * rt.world * (10 if it > start else 1) / max(dt, 1e-9)
            bar.set_postfix(loss=f'{loss_val:.3f}', lr=f'{opt.param_groups[0]["lr"]:.1e}',
                            **({'tok/s': f'{tps:.0f}'} if tokens_per_step else {}))
        done = it + 1 == iters
        if evaluate is not None and ((it + 1) % args.eval_interval == 0 or done):
            rt.print(f"{name} step {it + 1}: train loss {loss_val:.4f}, {eval_name} {evaluate(it + 1):.4f}")
        if (it + 1) % args.ckpt_interval == 0 or done:
            rng = rt.rng_states()   # collective under DDP: every rank takes part
            if rt.master:
                save(opt.state_dict(), it + 1, rng)
    bar.close()
    return loss_val


def resume_state(args, path, expect):
    """The checkpoint to resume from (None: start fresh). `expect`: fields that must match."""
    if not args.resume or not os.path.exists(path):
        return None
    ckpt = load_checkpoint(path)
    for key, want in expect.items():
        if ckpt.get(key) != want:
            raise BadInput(f"--resume: {path} has {key}={ckpt.get(key)} but this run asks for {want}; "
                           f"use the same flags or another --out-dir")
    return ckpt


# ----------------------------------------------------------------------------- stage 1: base

class LMObjective(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x, y)[1]


@torch.no_grad()
def heldout_loss(model, val, batch_size, n_batches, autocast=nullcontext()):
    """Mean next-byte cross-entropy (nats per byte) on fixed held-out windows of full context."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(0)
    device = model.lm_head.weight.device
    losses = []
    for _ in range(n_batches):
        w = windows(val, batch_size, model.config.block_size + 1, gen).to(device)
        with autocast:
            losses.append(model(w[:, :-1], w[:, 1:])[1].float().item())
    model.train(was_training)
    return float(np.mean(losses))


def stage_base(rt, args, train, val):
    path = os.path.join(args.out_dir, 'ckpt.pt')
    model_args = {k: getattr(args, k) for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'dropout', 'bias')}
    model_args['vocab_size'] = 256
    resume = resume_state(args, path, dict(model_args=model_args))
    if resume is not None and resume['iter_num'] >= args.max_iters:
        rt.print(f"base: {path} already trained for {resume['iter_num']} steps; skipping")
        return load_target(path, rt.device)
    model = GPT(GPTConfig(**model_args)) if resume is None else GPT.from_checkpoint(resume)
    model.to(rt.device).train()
    rt.print(f"base: {model.get_num_params() / 1e6:.2f}M parameters on {rt.device}, "
             f"{len(train) / 1e6:.1f}M training bytes, {len(val) / 1e6:.2f}M held-out")
    B, T = args.batch_size, args.block_size

    def batch():
        w = windows(train, B, T + 1, rt.gen).to(rt.device, non_blocking=True)
        return w[:, :-1], w[:, 1:]

    def save(opt_state, it, rng):
        save_checkpoint(dict(model=model.state_dict(), model_args=model_args, optimizer=opt_state,
                             iter_num=it, best_val_loss=None, config=vars(args), rng=rng), path)

    t0 = time.perf_counter()
    train_loop(rt, args, 'base', LMObjective(model), batch, args.max_iters, args.lr, save, resume,
               evaluate=lambda it: heldout_loss(model, val, B, args.eval_iters, rt.autocast), tokens_per_step=B * T)
    rt.print(f"base: done in {time.perf_counter() - t0:.0f}s -> {path}")
    if rt.ddp:  # proof that data parallelism kept the replicas identical
        print(f"rank {rt.rank} weights {model.fingerprint()}", flush=True)
    return model.eval()


# ----------------------------------------------------------------------------- stage 2: heads

@torch.no_grad()
def self_generated(rt, model, train, n, gen_len, temperature, seed, desc, cache_dir=None):
    """Corpus prompts continued by the target itself: (n, PROMPT_LEN + gen_len) tokens.
    temperature 0: greedy (BPD's sequence-level distillation); > 0: samples (DBlast's data).
    With cache_dir, kept there under a key of everything that determines them (the target's
    weights, the text, n, the length, T, the seed): stages and bench runs that need the same
    samples generate them once."""
    key = hashlib.sha1(f'{model.fingerprint()} {len(train)} {n} {gen_len} {temperature} {seed}'.encode())
    key.update(np.ascontiguousarray(train[:1 << 20]).tobytes())
    path = cache_dir and os.path.join(cache_dir, f'samples-{key.hexdigest()[:16]}.pt')
    if path and os.path.exists(path):
        return torch.load(path, weights_only=True).to(rt.device)
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=rt.device).manual_seed(seed)
    prompts = windows(train, n, PROMPT_LEN, gen).to(rt.device)
    bs = 256 if rt.kind == 'cuda' else 64
    outs = []
    for i in tqdm(range(0, n, bs), desc=desc, disable=not rt.master, leave=False):
        with rt.autocast:
            out, _ = generate(model, prompts[i:i + bs], gen_len, temperature=temperature, generator=dgen)
        outs.append(out)
    seqs = torch.cat(outs)
    if path and rt.master:
        os.makedirs(cache_dir, exist_ok=True)
        save_checkpoint(seqs.cpu(), path)
    return seqs


class HeadsObjective(nn.Module):
    """BPD heads loss on token sequences; frozen target (only heads learn) or joint fine-tuning
    (target's own next-token loss plus the heads' loss)."""

    def __init__(self, model, heads, joint):
        super().__init__()
        self.model, self.heads, self.joint = model, heads, joint
        for p in model.parameters():
            p.requires_grad_(joint)

    def forward(self, tokens, targets, offset=None):
        """offset: the random-offset loss's head, a 0-dim tensor drawn with the batch (outside a
        compiled step: as a Python int each value would compile a graph of its own)."""
        T = tokens.size(1) - self.heads.k            # positions with a target for every head
        with nullcontext() if self.joint else torch.no_grad():
            h = self.model.hidden(tokens[:, :T])
        loss = self.heads.loss(h, self.model.lm_head, targets, offset)
        if self.joint:
            lm = self.model.lm_head(h).float()
            loss = loss + nn.functional.cross_entropy(lm.flatten(0, 1), targets[:, 1:T + 1].flatten(),
                                                      ignore_index=-1)
        return loss


def stage_heads(rt, args, model, train):
    path = os.path.join(args.out_dir, f'heads{args.tag}.pt')
    fp = model.fingerprint()
    resume = resume_state(args, path, dict(k=args.k, trained_from=fp, joint=args.joint))
    if resume is not None and resume['iter_num'] >= args.heads_iters:
        rt.print(f"heads: {path} already trained; skipping")
        if args.joint:
            model.load_state_dict(resume['joint_model'])
        from decode import load_drafter
        return load_drafter(path, model)
    if args.distill:
        seqs = self_generated(rt, model, train, args.distill_samples, args.block_size - PROMPT_LEN,
                              0.0, args.seed, 'distill (greedy continuations)', os.path.join(args.out_dir, 'data'))
        targets = seqs.clone()
        targets[:, :PROMPT_LEN] = -1     # only the target's own output is a training target
    heads = BlockHeads(model.config, args.k, args.d_hidden)
    if resume is not None:
        heads.load_state_dict(resume['drafter'])
        if args.joint:
            model.load_state_dict(resume['joint_model'])
    heads.to(rt.device).train()
    model.train() if args.joint else model.eval()
    B, S = args.batch_size, args.block_size

    def batch():
        offset = None
        if args.loss == 'random-offset':
            offset = torch.tensor(random.randrange(args.k - 1), device=rt.device)
        if args.distill:
            ix = torch.randint(len(seqs), (B,), generator=rt.gen)
            return seqs[ix], targets[ix], offset
        w = windows(train, B, S, rt.gen).to(rt.device)
        return w, w, offset

    def save(opt_state, it, rng):
        # base_fingerprint: the target these heads run on (the fine-tuned one when joint)
        save_checkpoint(dict(kind='heads', drafter=heads.state_dict(), k=args.k, d_hidden=heads.d_hidden,
                             model_args=vars(model.config), joint=args.joint, trained_from=fp,
                             base_fingerprint=model.fingerprint() if args.joint else fp,
                             joint_model=model.state_dict() if args.joint else None,
                             optimizer=opt_state, iter_num=it, rng=rng, config=vars(args)), path)

    rt.print(f"heads: k={args.k}, {'joint' if args.joint else 'frozen'} target, {args.loss} loss, "
             f"{'distilled' if args.distill else 'corpus'} data")
    train_loop(rt, args, 'heads', HeadsObjective(model, heads, args.joint), batch,
               args.heads_iters, args.heads_lr, save, resume, tokens_per_step=B * (S - args.k))
    if args.joint and rt.master:  # the fine-tuned target is a model of its own: save it beside
        jpath = os.path.join(args.out_dir, f'ckpt_joint{args.tag}.pt')
        save_checkpoint(dict(model=model.state_dict(), model_args=vars(model.config)), jpath)
        rt.print(f"heads: joint target -> {jpath} (decode with --ckpt {jpath} --heads {path})")
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return heads.eval()


# ----------------------------------------------------------------------------- stage 3: DBlast

@torch.no_grad()
def dblast_data(rt, model, text, n, temperature, seed, desc, cache_dir=None):
    """The target's own samples at `temperature` after corpus prompts (DBlast: self-distillation at
    temperature T), with the frozen target's hidden states and the log-probabilities of what it
    sampled: seqs (n, S), H (n, S, C), LP (n, S-1) with LP[:, t] = log p_T(seqs[t+1] | seqs[<=t])."""
    seqs = self_generated(rt, model, text, n, model.config.block_size - PROMPT_LEN, temperature, seed, desc,
                          cache_dir)
    hs, lps = [], []
    for i in range(0, len(seqs), 64):
        s = seqs[i:i + 64]
        with rt.autocast:
            h = model.hidden(s)
            logp = torch.log_softmax(model.lm_head(h).float() / temperature, -1)
        hs.append(h.float())
        lps.append(logp[:, :-1].gather(-1, s[:, 1:, None]).squeeze(-1))
    return seqs, torch.cat(hs), torch.cat(lps)


def anchors(data, k, r, t):
    """Training / evaluation anchors of dblast_data at rows r, positions t (both (N,)): h after s[t],
    the bonus s[t+1], the k-1 drafts' targets s[t+2 .. t+k] and their target log-probabilities.
    Valid t: PROMPT_LEN - 1 <= t < S - k (the bonus is sampled, the whole block fits)."""
    seqs, H, LP = data
    offs = torch.arange(k - 1, device=seqs.device)
    return H[r, t], seqs[r, t + 1], seqs[r[:, None], t[:, None] + 2 + offs], LP[r[:, None], t[:, None] + 1 + offs]


@torch.no_grad()
def expected_tau(drafter, model, data, k, temperature, branches, verify, zt=1.0, chunk=2048):
    """Exact expected tau (bonus included) at every anchor of held-out target samples, by the
    acceptance-length identity (dblast.expected_accepted): the cheap, low-variance measure of a
    drafter's acceptance. Decoding measures the same in expectation, plus the speed."""
    seqs = data[0]
    lo, hi = PROMPT_LEN - 1, seqs.size(1) - k
    r = torch.arange(len(seqs), device=seqs.device).repeat_interleave(hi - lo)
    t = torch.arange(lo, hi, device=seqs.device).repeat(len(seqs))
    total = 0.0
    for i in range(0, len(r), chunk):
        h, bonus, x, log_px = anchors(data, k, r[i:i + chunk], t[i:i + chunk])
        total += float(expected_accepted(drafter, h.to(model.lm_head.weight.dtype), bonus, model, x, log_px,
                                         temperature, branches, verify, zt).sum())
    return 1 + total / len(r)


def dblast_path(args, K):
    return os.path.join(args.out_dir, f'dblast_K{K}{args.tag}.pt')


def dblast_drafters(args):
    """(K, loss) of the drafters the dblast stage trains: --K with --dblast-loss, and the K = 1
    baseline with --baseline-loss."""
    baseline = args.K != 1 and args.baseline_loss != 'none'
    return [(args.K, args.dblast_loss)] + ([(1, args.baseline_loss)] if baseline else [])


class DBlastObjective(nn.Module):
    def __init__(self, model, drafter, args, kind):
        super().__init__()
        self.model, self.drafter, self.args, self.kind = model, drafter, args, kind

    def forward(self, h, bonus, x, log_px):
        a = self.args
        return self.drafter.loss(h, bonus, self.model, x, log_px, a.temperature, self.kind,
                                 a.tau_threshold, a.nll_weight)


def stage_dblast(rt, args, model, get_data, get_heldout, K, loss, path):
    """One DBlast drafter (K branches, trained with `loss`) on the target's samples at
    --temperature. Every eval_interval steps: its exact expected tau on held-out target samples,
    with sampled branches and mixture verification (what the AL loss trains for); the curve is kept
    in the checkpoint ('history')."""
    fp = model.fingerprint()
    k = args.dblast_k
    resume = resume_state(args, path, dict(K=K, k=k, base_fingerprint=fp, loss=loss,
                                           temperature=args.temperature))
    if resume is not None and resume['iter_num'] >= args.dblast_iters:
        rt.print(f"dblast: {path} already trained; skipping")
        return
    data = get_data()
    drafter = DBlastDrafter(model.config, k, K, args.d_hidden)
    history = []
    if resume is not None:
        drafter.load_state_dict(resume['drafter'])
        history = resume.get('history', [])
    drafter.to(rt.device).train()
    lo, hi = PROMPT_LEN - 1, data[0].size(1) - k          # anchors t in [lo, hi), see anchors()
    B = args.batch_size * 8

    def batch():
        r = torch.randint(len(data[0]), (B,), generator=rt.gen).to(rt.device)
        t = torch.randint(lo, hi, (B,), generator=rt.gen).to(rt.device)
        return anchors(data, k, r, t)

    def evaluate(it):
        tau = expected_tau(drafter, model, get_heldout(), k, args.temperature, 'sampled', 'mixture')
        history.append((it, tau))
        return tau

    def save(opt_state, it, rng):
        save_checkpoint(dict(kind='dblast', drafter=drafter.state_dict(), k=k, K=K,
                             d_hidden=drafter.block.d_hidden, model_args=vars(model.config),
                             base_fingerprint=fp, loss=loss, temperature=args.temperature, history=history,
                             optimizer=opt_state, iter_num=it, rng=rng, config=vars(args)), path)

    rt.print(f"dblast: K={K}, k={k}, {loss} loss, T={args.temperature}")
    train_loop(rt, args, f'dblast K={K}', DBlastObjective(model, drafter, args, loss), batch,
               args.dblast_iters, args.dblast_lr, save, resume, evaluate=evaluate if rt.master else None,
               eval_name='held-out expected tau')
    return drafter.eval()


# ----------------------------------------------------------------------------- demos

def demo(rt, args, model, prompts, drafter, k, temperature, label, max_new=128):
    """tau and wall-clock speedup over plain decoding of the same model and prompts, one request
    at a time (latency, as the papers measure it), timed in the same run."""
    from decode import timed_generate

    def run(**extra):  # -> outputs, stats of every prompt, seconds in all
        g = torch.Generator(device=rt.device).manual_seed(0)
        runs = [timed_generate(model, p[None], max_new, temperature=temperature, generator=g, **extra)
                for p in prompts]
        return torch.cat([r[0] for r in runs]), [r[1] for r in runs], sum(r[2] for r in runs)
    run(drafter=drafter, k=k)  # warm-up, both paths
    run()
    out, stats, dt = run(drafter=drafter, k=k)
    base, _, dt0 = run()
    taus = [t for s in stats for t in s['accept_lengths']]
    calls = sum(s['calls'] for s in stats)
    same = (out == base).all().item() if temperature == 0 else None
    rt.print(f"{label}: mean tau {np.mean(taus):.2f} at k={k}, {calls} calls for {len(prompts)} prompts "
             f"x {max_new} tokens (plain: {len(prompts) * (max_new + 1)}), speedup {dt0 / dt:.2f}x"
             + ('' if same is None else f", identical to greedy: {same}"))
    return out


def run_demos(rt, args, model, heads, val):
    prompts = heldout_prompts(val, 8, PROMPT_LEN).to(rt.device)
    if heads is not None:
        rt.print("\n=== blockwise parallel decoding, held-out prompts, greedy")
        out = demo(rt, args, model, prompts, heads, args.k, 0.0, "BPD heads")
        text = bytes(out[0].tolist()).decode('utf-8', errors='replace')
        rt.print(f"--- sample ---\n{text}\n--------------")
    drafters = dblast_drafters(args)
    if 'dblast' in args.stages and all(os.path.exists(dblast_path(args, K)) for K, _ in drafters):
        from decode import load_drafter
        rt.print(f"\n=== speculative sampling at T={args.temperature}, held-out prompts: the dependent "
                 f"drafter against the independent one (sampled drafts, mixture verification)")
        for K, loss in drafters:
            d = load_drafter(dblast_path(args, K), model)
            demo(rt, args, model, prompts, d, args.dblast_k, args.temperature,
                 f"DBlast K={K} ({loss})" if K > 1 else f"independent K=1 ({loss})")


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a('--data', default=None, help='text file or folder of text files (default: the stdlib .py files)')
    a('--out-dir', default='out')
    a('--stages', default='base,heads,dblast', help='comma list of base, heads, dblast')
    a('--preset', default='auto', choices=['auto', 'cpu', 'gpu'], help='defaults by device')
    a('--device', default=None, help='cpu | cuda | mps (default: best available)')
    a('--compile', action='store_true', help='torch.compile the training step')
    a('--resume', action='store_true', help='continue interrupted stages, skip finished ones')
    a('--seed', type=int, default=1337)
    a('--tag', default='', help='suffix of the drafter checkpoint names (heads{tag}.pt, dblast_K4{tag}.pt)')
    g = ap.add_argument_group('model (default: preset)')
    for name in ('n_layer', 'n_head', 'n_embd', 'block_size'):
        g.add_argument('--' + name.replace('_', '-'), type=int, default=None)
    g.add_argument('--dropout', type=float, default=0.0)
    g.add_argument('--bias', action=argparse.BooleanOptionalAction, default=True)
    g = ap.add_argument_group('base training (default: preset)')
    for name, typ in (('batch_size', int), ('max_iters', int), ('lr', float), ('warmup_iters', int),
                      ('eval_interval', int), ('eval_iters', int)):
        g.add_argument('--' + name.replace('_', '-'), type=typ, default=None)
    g.add_argument('--weight-decay', type=float, default=0.1)
    g.add_argument('--grad-clip', type=float, default=1.0)
    g.add_argument('--ckpt-interval', type=int, default=250)
    g = ap.add_argument_group('BPD heads')
    g.add_argument('--k', type=int, default=8, help='block size: 1 bonus + k-1 drafted tokens')
    g.add_argument('--d-hidden', type=int, default=None, help='hidden width per head (default n_embd)')
    mode = g.add_mutually_exclusive_group()
    mode.add_argument('--frozen', dest='joint', action='store_false', help='train only the heads (default)')
    mode.add_argument('--joint', dest='joint', action='store_true', help='fine-tune the target too')
    g.set_defaults(joint=False)
    g.add_argument('--loss', default='random-offset', choices=['random-offset', 'full'])
    g.add_argument('--distill', action=argparse.BooleanOptionalAction, default=True,
                   help="train on the target's own greedy continuations (default on)")
    g.add_argument('--heads-iters', type=int, default=None)
    g.add_argument('--heads-lr', type=float, default=1e-3)
    g.add_argument('--distill-samples', type=int, default=None)
    g = ap.add_argument_group('DBlast')
    g.add_argument('--K', type=int, default=4, help='latent branches (the K=1 baseline is trained too)')
    g.add_argument('--dblast-k', type=int, default=4, help='block size of the DBlast drafters')
    g.add_argument('--dblast-loss', default='al', choices=['al', 'al-branch', 'nll'],
                   help="al: acceptance-length surrogate on the mixture's conditionals (default); "
                        "al-branch: on branch-conditional acceptance (ablation); nll: mixture NLL")
    g.add_argument('--baseline-loss', default='nll', choices=['al', 'al-branch', 'nll', 'none'],
                   help='loss of the K=1 baseline (default nll: the independent drafter DBlast compares with; '
                        'none: no baseline)')
    g.add_argument('--tau-threshold', type=float, default=0.01, help='AL surrogate: keep prefixes with a_j >= log tau')
    g.add_argument('--nll-weight', type=float, default=0.2,
                   help='weight of the mixture NLL added to the AL loss (keeps every branch learning)')
    g.add_argument('--temperature', type=float, default=1.5, help='sampling temperature of the training blocks')
    g.add_argument('--dblast-iters', type=int, default=None)
    g.add_argument('--dblast-lr', type=float, default=3e-3)
    g.add_argument('--dblast-samples', type=int, default=None, help='target samples to train on')
    g.add_argument('--dblast-eval-samples', type=int, default=None,
                   help='held-out target samples for the expected-tau evaluation')
    g.add_argument('--no-demo', action='store_true', help='skip the closing demos')
    args = ap.parse_args(argv)
    preset = args.preset
    if preset == 'auto':
        preset = 'gpu' if pick_device(args.device) == 'cuda' else 'cpu'
    for key, v in PRESETS[preset].items():
        if getattr(args, key) is None:
            setattr(args, key, v)
    args.preset = preset
    args.stages = [s.strip() for s in args.stages.split(',') if s.strip()]
    bad = set(args.stages) - {'base', 'heads', 'dblast'}
    if bad:
        raise BadInput(f"--stages: unknown {sorted(bad)}; allowed: base, heads, dblast")
    if args.k < 2 or args.dblast_k < 2:
        raise BadInput(f"--k {args.k} / --dblast-k {args.dblast_k}: block sizes must be >= 2")
    if args.K < 1:
        raise BadInput(f"--K {args.K}: must be >= 1")
    if args.temperature <= 0:
        raise BadInput(f"--temperature {args.temperature}: DBlast trains on samples, use > 0")
    if args.n_embd % args.n_head:
        raise BadInput(f"--n-embd {args.n_embd} is not divisible by --n-head {args.n_head}")
    return args


def main(argv=None):
    args = parse_args(argv)
    rt = Runtime(args.device, args.seed)
    random.seed(args.seed + rt.rank)
    os.makedirs(args.out_dir, exist_ok=True)
    train, val = load_corpus(args.data, args.out_dir)
    if len(train) <= args.block_size + 1 or len(val) <= args.block_size + 1:
        raise BadInput(f"--data: too little text for --block-size {args.block_size}")
    rt.print(f"preset {args.preset} on {rt.device}" + (f", {rt.world} processes" if rt.ddp else ""))
    t_start = time.perf_counter()
    base_path = os.path.join(args.out_dir, 'ckpt.pt')
    if 'base' in args.stages:
        model = stage_base(rt, args, train, val)
    else:
        model = load_target(base_path, rt.device)
        args.block_size = model.config.block_size
    for p in model.parameters():
        p.requires_grad_(False)
    heads = None
    if 'heads' in args.stages:
        heads = stage_heads(rt, args, model, train)
    if 'dblast' in args.stages:
        # generated on first need (cached): a resumed run may have nothing left to train
        T, n, n_val = args.temperature, args.dblast_samples, args.dblast_eval_samples
        cache = os.path.join(args.out_dir, 'data')
        get_data = functools.cache(lambda: dblast_data(rt, model, train, n, T, args.seed + 1,
                                                       f'dblast data ({n} samples at T={T})', cache))
        get_heldout = functools.cache(lambda: dblast_data(rt, model, val, n_val, T, args.seed + 2,
                                                          f'held-out samples at T={T}', cache))
        for K, loss in dblast_drafters(args):
            stage_dblast(rt, args, model, get_data, get_heldout, K, loss, dblast_path(args, K))
    rt.print(f"\ntraining done in {time.perf_counter() - t_start:.0f}s")
    if rt.master and not args.no_demo:
        run_demos(rt, args, model, heads, val)
    if rt.ddp:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == '__main__':
    run_script(main)
