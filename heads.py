"""
The drafter contract, and its first drafter: Blockwise Parallel Decoding's k-offset heads
(Stern, Shazeer & Uszkoreit 2018, §6 "Implementation and Training", p. 5; MATH.md §3).

The contract (`Drafter`) is what decode.py asks of every drafter: the BPD heads here, the DBlast
mixture and its K = 1 baseline in dblast.py, and a student's own. Decoding hands a drafter the
target's state after the last committed token and the bonus token the target chose from it; the
drafter proposes the k-1 tokens after the bonus, and says which distribution they were drawn from,
since lossless verification needs exactly that (MATH.md §4).

BPD's heads. From the target's final hidden state h at position t (after ln_f) they propose the
tokens at t+2 .. t+k, through one feed-forward layer shared by all heads, a residual from h and
the target's own (tied) unembedding. The token at t+1 (the bonus) is the target's own LM head:
the paper's head "1" is the identity here, so a frozen target keeps exact greedy equivalence.
Where this differs from the paper (the layer's width, the heads' own LayerNorm, the loss's mean
over k-1 heads): MATH.md §8. The layer's output weights start at zero, so every head starts as a
copy of the next-token head (up to that LayerNorm, which re-normalises h): training only has to
learn the offsets.
"""
import math
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import LayerNorm, sample, tempered, upcast

# Logits elements one chunk of a loss (or of dblast's data pass) may hold: 2**26 is 256 MiB per
# float32 copy, and a chunk's working set is a few copies (logits, log-softmax, their gradient).
# At a GPT-2 vocabulary (V = 50304) every head's logits at once do not fit: batch 64 x 1024
# positions x 7 heads keep about 92 GB of float32 log-softmax for backward.
LOGITS_BUDGET = 2 ** 26


class Text(NamedTuple):
    """What a drafter that reads the text (Drafter.reads_text) gets as draft's `text`:

        tokens (B, W)   each row's prompt, then its committed tokens (past n: anything; W > n, so
                        that the bonus fits at n)
        n (B,)          committed tokens per row, the prompt's included; the bonus, about to be
                        committed, sits at position n
        state           the drafter's own state (new_state, read_prompt), or None"""
    tokens: torch.Tensor
    n: torch.Tensor
    state: object = None


