"""
The target: a small GPT-2 style language model, with a static KV cache built for speculative
decoding from day one.

The module layout and parameter names follow nanoGPT (transformer.wte / wpe / h.N.attn.c_attn /
... / ln_f, lm_head tied to wte), so a nanoGPT `ckpt.pt` loads with `GPT.from_checkpoint`.

Two ways to run the network:
  model(idx, targets)            full causal forward over (B, T), used for training and as reference
  model.forward_cached(idx, c)   a block of L new tokens per row on top of a KVCache, written at
                                 each row's own positions; returns final hidden states h (after ln_f)
"""
import argparse
import hashlib
import math
import os
import pickle
import sys
from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 256      # longest sequence the learned position table covers
    vocab_size: int = 256      # bytes
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True          # bias in Linears and LayerNorms, as GPT-2

    @classmethod
    def from_dict(cls, d):
        """Build from a checkpoint's model_args, ignoring keys we do not know."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ---------------------------------------------------------------------------- sampling primitives

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


def tempered(logits, temperature):
    """logits / T, shifted so that the largest is 0: softmax and log_softmax stay finite for any
    finite T > 0 (a tiny T gives the greedy limit, a one-hot, instead of inf - inf = NaN)."""
    return (logits - logits.amax(-1, keepdim=True)) / temperature


# ---------------------------------------------------------------------------- the network

class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1); nanoGPT's class."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class KVCache:
    """Static KV cache in the gpt-fast style: buffers are preallocated once, a forward writes its
    keys/values at positions, and rollback only moves a row's length back (rejected entries are
    overwritten by the next block; nothing is concatenated or sliced).

    k, v: (n_layer, B, n_head, max_len, head_dim); lengths: (B,) committed tokens per row.
    """

    def __init__(self, config, batch_size, max_len, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, max_len, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    def rollback(self, lengths):
        """Forget everything past `lengths` (B,) per row: the entries stay, they are just ignored."""
        self.lengths.copy_(lengths)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x, cache=None, layer=None, write_pos=None, mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is None:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            # write this block's keys/values at each row's own positions, then attend over the
            # whole buffer; `mask` hides what is not (yet) part of that row's sequence
            idx = write_pos[:, None, :, None].expand(B, self.n_head, T, C // self.n_head)
            cache.k[layer].scatter_(2, idx, k.to(cache.k.dtype))
            cache.v[layer].scatter_(2, idx, v.to(cache.v.dtype))
            K, V = cache.k[layer].to(q.dtype), cache.v[layer].to(q.dtype)  # (B, nh, max_len, hs)
            y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, **cache_kw):
        x = x + self.attn(self.ln_1(x), **cache_kw)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self):
        return sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()

    def hidden(self, idx):
        """idx (B, T) -> final hidden states h (B, T, C) after ln_f, full causal pass."""
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None):
        """idx (B, T) -> logits (B, T, vocab) at every position, and the mean cross-entropy."""
        logits = self.lm_head(self.hidden(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    # ---------------------------------------------------------------- cached inference

    def new_cache(self, batch_size, max_len, device=None, dtype=None):
        p = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len, device or p.device, dtype or p.dtype)

    def forward_cached(self, idx, cache):
        """Feed a block of L tokens per row after each row's committed prefix.

        idx (B, L): row b's tokens go to positions cache.lengths[b] + 0..L-1, and their keys and
        values are written there. cache.lengths is NOT advanced: the caller decides how many of
        the block it keeps (all of it for a prefill, tau tokens after a verification).
        Returns h (B, L, C), the final hidden states after ln_f; logits are `self.lm_head(h)`.
        """
        B, L = idx.shape
        offs = torch.arange(L, device=idx.device)
        write_pos = cache.lengths[:, None] + offs                              # (B, L)
        # Positions past block_size only occur for the tail of a draft block that overruns the
        # requested length; no committed token attends to them, so clamping them is harmless.
        pos = write_pos.clamp(max=self.config.block_size - 1)
        # Offset causal mask: query i of row b sees keys at positions <= lengths[b] + i. Query and
        # key lengths differ (L vs max_len), so `is_causal` would be wrong; build it explicitly.
        keys = torch.arange(cache.max_len, device=idx.device)
        mask = keys[None, None, :] <= write_pos[:, :, None]                    # (B, L, max_len)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache=cache, layer=i, write_pos=write_pos, mask=mask[:, None])
        return self.transformer.ln_f(x)

    # ---------------------------------------------------------------- checkpoints

    @classmethod
    def from_checkpoint(cls, ckpt):
        """Build from a checkpoint dict in nanoGPT's format: {'model': state_dict, 'model_args'}.
        Keys may carry torch.compile's '_orig_mod.' prefix; nanoGPT's causal-mask buffers
        ('.attn.bias', only present in its non-flash path) are ignored."""
        model = cls(GPTConfig.from_dict(ckpt['model_args']))
        sd = {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}
        sd = {k: v for k, v in sd.items() if not k.endswith(('.attn.bias', '.attn.masked_bias'))}
        model.load_state_dict(sd)
        return model

    def fingerprint(self):
        """Short hash of the weights: drafters record which target they were trained for."""
        h = hashlib.sha256()
        for name, t in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().to('cpu', torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


# -------------------------------------------------------------------- checkpoint files

class BadInput(ValueError):
    """A user error (bad argument, missing or mismatched file): the scripts print its message as
    one line and exit non-zero instead of showing a traceback."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, not a number, ...) are one `error:` line too."""

    def error(self, message):
        raise BadInput(message)


