"""
Train the target GPT, then its drafters, in stages:

  base    the target: a byte-level GPT on the standard library's .py files, or on --data (a text
          file or folder, or a nanoGPT dataset folder: train.bin / val.bin, meta.pkl)
  heads   BPD k-offset heads (frozen target by default, --joint to fine-tune it too), on the
          target's own greedy continuations (sequence-level distillation, --no-distill for corpus text).
          --joint saves the fine-tuned target as ckpt_joint.pt; the stages after it in the same run
          train for that target, not ckpt.pt's, and the demos decode with it
  dblast  DBlast dependent drafters (K = --branches and the K = 1 baseline) on the target's own samples
  draft   a small draft model (a GPT of --draft-layers) for generate.py --draft-model; only when asked

    python train.py                         # base, heads, dblast (CPU preset: 3 to 5 min on 2 cores, README)
    python train.py --stages heads --k 4    # only the heads, on the existing out/ckpt.pt
    torchrun --nproc_per_node 2 train.py    # data parallel (NCCL on CUDA, gloo on CPU)

Each stage writes its own checkpoint atomically; --resume continues an interrupted stage and
skips finished ones.
"""
import os
import signal
import sys

if __name__ == '__main__' and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    # Ctrl-C while the imports below load (seconds on a busy machine): the one line cli.run_script
    # prints later too, not a traceback from inside torch's import
    signal.signal(signal.SIGINT, lambda *_: (sys.stderr.write('\ninterrupted\n'), os._exit(130)))

import argparse
import functools
import hashlib
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn

from cli import (BadInput, check_compiler, check_replaceable, decoding_precision, intra_op_threads, pick_device,
                 run_script)
from data import (DEMO_PROMPTS, PROMPT_LEN, Vocab, check_fits, check_out_dir, heldout_prompts,
                  load_checkpoint, load_dataset, newline_id, save_checkpoint, target_from, vocab_for, weight_count,
                  windows)
from dblast import DBlastDrafter, TargetSamples, contexts, expected_tau
from decode import generate
from drafters import load_drafter
from generate import closing_demos
from heads import BlockHeads
from model import GPT, GPTConfig
from trainer import Runtime, load_weights, parse_flags, progress, resume_state, train_loop

# Presets, picked by device. CPU: the whole `python train.py` in about 5 minutes on a 2-core AMD
# EPYC (README); a 3-layer target at a high learning rate, 800 steps: on 2 cores every step costs
# its FLOPs (a compiled step is no faster there), so the preset spends them where the closing demos
# need them (heads tau at k = 8 above 5.5, DBlast K = 4 above K = 1). The heads learn more from 512
# distinct greedy continuations than from 256 (README, "Use": tau 5.65 against 5.48 at k = 8).
PRESETS = {
    'cpu': dict(n_layer=3, n_head=4, n_embd=128, block_size=256, batch_size=16, max_iters=800,
                lr=4e-3, warmup_iters=100, eval_interval=250, eval_iters=10,
                heads_iters=400, heads_lr=3e-3, distill_samples=512, dblast_iters=1200, dblast_samples=1024,
                dblast_eval_samples=32, draft_iters=800, draft_lr=4e-3),
    # every checkpoint `python -m exercises try N` reads, from a smaller target, in about a minute
    # on the same machine (README). Its heads at the CPU preset's lr: at edb836d, 150 steps at 1e-3
    # gave tau 5.58 at k = 8 (a 32-node tree 6.25), 600 at 3e-3 6.12 (7.03), 5 s more on a Xeon
    'quick': dict(n_layer=2, n_head=2, n_embd=64, block_size=256, batch_size=16, max_iters=400,
                  lr=3e-3, warmup_iters=40, eval_interval=200, eval_iters=10,
                  heads_iters=600, heads_lr=3e-3, distill_samples=64, dblast_iters=400, dblast_samples=128,
                  dblast_eval_samples=16, draft_iters=400, draft_lr=3e-3),
    # one H100/H200-class GPU (README, "One GPU"). On one H200 at 22d3d40: the target 52 s; a heads step
    # 3.9 ms (frozen target, its states made once), 12,000 of them at 3e-3 reached tau 3.07 at k = 8,
    # no more than 1,500 at 1e-3 had (3.13): the target's continuations, not the heads' steps, limit
    # them; a DBlast step 8.3 ms at K = 4 and 5.8 ms at K = 1 (held-out expected tau 2.18 and 2.09
    # after 3,000 steps, 2.21 and 2.12 after 4,000); the greedy and the sampled data 29 s and 42 s
    'gpu': dict(n_layer=6, n_head=6, n_embd=384, block_size=512, batch_size=64, max_iters=3000,
                lr=1e-3, warmup_iters=200, eval_interval=500, eval_iters=50,
                heads_iters=3000, heads_lr=3e-3, distill_samples=4096, dblast_iters=3000, dblast_samples=4096,
                dblast_eval_samples=64, draft_iters=3000, draft_lr=1e-3),
}