class Drafter(nn.Module):
    """The drafter contract. decode.generate and merged_step use nothing else:

        drafter.k               the largest block it drafts for (1 bonus + k-1 drafts)
        drafter.sample_drafts   under sampling (temperature > 0): True draws each draft from the
                                drafter's own distribution at that temperature, False takes its
                                argmax (a point mass); at temperature 0 drafts are always argmax.
                                DBlastDrafter's argmax is the argmax path of a branch drawn from
                                its prior, and under sampling its Q is still the mixture's wherever
                                it weighs several branches (dblast.DBlastDrafter.draft_paths)
        drafts, Q = drafter.draft(h, bonus, target, k, temperature=0.0, generator=None)
        drafter.meaningless(temperature, paths)   what a call would ask of it in vain (checked first)
        drafter.does_not_fit(target)              why it cannot serve this target (checked first)
        drafter.next_log_q(h, bonus, target, k, temperature)   for token trees (optional, below)

    h (B, C): the target's final hidden state after the last committed token (the state the bonus
    was predicted from); bonus (B,): the token the target chose there, about to be committed;
    target: the GPT (its lm_head and embedding may be shared). Returns drafts (B, k-1), the tokens
    proposed after the bonus, and Q (B, k-1, V): the proposal's conditional at each drafted
    position given the drafts before it, at `temperature` (row i of Q is what draft i was drawn
    from), or None when the drafts are a point mass (argmax drafting, or greedy decoding, where
    verification only compares argmaxes). The draws come from `generator`. h and bonus are left as
    they were: the step reads the bonus again (the next block starts with it), and several drafters
    in one call (drafters.MixedPaths) are each handed the same h. No host sync and no
    Python loop over rows: the step that calls it runs as one CUDA graph. A loop over the k-1
    drafted positions has a fixed length (k is fixed per graph), so a compiled step unrolls it: a
    drafter whose draft i needs the sampled draft i-1 loops so (a recurrent one, or a draft model),
    and one module per offset may; BlockHeads batches its heads instead, fewer kernels a call.

    A drafter that reads the text instead of (or besides) the target's state sets `reads_text`;
    its draft then also gets text=Text(tokens, n, state): the committed tokens of each row, and the
    drafter's own state if it keeps one (a draft model's KV cache, drafters.DraftModel):
        state = drafter.new_state(rows, max_len)   once per configuration (None: no state)
        drafter.read_prompt(state, prompt)          the prefill: the prompt (rows, T0) read into it
    One row of state per drafted path: with paths=N, rows = B*N, row b*N + i path i of prompt b (as
    draft_paths' default repeats the rows). Between calls the verifier commits 1 to k tokens a row;
    the state is advanced by what the text says was committed, and rolled back by length, as the
    target's cache is. The drafters that read only h (BPD heads, DBlast) leave all of this alone.
    """
    k: int
    sample_drafts: bool = True
    reads_text: bool = False

    def new_state(self, rows, max_len):
        return None

    def read_prompt(self, state, prompt):
        pass

    def does_not_fit(self, target):
        """Why this drafter cannot serve `target`, or None; decode.generate refuses the first before
        any work. Here, for a drafter that reads the target's hidden state: the target's width
        (n_embd, where the drafter records one) and its weights' dtype."""
        C = target.config.n_embd
        if getattr(self, 'n_embd', C) != C:
            return f"it was made for a target of width n_embd={self.n_embd}; this target's is {C}"
        w, want = next(self.parameters(), None), target.lm_head.weight.dtype
        if w is not None and w.dtype != want:
            return f"its weights are {w.dtype}, the target's {want}: move it to the target's dtype (drafter.to)"
        return None

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        raise NotImplementedError

    def meaningless(self, temperature, paths):
        """What a call at `temperature` with `paths` drafted paths would ask of this drafter in vain:
        [(setting, value, why)], where setting is a call's argument ('paths') or one of the
        drafter's own settings. decode.generate refuses the first, in one line, before any work
        (generate.py names its flag). A drafter with settings of its own extends this; what only
        one kind of drafter has is judged there alone. Here: several paths of argmax drafts, which
        the independent draws of this class's draft_paths make all the same (a drafter that draws
        its paths otherwise says for itself)."""
        own_paths = type(self).draft_paths is not Drafter.draft_paths
        if paths > 1 and not own_paths and not (temperature > 0 and self.sample_drafts):
            return [('paths', paths, "drafted by argmax (greedy decoding, or drafts not sampled), every path is the "
                                     "same; use one path, or sample the drafts")]
        return []

    def next_log_q(self, h, bonus, target, k, temperature=0.0):
        """For a token tree (generate's nodes=M, MATH.md §10): how this drafter scores a node's
        children. Returns a function log_q(d, prefix) -> (B, rows, V): the log-probability it gives
        each token at drafted position d (0-based) after the drafted prefix (B, rows, d) of each node
        of a depth, one a row, at `temperature` (greedy decoding: at 1). grow_tree scores a node by
        the sum along its prefix. A drafter that reads the text gets text= too, as in draft. A drafter
        that grows no trees leaves this as it is (generate refuses nodes= for it)."""
        raise NotImplementedError(f"{type(self).__name__} grows no token trees (Drafter.next_log_q)")

    def draft_paths(self, h, bonus, target, k, paths, temperature=0.0, generator=None, text=None):
        """Several paths for one call (verification's tree of paths, MATH.md §9): drafts
        (B, paths, k-1) and Q (B, paths, k-1, V), row [:, i] as `draft` returns it for path i (the
        proposal of each token given path i's earlier tokens), or None for point masses.

        Here: `paths` independent draws of `draft`, each row repeated. Any proposal is lossless
        as long as each path's Q is what its tokens were drawn from and the paths are independent
        given what the verifier sees (a drafter may override this to share work, or to draw its
        paths in another way, such as DBlast's one path per branch)."""
        B = h.size(0)
        rows = lambda t: t.repeat_interleave(paths, 0)                      # noqa: E731  one row per path
        own = {} if text is None else {'text': Text(rows(text.tokens), rows(text.n), text.state)}
        drafts, Q = self.draft(rows(h), rows(bonus), target, k, temperature, generator, **own)
        return drafts.view(B, paths, k - 1), None if Q is None else Q.view(B, paths, k - 1, -1)


