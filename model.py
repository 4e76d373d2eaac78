"""
The target: a small GPT-2 style language model, with a static KV cache built for speculative
decoding from day one, and the sampling primitives every decoder and drafter shares.

The module layout and parameter names follow nanoGPT (transformer.wte / wpe / h.N.attn.c_attn /
... / ln_f, lm_head tied to wte), so a nanoGPT `ckpt.pt` loads with `GPT.from_checkpoint`
(files and their checks live in data.py, one-line errors in cli.py).

Two ways to run the network:
  model(idx, targets)            full causal forward over (B, T), used for training and as reference
  model.forward_cached(idx, c)   a block of L new tokens per row on top of a KVCache, written at
                                 each row's own positions; returns final hidden states h (after ln_f)

Words: a *block* is what one decoding step feeds the target (a bonus token and its drafts).
`block_size` is nanoGPT's name for the context length; it is kept because every nanoGPT checkpoint
stores it under that name.
"""
import hashlib
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 256      # the context: longest sequence the position table covers (nanoGPT's name)
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
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)    # right: u = 0 skips leading zero weights
    return idx.clamp_(max=weights.size(-1) - 1).squeeze(-1)


def tempered(logits, temperature):
    """logits / T, shifted so that the largest is 0: softmax and log_softmax stay finite for any
    finite T > 0 (a tiny T gives the greedy limit, a one-hot, instead of inf - inf = NaN). A T > 0 too
    small for the logits' dtype (1e-300 is 0 in float32, and 0 / 0 is NaN) divides as its smallest
    normal number, which gives that limit too; T = 0 is not a temperature (greedy decoding takes
    the argmax without one), and a tensor T divides as it is."""
    if not isinstance(temperature, torch.Tensor) and temperature > 0:
        temperature = max(temperature, torch.finfo(logits.dtype).tiny)
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
    """Static KV cache in the gpt-fast style: buffers are preallocated once and a forward writes a
    block's keys/values at positions past each row's committed length without moving it.
    `commit` then moves the length over the tokens that were kept; the entries past it stay in the
    buffer, hidden by the attention mask, until the next block overwrites them. Rejecting drafts
    therefore needs no rollback: nothing is concatenated or sliced. The one copy is `keep_path`'s:
    a tree (several paths, or a token tree) moves the path it keeps next to the bonus, every step.

    k, v: (n_layer, B, n_head, max_len, head_dim); lengths: (B,) committed tokens per row.
    """

    def __init__(self, config, batch_size, max_len, device, dtype):
        hs = config.n_embd // config.n_head
        shape = (config.n_layer, batch_size, config.n_head, max_len, hs)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        self.layers = torch.arange(config.n_layer, device=device)[:, None, None]   # (n_layer, 1, 1)
        self.rows = torch.arange(batch_size, device=device)[:, None]               # (B, 1)

    def write(self, layer_idx, k, v, pos):
        """Store one layer's keys and values k, v (B, nh, L, hs) of a block at positions pos (B, L)
        (each row's own, past its committed length); returns that layer's whole buffers
        (B, nh, max_len, hs) for attention to read.

        One indexed assignment into the whole 5-D buffer, not a scatter into the layer's view:
        compiled, a write into a view of a graph input becomes copies of the buffers (the whole
        cache, every step), while this one is done in place."""
        at = (self.layers[layer_idx], self.rows, slice(None), pos)  # broadcast to (B, L): (B, L, nh, hs)
        self.k[at] = k.transpose(1, 2).to(self.k.dtype)
        self.v[at] = v.transpose(1, 2).to(self.v.dtype)
        return self.k[layer_idx], self.v[layer_idx]

    def commit(self, n):
        """Keep the first n (B,) tokens of the block just written, per row (n may be 0)."""
        self.lengths += n

    def keep_path(self, slots):
        """Tree verification keeps one drafted path, whose keys and values sit at block slots
        `slots` (B, n) (counted from each row's committed length; the bonus is slot 0): copy them
        to slots 1..n, right after the bonus, so that `commit` can keep them as a sequence."""
        dst = self.lengths[:, None] + torch.arange(1, slots.size(1) + 1, device=slots.device)   # (B, n)
        src = self.lengths[:, None] + slots
        for buf in (self.k, self.v):                          # (n_layer, B, n, nh, hs) read, then written
            buf[self.layers, self.rows, :, dst] = buf[self.layers, self.rows, :, src]


def cached_attention(q, K, V, mask):
    """Attention of a block's few queries q (B, nh, L, hs) over the whole static cache K, V
    (B, nh, max_len, hs), where mask (B, 1, L, max_len) is True. Run op by op, torch's fused
    kernel (one launch instead of five); compiled, nanoGPT's manual attention (manual_attention),
    whose mask and softmax inductor fuses into one kernel: the fused kernels are built for long
    blocks of queries, and on one H200 the memory-efficient one took 65 us a layer for one float32
    query over 576 keys, three quarters of a compiled decoding step (README, "One GPU")."""
    if torch.compiler.is_compiling():
        return manual_attention(q, K, V, mask)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask)