# ----------------------------------------------------------------------------- stage 1: base

class LMObjective(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(x, y)[1]


@torch.no_grad()
def heldout_loss(model, val, batch_size, n_batches, precision=nullcontext()):
    """Mean next-token cross-entropy (nats per token: per byte for the byte vocabulary) on fixed
    held-out windows of full context."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(0)
    device = model.lm_head.weight.device
    losses = []
    for _ in range(n_batches):
        w = windows(val, batch_size, model.config.block_size + 1, gen).to(device)
        with precision:
            losses.append(model(w[:, :-1], w[:, 1:])[1].float().item())
    model.train(was_training)
    return float(np.mean(losses))


def stage_base(rt, args, ds, vocab, name='base', path=None, train=None, record=None):
    """The target, on ds.train; its vocabulary is recorded in the checkpoint. stage_draft trains its
    draft model here too: another name, path, training text and what else the checkpoint records."""
    train, val = ds.train if train is None else train, ds.val
    path = path or os.path.join(args.out_dir, 'ckpt.pt')
    model_args = {k: getattr(args, k) for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'dropout', 'bias')}
    model_args['vocab_size'] = args.vocab_size
    if name == 'base':   # what the messages call this model, and the flags that shape it
        what, named = 'the target', '--n-layer, ...'
        shaped = f"--n-layer {args.n_layer}, --n-embd {args.n_embd}, ..."
    else:                # the draft stage's own flags
        what, named = 'the draft model', '--draft-layers, --draft-embd'
        shaped = f"--draft-layers {args.n_layer}, --draft-embd {args.n_embd}"
    resume = resume_state(args, path, dict(model_args=model_args), weights='model', model_flags=named)
    if resume is not None and resume['iter_num'] >= args.max_iters:
        rt.print(f"{name}: {path} already trained for {resume['iter_num']} steps; skipping")
        return target_from(resume, path, rt.device)
    check_replaceable(path)
    if resume is None:   # by arithmetic first: flags that make a model this machine cannot hold allocate nothing
        check_fits(16 * weight_count(GPTConfig(**model_args)), rt.device,
                   f"training {what} of these flags ({shaped}: its weights, gradients and AdamW's two moments in "
                   f"float32)")
    model = GPT(GPTConfig(**model_args)) if resume is None else target_from(resume, path)
    model.to(rt.device).train()
    rt.print(f"{name}: {model.get_num_params() / 1e6:.2f}M parameters on {rt.device}, "
             f"{len(train) / 1e6:.1f}M training tokens, {len(val) / 1e6:.2f}M held-out ({vocab})")
    B, T = args.batch_size, args.block_size

    def batch():
        w = rt.to_device(windows(train, B, T + 1, rt.gen))
        return w[:, :-1], w[:, 1:]

    def save(opt_state, it, rng):
        save_checkpoint(dict(model=model.state_dict(), model_args=model_args, optimizer=opt_state, iter_num=it,
                             best_val_loss=None, config=vars(args), rng=rng, vocab=vocab.state(), **(record or {})),
                        path)

    t0 = time.perf_counter()
    train_loop(rt, args, name, LMObjective(model), batch, args.max_iters, args.lr, save, resume,
               evaluate=lambda it: heldout_loss(model, val, B, args.eval_iters, rt.precision), tokens_per_step=B * T)
    rt.print(f"{name}: done in {time.perf_counter() - t0:.0f}s -> {path}")
    if rt.ddp:  # proof that data parallelism kept the replicas identical
        # one write, so that the ranks' lines stay whole in a shared pipe (print writes the newline apart)
        sys.stdout.write(f"rank {rt.rank} weights {model.fingerprint()}\n")
        sys.stdout.flush()
    return model.eval()


def stage_draft(rt, args, model, ds, vocab):
    """A small draft model for the target (drafters.DraftModel; generate.py --draft-model): a GPT of
    --draft-layers layers, --draft-embd wide, with the target's vocabulary and context, trained as
    the target was, on the corpus or (--distill, the default) on the target's own greedy
    continuations, the heads' data (sequence-level distillation); only then does it record the
    target's fingerprint, since only then was it trained for that target."""
    C = args.draft_embd or max(1, model.config.n_embd // 2)
    heads = next(h for h in range(max(1, C // 64), 0, -1) if C % h == 0)     # heads of 64 wide, or near
    sizes = dict(n_layer=args.draft_layers, n_embd=C, n_head=heads, block_size=model.config.block_size,
                 max_iters=args.draft_iters, lr=args.draft_lr, dropout=0.0)
    train, record = None, None
    if args.distill:    # the heads' samples: made once for both (self_generated's cache)
        seqs = self_generated(rt, model, ds.train, args.distill_samples, args.block_size - PROMPT_LEN,
                              0.0, args.seed, 'distill (greedy continuations)', os.path.join(args.out_dir, 'data'))
        train, record = seqs.cpu().flatten().numpy(), dict(base_fingerprint=model.fingerprint())
    return stage_base(rt, argparse.Namespace(**{**vars(args), **sizes}), ds, vocab, 'draft', draft_path(args),
                      train, record)


def draft_path(args):
    return os.path.join(args.out_dir, f'draft{args.tag}.pt')


# ----------------------------------------------------------------------------- stage 2: heads

@torch.no_grad()
def self_generated(rt, model, train, n_seqs, gen_len, temperature, seed, desc, cache_dir=None):
    """Corpus prompts continued by the target itself: (n_seqs, PROMPT_LEN + gen_len) tokens.
    temperature 0: greedy (BPD's sequence-level distillation); > 0: samples (DBlast's data).
    With cache_dir, kept there under a key of everything that determines them (the target's
    weights, the prompts drawn from the text, the length, T, the seed, the device's kind, whose
    generator draws its own numbers): stages and bench runs that need the same samples generate
    them once. Made at decoding's float32, whatever the training precision."""
    gen = torch.Generator().manual_seed(seed)
    prompts = windows(train, n_seqs, PROMPT_LEN, gen)
    key = hashlib.sha1(f'{model.fingerprint()} {n_seqs} {gen_len} {temperature} {seed} {rt.kind}'.encode())
    key.update(prompts.numpy().tobytes())
    path = cache_dir and os.path.join(cache_dir, f'samples-{key.hexdigest()[:16]}.pt')
    if path and os.path.exists(path):
        try:
            seqs = torch.load(path, weights_only=True)
        except Exception:   # a damaged cache is made again
            seqs = None
        if (isinstance(seqs, torch.Tensor) and seqs.dtype == torch.long and seqs.shape == (n_seqs, PROMPT_LEN + gen_len)
                and bool(((seqs >= 0) & (seqs < model.config.vocab_size)).all())):
            return seqs.to(rt.device)
        rt.print(f"note: {path} is not the samples it should hold; making them again")
    model.eval()
    dgen = torch.Generator(device=rt.device).manual_seed(seed)
    prompts = prompts.to(rt.device)
    bs = 256 if rt.kind == 'cuda' else 64
    outs = []
    for i in progress(range(0, n_seqs, bs), desc=desc, disable=not rt.master, leave=False):
        with decoding_precision('float32', rt.device):
            out, _ = generate(model, prompts[i:i + bs], gen_len, temperature=temperature, generator=dgen,
                              threads=None)   # a batch of rows, in the threads training chose
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

    def forward(self, tokens, labels, offset=None, h=None):
        """tokens (B, S) and their labels (tokens, -1 where nothing is to be learnt). offset: the
        random-offset loss's head, a 0-dim tensor drawn with the batch (outside a compiled step:
        as a Python int each value would compile a graph of its own). h: a frozen target's hidden
        states over the first S - k tokens (B, S - k, C), when they were computed beforehand
        (stage_heads: once, for the distilled sequences); tokens are then not read (None)."""
        T = labels.size(1) - self.heads.k            # positions with a label for every head
        if h is None:
            with nullcontext() if self.joint else torch.no_grad():
                h = self.model.hidden(tokens[:, :T])
        loss = self.heads.loss(h, self.model.lm_head, labels, offset)
        if self.joint:
            lm = self.model.lm_head(h).float()
            loss = loss + nn.functional.cross_entropy(lm.flatten(0, 1), labels[:, 1:T + 1].flatten(),
                                                      ignore_index=-1)
        return loss


@torch.no_grad()
def frozen_hidden(model, seqs, precision, rows=64):
    """The target's final hidden states over seqs (B, S) -> (B, S, C), `rows` sequences at a time,
    under `precision` (stage_heads: decoding's, as for DBlast's data, so that the heads learn from
    the states decoding shows them). They take B * S * C floats: 65 MB at the CPU preset, 3.2 GB
    at the GPU preset (as DBlast's samples do)."""
    hs = []
    for i in range(0, len(seqs), rows):
        with precision:
            hs.append(model.hidden(seqs[i:i + rows]))
    return torch.cat(hs)


def stage_heads(rt, args, model, train, vocab):
    path = os.path.join(args.out_dir, f'heads{args.tag}.pt')
    fp = model.fingerprint()
    resume = resume_state(args, path, dict(k=args.k, trained_from=fp, joint=args.joint,
                                           d_hidden=args.d_hidden or model.config.n_embd))
    if resume is not None and resume['iter_num'] >= args.heads_iters:
        rt.print(f"heads: {path} already trained; skipping")
        if args.joint:
            load_weights(model, resume.get('joint_model') or {}, path)
        return load_drafter(path, model)
    check_replaceable(path)
    if args.joint:
        check_replaceable(os.path.join(args.out_dir, f'ckpt_joint{args.tag}.pt'))
    H = None
    if args.distill:
        seqs = self_generated(rt, model, train, args.distill_samples, args.block_size - PROMPT_LEN,
                              0.0, args.seed, 'distill (greedy continuations)', os.path.join(args.out_dir, 'data'))
        labels = seqs.clone()
        labels[:, :PROMPT_LEN] = -1      # only the target's own output is learnt
        if not args.joint:   # a frozen target gives the same hidden states at every step: made once
            H = frozen_hidden(model, seqs[:, :args.block_size - args.k], decoding_precision('float32', rt.device))
    heads = BlockHeads(model.config, args.k, args.d_hidden)
    if resume is not None:
        load_weights(heads, resume['drafter'], path)
        if args.joint:
            load_weights(model, resume.get('joint_model') or {}, path)
    heads.to(rt.device).train()
    model.train() if args.joint else model.eval()
    B, S = args.batch_size, args.block_size

    def batch():
        offset = None   # drawn on the device: a host value copied in would stall the step
        if args.loss == 'random-offset':
            offset = torch.randint(args.k - 1, (), generator=rt.dgen, device=rt.device)
        if args.distill:
            ix = torch.randint(len(seqs), (B,), generator=rt.dgen, device=rt.device)
            return (seqs[ix], labels[ix], offset) if H is None else (None, labels[ix], offset, H[ix])
        w = rt.to_device(windows(train, B, S, rt.gen))
        return w, w, offset

    def save(opt_state, it, rng):
        # base_fingerprint: the target these heads run on (the fine-tuned one when joint)
        save_checkpoint(dict(kind='heads', drafter=heads.state_dict(), k=args.k, d_hidden=heads.d_hidden,
                             model_args=vars(model.config), joint=args.joint, trained_from=fp,
                             base_fingerprint=model.fingerprint() if args.joint else fp,
                             joint_model=model.state_dict() if args.joint else None, vocab=vocab.state(),
                             optimizer=opt_state, iter_num=it, rng=rng, config=vars(args)), path)

    rt.print(f"heads: k={args.k}, {'joint' if args.joint else 'frozen'} target, {args.loss} loss, "
             f"{'distilled' if args.distill else 'corpus'} data")
    t0 = time.perf_counter()
    train_loop(rt, args, 'heads', HeadsObjective(model, heads, args.joint), batch,
               args.heads_iters, args.heads_lr, save, resume, tokens_per_step=B * (S - args.k))
    rt.print(f"heads: done in {time.perf_counter() - t0:.0f}s -> {path}")
    if args.joint and rt.master:  # the fine-tuned target is a model of its own: save it beside
        jpath = os.path.join(args.out_dir, f'ckpt_joint{args.tag}.pt')
        save_checkpoint(dict(model=model.state_dict(), model_args=vars(model.config), vocab=vocab.state()), jpath)
        rt.print(f"heads: joint target -> {jpath} (decode with python generate.py --ckpt {jpath} --heads {path})")
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return heads.eval()


# ----------------------------------------------------------------------------- stage 3: DBlast

def dblast_data(rt, model, text, n_seqs, temperature, seed, desc, cache_dir=None):
    """DBlast's training data (self-distillation at temperature T): the target's own samples after
    corpus prompts, with its hidden states and log-probabilities (dblast.TargetSamples)."""
    seqs = self_generated(rt, model, text, n_seqs, model.config.block_size - PROMPT_LEN, temperature, seed, desc,
                          cache_dir)
    return TargetSamples.of(model, seqs, temperature, decoding_precision('float32', rt.device))


def dblast_path(args, K):
    return os.path.join(args.out_dir, f'dblast_K{K}{args.tag}.pt')


def dblast_drafters(args):
    """(K, loss) of the drafters the dblast stage trains: --branches with --dblast-loss, and the K = 1
    baseline with --baseline-loss."""
    baseline = args.branches != 1 and args.baseline_loss != 'none'
    return [(args.branches, args.dblast_loss)] + ([(1, args.baseline_loss)] if baseline else [])


class DBlastObjective(nn.Module):
    def __init__(self, model, drafter, args, kind):
        super().__init__()
        self.model, self.drafter, self.args, self.kind = model, drafter, args, kind

    def forward(self, h, bonus, x, log_px):
        a = self.args
        return self.drafter.loss(h, bonus, self.model, x, log_px, a.temperature, self.kind,
                                 a.tau_threshold, a.nll_weight)


def stage_dblast(rt, args, model, vocab, get_data, get_heldout, K, loss, path):
    """One DBlast drafter (K branches, trained with `loss`) on the target's samples at
    --temperature. Every eval_interval steps: its exact expected tau on held-out target samples,
    with sampled branches and mixture verification (what the AL loss trains for); the curve is kept
    in the checkpoint ('history')."""
    fp = model.fingerprint()
    k = args.dblast_k
    resume = resume_state(args, path, dict(K=K, k=k, base_fingerprint=fp, loss=loss, temperature=args.temperature,
                                           d_hidden=args.d_hidden or model.config.n_embd))
    if resume is not None and resume['iter_num'] >= args.dblast_iters:
        rt.print(f"dblast: {path} already trained; skipping")
        return
    check_replaceable(path)
    data = get_data()
    drafter = DBlastDrafter(model.config, k, K, args.d_hidden)
    history = []
    if resume is not None:
        load_weights(drafter, resume['drafter'], path)
        history = list(resume.get('history', []))
    drafter.to(rt.device).train()
    lo, hi = data.positions(k)
    B = args.batch_size * 8

    def batch():
        rows = torch.randint(len(data.seqs), (B,), generator=rt.dgen, device=rt.device)
        pos = torch.randint(lo, hi, (B,), generator=rt.dgen, device=rt.device)
        return contexts(data, k, rows, pos)

    def evaluate(it):
        with decoding_precision('float32', rt.device):
            tau = expected_tau(drafter, model, get_heldout(), k, args.temperature, True, 'mixture')
        history.append((it, tau))
        return tau

    def save(opt_state, it, rng):
        save_checkpoint(dict(kind='dblast', drafter=drafter.state_dict(), k=k, K=K,
                             d_hidden=drafter.block.d_hidden, model_args=vars(model.config),
                             base_fingerprint=fp, loss=loss, temperature=args.temperature, history=history,
                             vocab=vocab.state(), optimizer=opt_state, iter_num=it, rng=rng, config=vars(args)),
                        path)

    rt.print(f"dblast: K={K}, k={k}, {loss} loss, T={args.temperature}")
    t0 = time.perf_counter()
    train_loop(rt, args, f'dblast K={K}', DBlastObjective(model, drafter, args, loss), batch,
               args.dblast_iters, args.dblast_lr, save, resume, evaluate=evaluate if rt.master else None,
               eval_name='held-out expected tau')
    rt.print(f"dblast K={K}: done in {time.perf_counter() - t0:.0f}s -> {path}")
    return drafter.eval()


# ----------------------------------------------------------------------------- demos

def demos_shown(args):
    """Whether the run ends with demos: of the heads or the DBlast drafters it trains."""
    return not args.no_demo and bool({'heads', 'dblast'} & set(args.stages))


def run_demos(rt, args, model, heads, ds, vocab):
    """closing_demos on DEMO_PROMPTS held-out prompts, with the drafters this run trained, decoding in
    --threads if given, else the scripts' choice for decoding (generate's threads='auto'). On CUDA
    compiled (runner.py: CUDA graphs of several steps, the fastest way the project has there, what
    a GPU user runs); elsewhere eager, the default (compiling costs more than the demo decodes)."""
    prompts = heldout_prompts(ds.val, DEMO_PROMPTS, PROMPT_LEN, newline_id(vocab)).to(rt.device)   # as heldout_prompts_of
    drafters = dblast_drafters(args)
    dblast = []
    if 'dblast' in args.stages and all(os.path.exists(dblast_path(args, K)) for K, _ in drafters):
        dblast = [(f"DBlast, K={K} branches ({loss} loss)" if K > 1 else f"independent, K=1 ({loss} loss)",
                   load_drafter(dblast_path(args, K), model)) for K, loss in drafters]
    with decoding_precision('float32', rt.device):
        closing_demos(model, prompts, vocab, heads, args.k, dblast, args.dblast_k, args.temperature, rt.print,
                      threads=args.threads or 'auto', compile=rt.kind == 'cuda')


# ----------------------------------------------------------------------------- checks

def parse_args(argv=None):
    """train.py's flags (trainer.FLAGS), --preset's defaults (PRESETS) filled in, every one checked
    before any work."""
    return parse_flags(argv, PRESETS, __doc__)


def check_plan(args, block_size):
    """Block sizes against the context they must fit in, and the draft stage's distilled text
    against the windows it trains on (before any stage runs or writes)."""
    need = {'heads': ('--k', args.k, args.k), 'dblast': ('--dblast-k', args.dblast_k, args.dblast_k + 1)}
    for stage, (flag, value, block) in need.items():
        if stage in args.stages and block_size < PROMPT_LEN + block + 2:
            raise BadInput(f"a context of {block_size} tokens is too short for the {stage} stage with {flag} "
                           f"{value}: it needs a {PROMPT_LEN}-token prompt plus the block (at least "
                           f"{PROMPT_LEN + block + 2}; see --block-size)")
    if 'draft' in args.stages and args.distill:   # it trains on windows of the target's continuations
        if block_size < PROMPT_LEN + 2:
            raise BadInput(f"a context of {block_size} tokens is too short for the draft stage on distilled text: "
                           f"it continues {PROMPT_LEN}-token prompts (at least {PROMPT_LEN + 2}; see --block-size, "
                           f"or --no-distill)")
        if args.distill_samples < 2:
            raise BadInput(f"--distill-samples {args.distill_samples}: the draft stage trains on windows of the "
                           f"distilled text, which needs at least 2 continuations")


def unfinished_target(ckpt, path):
    """A note for a target whose training stopped before its --max-iters ('' for one that did not,
    or a checkpoint that does not say, as nanoGPT's may not)."""
    done, config = ckpt.get('iter_num'), ckpt.get('config')
    planned = config.get('max_iters') if isinstance(config, dict) else None
    if not (isinstance(done, int) and isinstance(planned, int) and done < planned):
        return ''
    return (f"note: the target in {path} stopped at step {done} of {planned}: the drafters train for it as it is; "
            f"to finish it first, --stages base --resume")


def check_sizes(args, device, n_embd):
    """--batch-size, the drafters' --d-hidden and the samples a stage keeps against the memory free,
    by arithmetic before any stage runs: lower bounds of what a stage holds (past them the operating
    system kills the run without a word, or an allocation fails mid-run)."""
    B, T, V, C = args.batch_size, args.block_size, args.vocab_size, n_embd
    holds = {'base': (4 * B * T * V, 'its float32 logits'), 'draft': (4 * B * T * V, 'its float32 logits'),
             'heads': (4 * B * (T - args.k) * C, "the target's float32 hidden states")}
    for stage in args.stages:
        if stage in holds:
            n_bytes, what = holds[stage]
            check_fits(n_bytes, device, f"--batch-size {B}: one step of the {stage} stage ({what} alone)")
    d_hidden = args.d_hidden or C
    for stage, k in (('heads', args.k), ('dblast', args.dblast_k)):   # a block head's two products
        if stage in args.stages:
            check_fits(16 * 2 * (k - 1) * d_hidden * C, device, f"--d-hidden {d_hidden}: the {stage} stage's block "
                       f"head (its weights, gradients and AdamW's two moments in float32, alone)")
    # the target's continuations as int64 ids, and the float32 hidden states kept beside them
    if 'heads' in args.stages and args.distill:
        check_fits(args.distill_samples * T * (8 + (0 if args.joint else 4 * C)), device,
                   f"--distill-samples {args.distill_samples}: the heads stage's distilled continuations"
                   + ("" if args.joint else " and the target's hidden states over them"))
    if 'dblast' in args.stages:
        n = args.dblast_samples + args.dblast_eval_samples
        check_fits(n * T * (8 + 4 * C + 4), device, f"--dblast-samples {args.dblast_samples} and "
                   f"--dblast-eval-samples {args.dblast_eval_samples}: the target's samples with their hidden states "
                   f"and log-probabilities")


# ----------------------------------------------------------------------------- main

def main(argv=None, says_resume=True):
    """train.py's command line. says_resume: its line after an interruption tells to rerun with
    --resume (False for a caller that passes --resume itself, as bench.py does)."""
    args = parse_args(argv)
    if args.compile:   # inductor's C++ compiler on a CPU: missing, it would fail the first step, not before
        check_compiler(pick_device(args.device))
    before = torch.get_num_threads()   # bench.py trains in-process, then decodes with its own
    try:
        intra_op_threads(args.threads)
        run(args)
    except KeyboardInterrupt:   # one line (run_script) instead of a traceback
        raise KeyboardInterrupt(f"interrupted: every checkpoint in {args.out_dir}/ is as of its last save; "
                                f"continue with the same command{' and --resume' * says_resume}") from None
    except NotImplementedError as e:   # a handout (python -m exercises handout): an exercise not written yet
        raise NotImplementedError(f"{e}; every checkpoint in {args.out_dir}/ is as of its last save: write it, "
                                  f"then the same command{' with --resume' * says_resume} continues") from None
    finally:
        torch.set_num_threads(before)


def run(args):
    rt = Runtime(args.device, args.seed, args.dtype)
    try:
        train_all(rt, args)
        rt.all_done()
    finally:
        rt.close()


def written(args):
    """The checkpoints the chosen stages write."""
    paths = [os.path.join(args.out_dir, 'ckpt.pt')] if 'base' in args.stages else []
    if 'heads' in args.stages:
        paths += [os.path.join(args.out_dir, f'heads{args.tag}.pt')]
        paths += [os.path.join(args.out_dir, f'ckpt_joint{args.tag}.pt')] * args.joint
    if 'dblast' in args.stages:
        paths += [dblast_path(args, K) for K, _ in dblast_drafters(args)]
    if 'draft' in args.stages:
        paths += [draft_path(args)]
    return paths


def train_all(rt, args):
    base_path = os.path.join(args.out_dir, 'ckpt.pt')
    if 'base' not in args.stages and not os.path.exists(base_path):   # before the folder is made
        raise BadInput(f"--stages {','.join(args.stages)} trains drafters for the target in {base_path}, which is not "
                       f"there: train it first (python train.py, or --stages base), or give the --out-dir that holds it")
    if args.data is not None and not os.path.exists(args.data):   # before the output folder is made
        raise BadInput(f"--data {args.data}: no such file or folder")
    check_out_dir(args.out_dir)
    for path in written(args):   # --resume: a finished stage writes nothing; each stage checks its own
        check_replaceable(path, writable=not args.resume)
    ds = load_dataset(args.data, os.path.join(args.out_dir, 'data'))
    if 'base' in args.stages:   # the target's vocabulary is the data's (GPT-2's for ids without meta.pkl)
        vocab = ds.vocab or Vocab('gpt2')
        args.vocab_size = {'bytes': 256, 'gpt2': 50304}.get(vocab.kind, vocab.size)
        model, unfinished = None, ''
    else:
        ckpt = load_checkpoint(base_path)
        model = target_from(ckpt, base_path, rt.device)
        vocab = vocab_for(ckpt, base_path, model.config.vocab_size, args.meta or ds.meta,
                          None if args.meta else args.data)
        args.block_size, args.vocab_size = model.config.block_size, model.config.vocab_size
        unfinished = unfinished_target(ckpt, base_path)
        del ckpt
    ds.check(args.vocab_size, vocab)
    check_plan(args, args.block_size)
    check_sizes(args, rt.device, args.n_embd if model is None else model.config.n_embd)
    if len(ds.train) <= args.block_size + 1 or len(ds.val) <= args.block_size + 1:
        raise BadInput(f"--data: too little text for --block-size {args.block_size}")
    if demos_shown(args) and len(ds.val) < PROMPT_LEN + DEMO_PROMPTS + 1:
        raise BadInput(f"--data: its held-out text ({len(ds.val)} tokens) is too short for the closing demos' "
                       f"{DEMO_PROMPTS} prompts of {PROMPT_LEN} tokens (at least {PROMPT_LEN + DEMO_PROMPTS + 1}); "
                       f"give more text, or --no-demo")
    rt.print(f"preset {args.preset} on {rt.device}, training in {rt.precision}, decoding in float32"
             + (f", CPU threads: {torch.get_num_threads()}" if rt.kind == 'cpu' else "")
             + (f", {rt.world} processes" if rt.ddp else ""))
    if unfinished:
        rt.print(unfinished)
    t_start = time.perf_counter()
    if 'base' in args.stages:
        model = stage_base(rt, args, ds, vocab)
    for p in model.parameters():
        p.requires_grad_(False)
    heads = None
    if 'heads' in args.stages:
        heads = stage_heads(rt, args, model, ds.train, vocab)
    if 'dblast' in args.stages:
        # generated on first need (cached): a resumed run may have nothing left to train
        T, n_seqs, n_val = args.temperature, args.dblast_samples, args.dblast_eval_samples
        cache = os.path.join(args.out_dir, 'data')
        get_data = functools.cache(lambda: dblast_data(rt, model, ds.train, n_seqs, T, args.seed + 1,
                                                       f'dblast data ({n_seqs} samples at T={T})', cache))
        get_heldout = functools.cache(lambda: dblast_data(rt, model, ds.val, n_val, T, args.seed + 2,
                                                          f'held-out samples at T={T}', cache))
        for K, loss in dblast_drafters(args):
            stage_dblast(rt, args, model, vocab, get_data, get_heldout, K, loss, dblast_path(args, K))
    if 'draft' in args.stages:
        stage_draft(rt, args, model, ds, vocab)
    rt.print(f"\ntraining done in {time.perf_counter() - t_start:.0f}s")
    if rt.master and demos_shown(args):
        run_demos(rt, args, model, heads, ds, vocab)


if __name__ == '__main__':
    run_script(main)