def grow_tree(log_q, B, n, nodes, device):
    """A best-first token tree of at most `nodes` drafted tokens below the bonus, grown depth by
    depth from a drafter's next_log_q (MATH.md §10): a node's score is the drafter's probability of
    its whole prefix (the sum of log_q along it). At each depth the `nodes` best children of the
    previous depth's best are candidates; of all of them the `nodes` best are taken, ties to the
    shallower, so that a node is never taken without its parent (a child scores no more than its
    parent). n: the depths (k-1). Static shapes, no host sync.

    Returns tokens (B, L - 1) for the block's slots 1..L-1 (parents before children; L - 1 = nodes, or
    fewer where fewer candidates exist) and tree (B, 2, L): each slot's parent slot (the bonus, slot
    0, is its own; -1: padding, a node the drafter gives no probability, which no walk follows) and
    its depth (the bonus: 0)."""
    score = torch.zeros(B, 1, device=device)                    # (B, M) the best nodes of this depth
    prefix = torch.zeros(B, 1, 0, dtype=torch.long, device=device)   # (B, M, d) their drafted prefixes
    ids = torch.zeros(B, 1, dtype=torch.long, device=device)    # their candidate ids (the bonus: 0)
    scores, tokens, parents, depths, count = [], [], [], [], 1
    for d in range(n):   # k-1 depths: k is fixed per graph, so a compiled step unrolls this
        child = score[:, :, None] + log_q(d, prefix)                                # (B, M, V)
        V = child.size(-1)
        score, flat = child.flatten(1).topk(min(nodes, child.size(1) * V), dim=-1)   # (B, N) best first
        up, token = flat.div(V, rounding_mode='floor'), flat % V                    # parent (of M), token
        prefix = torch.cat([prefix.gather(1, up[:, :, None].expand(-1, -1, d)), token[:, :, None]], dim=2)
        parents.append(ids.gather(1, up))
        ids = count + torch.arange(score.size(1), device=device).expand(B, -1)
        count += score.size(1)
        scores.append(score)
        tokens.append(token)
        depths.append(torch.full_like(token, d + 1))
    score, token, parent, depth = (torch.cat(t, dim=1) for t in (scores, tokens, parents, depths))   # depth-major
    # the best of all depths: a stable sort keeps the shallower of equal scores first
    keep = score.sort(dim=-1, descending=True, stable=True).indices[:, :nodes].sort(dim=-1).values   # (B, m)
    m = keep.size(1)
    slot = torch.zeros(B, count, dtype=torch.long, device=device)    # candidate id -> its slot (the bonus: 0)
    slot.scatter_(1, 1 + keep, torch.arange(1, m + 1, device=device).expand(B, -1))
    parent = torch.where(score.gather(1, keep) > -math.inf, slot.gather(1, parent.gather(1, keep)), -1)
    root = torch.zeros(B, 1, dtype=torch.long, device=device)
    tree = torch.stack([torch.cat([root, parent], 1), torch.cat([root, depth.gather(1, keep)], 1)], dim=1)
    return token.gather(1, keep), tree


def sample_tree(log_q, B, branching, device, generator=None):
    """A sampled token tree (MATH.md §10, "A sampled tree"): a node's children are distinct tokens
    drawn without replacement from the drafter's q(. | the node's prefix), in the order drawn (the
    top w of log q + Gumbel noise are an ordered draw without replacement: Gumbel top-k). A later
    child is tried only where every earlier one was refused, so the tree is widest along the
    first-drawn children, its spine: the bonus and the spine's node at depth j get branching[j]
    children, every other node one. log_q as grow_tree's. Static shapes, no host sync.

    Returns tokens (B, m) and tree (B, 2, 1 + m) as grow_tree's (m = tree_size(branching); slots
    depth by depth, the spine's node first, a node's children side by side in the order drawn;
    parent -1, padding: a draw past the tokens q gives any probability, and everything below it),
    and Q (B, 1 + m, V): at each slot the q its children were drawn from (zeros at the deepest)."""
    prefix = torch.zeros(B, 1, 0, dtype=torch.long, device=device)   # (B, M, d) this depth's nodes' prefixes
    real = torch.ones(B, 1, dtype=torch.bool, device=device)         # (B, M) not padding
    first, count = 0, 1        # the slot of this depth's first node, and the slots taken (the bonus: 0)
    tokens, parents, depths, Qs = [], [], [], []
    for d, w in enumerate(branching):   # a fixed number of depths: a compiled step unrolls this
        lq = log_q(d, prefix)                                                       # (B, M, V)
        Qs.append(lq.exp())
        M = lq.size(1)
        u = torch.rand(B, M, lq.size(-1), generator=generator, device=device, dtype=lq.dtype)
        drawn = (lq - (-u.log()).log()).topk(w, dim=-1).indices                      # (B, M, w) in the order drawn
        token = torch.cat([drawn[:, 0], drawn[:, 1:, 0]], dim=1)                    # the spine's w, then one each
        up = torch.cat([torch.zeros(w, dtype=torch.long, device=device), torch.arange(1, M, device=device)])
        real = real[:, up] & (lq[:, up].gather(-1, token[..., None]).squeeze(-1) > -math.inf)
        parents.append(torch.where(real, first + up, -1))
        first, count = count, count + token.size(1)
        prefix = torch.cat([prefix[:, up], token[..., None]], dim=2)
        tokens.append(token)
        depths.append(torch.full_like(token, d + 1))
    Qs.append(torch.zeros_like(Qs[-1][:, :1]).expand(-1, prefix.size(1), -1))
    root = torch.zeros(B, 1, dtype=torch.long, device=device)
    tree = torch.stack([torch.cat([root] + parents, 1), torch.cat([root] + depths, 1)], dim=1)
    return torch.cat(tokens, 1), tree, torch.cat(Qs, 1)