def manual_attention(q, K, V, mask):
    """softmax(q K^T / sqrt(hs), where mask) V: nanoGPT's attention without its fused kernel."""
    att = (q @ K.transpose(-2, -1)) * (1.0 / math.sqrt(K.size(-1)))       # (B, nh, L, max_len)
    att = att.masked_fill(~mask, float('-inf'))                            # each row sees itself: never all -inf
    return F.softmax(att, dim=-1) @ V                                       # (B, nh, L, hs)


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

    def forward(self, x, cache=None, layer_idx=None, write_pos=None, mask=None):
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
            K, V = cache.write(layer_idx, k, v, write_pos)                   # (B, nh, max_len, hs)
            y = cached_attention(q, K.to(q.dtype), V.to(q.dtype), mask)
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


class Layer(nn.Module):
    """One transformer layer: attention then MLP, each behind a LayerNorm (nanoGPT's `Block`)."""

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
            h=nn.ModuleList([Layer(config) for _ in range(config.n_layer)]),
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
        for layer in self.transformer.h:
            x = layer(x)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None):
        """idx (B, T) -> logits (B, T, vocab) at every position, and the mean cross-entropy."""
        logits = self.lm_head(self.hidden(idx))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
        """nanoGPT's generate: extend idx (B, T) by max_new_tokens, one full forward over the
        whole sequence per token (cropped to the context), no cache. The reading of plain
        decoding to hold on to, and the reference the cached decoders are tested against.
        temperature 0 takes the argmax; otherwise the next token is a sample of
        softmax(logits / temperature), restricted to the top_k most likely when given, drawn by
        `sample` from `generator` (so decode.generate's plain sampling, which draws the same way,
        gives the same tokens from the same seed)."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits = self(idx_cond)[0][:, -1, :]                   # (B, vocab) after the last token
            if temperature == 0:
                idx_next = logits.argmax(-1)
            else:
                logits = tempered(logits, temperature)
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float('inf')
                idx_next = sample(F.softmax(logits, dim=-1), generator)
            idx = torch.cat((idx, idx_next[:, None]), dim=1)
        return idx

    # ---------------------------------------------------------------- cached inference

    def compute_dtype(self):
        """The dtype activations (and so keys and values) are computed in: autocast's while it is
        on for the weights' device (bf16), else the weights' own."""
        device = self.lm_head.weight.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.lm_head.weight.dtype

    def new_cache(self, batch_size, max_len, device=None, dtype=None):
        """A KVCache, by default in the compute dtype: under autocast no step converts the whole
        cache from float32."""
        return KVCache(self.config, batch_size, max_len, device or self.lm_head.weight.device,
                       dtype or self.compute_dtype())

    def forward_cached(self, idx, cache, tree=None):
        """Feed a block of L tokens per row after each row's committed prefix.

        idx (B, L): row b's tokens are written to the cache slots cache.lengths[b] + 0..L-1.
        cache.lengths is NOT advanced: the caller decides how many of the block it keeps with
        `cache.commit` (all of it for a prefill, tau tokens after a verification).
        tree: None for a sequence (slot j at position lengths + j, seeing the slots before it), or
        (depth, attend) for a tree of drafted tokens, one for every row (depth (L,), attend (L, L)
        bool: verification.tree_layout's paths) or one per row (depth (B, L), attend (B, L, L): a token
        tree, verification.tree_attend): slot j sits at position lengths + depth[j] and sees the committed
        prefix and the slots i with attend[j, i].
        Returns h (B, L, C), the final hidden states after ln_f; logits are `self.lm_head(h)`.
        """
        B, L = idx.shape
        offs = torch.arange(L, device=idx.device)
        write_pos = cache.lengths[:, None] + offs                              # (B, L) cache slots
        keys = torch.arange(cache.max_len, device=idx.device)
        if tree is None:
            depth = offs
            # Offset causal mask: query i of row b sees keys at slots <= lengths[b] + i. Query and
            # key lengths differ (L vs max_len), so `is_causal` would be wrong; build it explicitly.
            mask = keys[None, None, :] <= write_pos[:, :, None]                # (B, L, max_len)
        else:
            depth, attend = tree
            rel = keys[None, :] - cache.lengths[:, None]                       # (B, max_len) slot in the block
            in_block = (rel >= 0) & (rel < L)
            sees = attend.expand(B, L, L).gather(2, rel.clamp(0, L - 1)[:, None, :].expand(B, L, -1))   # [b, j, rel]
            mask = (rel < 0)[:, None, :] | (in_block[:, None, :] & sees)       # (B, L, max_len)
        # Positions past block_size only occur past the requested length: the tail of a block that
        # overruns it, or the block of a row already done while others still decode. No token of
        # the output attends to them, so clamping them is harmless.
        pos = (cache.lengths[:, None] + depth).clamp(max=self.config.block_size - 1)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for i, layer in enumerate(self.transformer.h):
            x = layer(x, cache=cache, layer_idx=i, write_pos=write_pos, mask=mask[:, None])
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