def check_number(flag, value, lo=None, hi=None, open_lo=False, open_hi=False, note=''):
    """A flag's number is finite and within its bounds (open_lo / open_hi: the bound itself is
    excluded): else a one-line BadInput naming the flag and what is allowed."""
    ok = (isinstance(value, int) or math.isfinite(value)) and (lo is None or value > lo or (value == lo and not open_lo)) \
        and (hi is None or value < hi or (value == hi and not open_hi))
    if not ok:
        allowed = ' and '.join([f"{'>' if open_lo else '>='} {lo}"] * (lo is not None)
                               + [f"{'<' if open_hi else '<='} {hi}"] * (hi is not None)) or 'finite'
        raise BadInput(f"{flag} {value}: must be {allowed}" + (f" ({note})" if note else ''))
    return value


def check_finite(module, what):
    """Refuse weights with a NaN or an inf: they would decode garbage or poison a checkpoint."""
    bad = [n for n, t in module.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise BadInput(f"{what}: non-finite weights in {bad[0]}" + (f" and {len(bad) - 1} more" if len(bad) > 1 else ''))


def run_script(main, interrupted='interrupted'):
    """Run a script's main(): a BadInput ends it with one `error: ...` line and exit code 2; Ctrl-C
    with one line (the KeyboardInterrupt's own message, else `interrupted`) and exit code 130."""
    try:
        main()
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:   # a script may raise its own, saying what was saved
        print(f"\n{str(e) or interrupted}", file=sys.stderr)
        sys.exit(130)


def save_checkpoint(obj, path):
    """Write atomically: a temporary file beside the target, then a rename. An interrupted write
    leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# numpy scalars, as a checkpoint may hold them (a learning rate computed with numpy, a loss): data
# whose unpickling runs nothing but numpy's own constructors, so weights_only loading allows them
NUMPY_SCALARS = [getattr(np, '_core', np.core).multiarray.scalar, np.dtype] + [
    type(np.dtype(t)) for t in (np.float64, np.float32, np.float16, np.int64, np.int32, np.bool_)]


def load_checkpoint(path, kind=None):
    """torch.load with one-line errors for a missing, corrupt or wrong-kind file. Only tensors and
    plain Python values (and numpy scalars) load (weights_only=True): a file that needs more is
    refused, and nothing in it runs."""
    if not os.path.isfile(path):
        raise BadInput(f"checkpoint not found: {path}")
    try:
        with torch.serialization.safe_globals(NUMPY_SCALARS):
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as e:
        if 'Weights only load failed' in str(e):  # it names a class or function: refused unloaded
            raise BadInput(f"checkpoint {path} refused: it holds more than tensors and plain values "
                           f"(nothing in it was run)")
        raise BadInput(f"checkpoint {path} is unreadable ({type(e).__name__}); re-train or re-copy it")
    except Exception as e:  # truncated zip, pickle garbage, ...
        raise BadInput(f"checkpoint {path} is unreadable ({type(e).__name__}); re-train or re-copy it")
    if not isinstance(ckpt, dict):
        raise BadInput(f"checkpoint {path} is not a checkpoint dict")
    have = ckpt.get('kind', 'target')
    if kind is not None and have != kind:
        raise BadInput(f"checkpoint {path} holds a {have!r}, expected a {kind!r}")
    return ckpt


def load_target(path, device='cpu'):
    """A target GPT from a checkpoint of ours or nanoGPT's."""
    return target_from(load_checkpoint(path), path, device)


def target_from(ckpt, path, device='cpu'):
    """The target GPT of a loaded checkpoint dict (path: for messages); non-finite weights refused."""
    if 'model' not in ckpt or 'model_args' not in ckpt:
        raise BadInput(f"checkpoint {path} has no 'model'/'model_args': not a GPT checkpoint")
    try:
        model = GPT.from_checkpoint(ckpt)
    except Exception as e:  # any malformed content: shapes, types, impossible sizes
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise BadInput(f"checkpoint {path}: weights do not fit its config ({first})")
    check_finite(model, f"checkpoint {path}")
    return model.to(device).eval()