def tree_size(branching):
    """The drafted tokens of a sampled tree of these widths: the spine's node at depth j has b_{j+1}
    children and every other node one, so depth j+1 holds b_{j+1} more nodes than depth j, less one."""
    size, M = 0, 1
    for w in branching:
        M = M - 1 + w
        size += M
    return size


def drafts_from(logits, temperature, sample_drafts, generator=None):
    """Drafts from a drafter's logits (..., V) as the contract asks: their argmax with Q None (a
    point mass) at temperature 0 or when sample_drafts is False, else a draw from
    q = softmax(logits / T) with Q = q (the verifier's Q is what the drafts were drawn from)."""
    if temperature == 0.0 or not sample_drafts:
        return logits.argmax(-1), None
    q = F.softmax(tempered(upcast(logits), temperature), dim=-1)
    return sample(q, generator), q


def scores_from(logits, temperature):
    """What a token tree scores its nodes by (Drafter.next_log_q): log softmax(logits / T) (..., V)
    at the decoding temperature, at 1 under greedy decoding (T = 0 would divide by zero)."""
    return F.log_softmax(tempered(upcast(logits), temperature or 1.0), dim=-1)


class BlockHeads(Drafter):
    ARGS = ('k', 'd_hidden')   # what a checkpoint records to rebuild it (drafters.load_drafter)

    def __init__(self, config, k, d_hidden=None, sample_drafts=True):
        super().__init__()
        if k < 2:
            raise ValueError(f"k={k}: block heads need k >= 2 (1 bonus + at least one draft)")
        self.k = k
        self.d_hidden = d_hidden or config.n_embd
        C = config.n_embd
        self.n_embd = C
        self.c_fc = nn.Linear(C, (k - 1) * self.d_hidden, bias=True)
        self.c_proj = nn.Linear((k - 1) * self.d_hidden, (k - 1) * C, bias=True)
        self.ln = LayerNorm(C, bias=config.bias)
        nn.init.normal_(self.c_fc.weight, std=0.02)
        nn.init.zeros_(self.c_fc.bias)
        nn.init.zeros_(self.c_proj.weight)  # every head starts as the next-token head
        nn.init.zeros_(self.c_proj.bias)
        # sampled drafts (independent block sampling) are the better of the two under sampling in
        # bench.py's table 3; argmax drafts are what greedy BPD verifies
        self.sample_drafts = sample_drafts

    def hidden(self, h, n_heads=None):
        """h (..., C) -> h + o_i (..., n_heads, C) for the first n_heads of the k-1 offset heads."""
        n_heads = self.k - 1 if n_heads is None else n_heads
        a = F.relu(self.c_fc(h))
        # only the first n_heads groups of W2's output are needed: slice the rows, not the result
        rows = n_heads * self.n_embd
        o = F.linear(a, self.c_proj.weight[:rows], self.c_proj.bias[:rows])
        return h.unsqueeze(-2) + o.view(*h.shape[:-1], n_heads, self.n_embd)

    def forward(self, h, lm_head, n_heads=None):
        """Logits (..., n_heads, vocab): head i (0-based; MATH.md §3's head i+1) predicts the token i+1
        positions after the bonus."""
        return lm_head(self.ln(self.hidden(h, n_heads)))

    def head_logits(self, h, lm_head, i):
        """Head i's logits (..., vocab); the random-offset loss materialises only these. Only head
        i's rows of W2 are used. i is an int or a LongTensor of one element: with a tensor the shapes
        do not depend on i, so a compiled training step is one graph for every offset."""
        sel = torch.as_tensor(i, device=h.device).view(1)   # index_select: no host read of i
        a = F.relu(self.c_fc(h))
        w = self.c_proj.weight.view(self.k - 1, self.n_embd, -1).index_select(0, sel)[0]  # (C, (k-1)*d_hidden)
        b = self.c_proj.bias.view(self.k - 1, self.n_embd).index_select(0, sel)[0]        # (C,)
        return lm_head(self.ln(h + F.linear(a, w, b)))

    def summed_ce(self, h, lm_head, sel, labels):
        """Head sel's cross-entropy over rows h (B, C) with labels (B,), summed (-1: no label)."""
        logits = upcast(self.head_logits(h, lm_head, sel))                   # (B, V)
        return F.cross_entropy(logits, labels, ignore_index=-1, reduction='sum')

    def loss(self, h, lm_head, idx, offset=None):
        """Cross-entropy of the heads on a sequence (BPD §6, p. 5; MATH.md §3).

        h (B, T, C) are the target's hidden states over idx[:, :T]; idx (B, T + k) holds the tokens,
        -1 where a position carries no label. Head i (0-based; MATH.md §3's head i+1) at position t
        predicts idx[t+i+2]. offset=None: the full loss, the mean over the k-1 heads (the paper's is
        the sum over all k, MATH.md §3, §8).
        offset=i (int or 0-dim tensor): only head i's loss; drawn uniformly per minibatch, its
        expectation (and its gradient's) is the full loss.

        Memory: when the logits of every head used exceed LOGITS_BUDGET elements, each head's loss
        is summed over chunks of rows whose logits are recomputed in backward (activation
        checkpointing) instead of kept, so backward holds one chunk's logits at a time. Below the
        budget (the byte vocabulary) the plain path runs: no recomputation.
        """
        T = h.size(1)
        shifted = idx.unfold(1, T, 1)                        # (B, k+1, T): row j is idx[:, j:j+T]
        heads = range(self.k - 1) if offset is None else [offset]
        h = h.flatten(0, 1)                                  # (B*T, C)
        n_rows, V = h.size(0), lm_head.weight.size(0)
        rows = max(1, LOGITS_BUDGET // V)                    # rows per chunk
        # nothing random in the heads: no RNG state to stash and restore per chunk
        ce = self.summed_ce if len(heads) * n_rows <= rows else \
            partial(checkpoint, self.summed_ce, use_reentrant=False, preserve_rng_state=False)
        every = torch.arange(self.k - 1, device=idx.device)   # made on the device: no copy from the host per head
        losses = []
        for i in heads:
            sel = every[i:i + 1] if isinstance(i, int) else torch.as_tensor(i, device=idx.device).view(1)
            labels = shifted.index_select(1, sel + 2).flatten()                  # (B*T,)
            total = sum(ce(h[j:j + rows], lm_head, sel, labels[j:j + rows]) for j in range(0, n_rows, rows))
            # the mean over every labelled position of the head, not a mean of per-chunk means
            losses.append(total / labels.ne(-1).sum())
        return torch.stack(losses).mean()

    def mixture_logits(self, h, bonus, target, k):
        """The heads as a one-branch mixture (the view dblast.expected_accepted takes): log pi = 0
        (B, 1) and the logits of the k-1 drafts (B, 1, k-1, V). The bonus is not an input of BPD
        heads."""
        return h.new_zeros(h.size(0), 1), self(h, target.lm_head, k - 1).unsqueeze(1)

    @torch.no_grad()
    def next_log_q(self, h, bonus, target, k, temperature=0.0):
        """Drafter.next_log_q: the heads propose each position independently of the drafts before
        it, so a node's children at drafted position d are scored by that position's head's log q,
        whatever the node's prefix. A tree
        is chosen from the heads' distributions (sample_drafts, how one path is drafted, plays no
        part)."""
        log_q = scores_from(self(h, target.lm_head, k - 1), temperature)   # (B, k-1, V)
        return lambda d, prefix: log_q[:, d, None].expand(-1, prefix.size(1), -1)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        """The drafter contract (Drafter). Argmax drafts are a point mass (Q None); sampled, each
        position is drawn from its own q_i = softmax(logits_i / T), and since the positions are
        independent given h, Q_i = q_i whatever was drafted before."""
        return drafts_from(self(h, target.lm_head, k - 1), temperature, self.sample_drafts, generator)
