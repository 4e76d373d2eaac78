"""
Drafters a reader knows from elsewhere, behind the same verifier: a small draft model with a KV
cache of its own (Leviathan et al. 2023; Chen et al. 2023), prompt lookup (n-gram drafting from
the text itself, training-free), and several drafters' paths in one call (MATH.md §11).

None of them reads the target's hidden state. They read the text instead: a drafter with
`reads_text` is handed the committed tokens of each row, and its own state if it keeps one
(heads.Text; heads.Drafter says how the loop feeds it). The verifier does not change: any proposal
verified against the conditionals it was drawn from is lossless (MATH.md §4, §9), so a draft
model's sampled drafts come with its q, and prompt lookup's drafts are a point mass (Q None), as
argmax drafts are.
"""
import functools

import torch
import torch.nn.functional as F

from heads import Drafter, Text, drafts_from
from model import GPT


class DraftModel(Drafter):
    """A small GPT of this project drafts k-1 tokens autoregressively, with its own static KV cache
    (its state: one cache row per drafted path).

    Catching up. The verifier commits between 1 and k tokens a step, and which ones the draft cache
    saw is known only row by row; so each draft begins by feeding the window of the last k committed
    tokens and the bonus (k + 1 tokens at positions n-k .. n, n the committed length), which covers
    everything committed since the last draft whatever was accepted: after a fully accepted block
    that is the last draft (which the cache never saw, since a draft is not fed until the next is
    needed) and the new bonus. The cache is rolled back by length, as the target's is: its length is
    set to n - k before the window, so what lies past it (rejected drafts, another path's) is never
    read. Then k-2 calls of one token draft the rest. Static shapes, no host sync.

    model: a GPT of the target's vocabulary and at least its context (decode.check_args checks).
    k: the largest block a call drafts for (any k from 2; generate's k= picks it per call).
    sample_drafts: under sampling, draw each draft from the model's own q at the temperature (True)
    or take its argmax (a point mass)."""
    reads_text = True

    def __init__(self, model, k=5, sample_drafts=True):
        super().__init__()
        if not isinstance(model, GPT):
            raise TypeError(f"DraftModel wants a model.GPT, not {type(model).__name__}")
        self.model, self.k, self.sample_drafts = model, k, sample_drafts

    def does_not_fit(self, target):
        """What makes this draft model unusable for the target: another vocabulary (its tokens would
        mean other things) or a shorter context (it could not see what the target sees)."""
        mine, theirs = self.model.config, target.config
        if mine.vocab_size != theirs.vocab_size:
            return f"its vocabulary has {mine.vocab_size} ids, the target's {theirs.vocab_size}"
        if mine.block_size < theirs.block_size:
            return f"its context is {mine.block_size} tokens, shorter than the target's {theirs.block_size}"
        return None

    def new_state(self, rows, max_len):
        return self.model.new_cache(rows, max_len)

    def read_prompt(self, cache, prompt):
        cache.lengths.zero_()
        self.model.forward_cached(prompt, cache)
        cache.commit(prompt.size(1))

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None, text=None):
        """The drafter contract (heads.Drafter); h and target are not read: the draft model has its
        own states. Row i of Q is the model's q after the bonus and drafts 1..i-1."""
        cache, n = text.state, text.n                                    # n (B,): committed tokens
        first = (n - k).clamp(min=0)                                     # (B,) the window's first position
        pos = first[:, None] + torch.arange(k + 1, device=n.device)      # (B, k+1)
        window = text.tokens.gather(1, pos.clamp(max=text.tokens.size(1) - 1))
        # the bonus at position n; a row with n < k has tokens past n in its window, written to the
        # cache past the bonus and overwritten by the drafts before anything reads them
        window = torch.where(pos == n[:, None], bonus[:, None], window)
        cache.lengths.copy_(first)
        hs = self.model.forward_cached(window, cache)                     # (B, k+1, C)
        at = (n - first)[:, None, None].expand(-1, 1, hs.size(-1))       # the bonus's slot
        logits = self.model.lm_head(hs.gather(1, at).squeeze(1))         # (B, V)
        cache.lengths.copy_(n + 1)
        drafts, qs = [], []
        for i in range(k - 1):   # k is fixed per graph: a compiled step unrolls this
            if i > 0:            # feed the last draft: a draft is fed only when the next is needed
                logits = self.model.lm_head(self.model.forward_cached(drafts[-1][:, None], cache)[:, -1])
                cache.commit(1)
            d, q = drafts_from(logits, temperature, self.sample_drafts, generator)
            drafts.append(d)
            qs.append(q)
        return torch.stack(drafts, 1), None if qs[0] is None else torch.stack(qs, 1)


class PromptLookup(Drafter):
    """Prompt lookup: the drafts are what followed the last n-gram where it occurred before in the
    prompt or the text generated so far, with no training. Hugging Face's rule
    (`prompt_lookup_num_tokens`, `max_matching_ngram_size`): the text's last `ngram` tokens (the
    bonus included) are looked for, then its last ngram-1, down to one; the first size with a
    match wins, at its earliest occurrence that has something after it.

    Where the continuation runs into the end of the text Hugging Face drafts fewer tokens; a block
    here has k-1 drafts, and the rest are taken as the text's repetition: a match at i followed by
    P tokens to the end is the text repeating with period P, so the continuation runs on
    periodically. A row with no match drafts the bonus repeated. Drafts are a point mass (Q None),
    whatever the temperature: verification judges them like argmax drafts, losslessly.

    ngram: the longest n-gram looked for (Hugging Face's default: 2). k: 1 bonus + the k-1 drafts
    (Hugging Face's prompt_lookup_num_tokens is k-1)."""
    reads_text = True
    sample_drafts = False      # a point mass: several paths would all be the same (meaningless says so)

    def __init__(self, ngram=2, k=11):
        super().__init__()
        if not (isinstance(ngram, int) and ngram >= 1) or not (isinstance(k, int) and k >= 2):
            raise ValueError(f"ngram={ngram!r}, k={k!r}: prompt lookup wants ngram >= 1 and k >= 2")
        self.ngram, self.k = ngram, k

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None, text=None):
        """The drafter contract (heads.Drafter): drafts (B, k-1), Q None."""
        tokens, n = text.tokens, text.n                                   # (B, W), (B,)
        B, W = tokens.shape
        dev = tokens.device
        cur = tokens.scatter(1, n[:, None], bonus[:, None])             # the text so far: n + 1 tokens
        found = torch.zeros(B, dtype=torch.bool, device=dev)
        start = torch.zeros(B, dtype=torch.long, device=dev)             # where the continuation begins
        for g in range(self.ngram, 0, -1):       # the longest n-gram first
            if g > W - 1:
                continue
            last = cur.gather(1, (n[:, None] + 1 - g + torch.arange(g, device=dev)).clamp(min=0))   # (B, g)
            windows = cur.unfold(1, g, 1)                                # (B, W-g+1, g)
            i = torch.arange(W - g + 1, device=dev)
            # a match with at least one token after it, inside the text (the n-gram itself ends at n)
            hit = (windows == last[:, None, :]).all(-1) & (i + g <= n[:, None]) & (n[:, None] + 1 >= g)
            new = hit.any(-1) & ~found
            start = torch.where(new, hit.long().argmax(-1) + g, start)   # argmax: the earliest
            found |= new
        period = (n + 1 - start).clamp(min=1)                            # tokens from the match's end to the text's
        j = torch.arange(k - 1, device=dev)
        drafts = cur.gather(1, (start[:, None] + j % period[:, None]).clamp(max=W - 1))
        return torch.where(found[:, None], drafts, bonus[:, None]), None


class MixedPaths(Drafter):
    """Several drafters in one call: path i is drafter i's proposal (generate's paths= is the
    number of drafters), all verified in the one target call as one tree of paths (MATH.md §9).
    Each path is verified against its own drafter's conditionals (a point mass for an argmax or a
    lookup path), so the mixture is lossless: the multi-step speculative sampling of §9 allows a
    different proposal for every candidate. Greedy, the longest agreeing path is kept.

    A drafter's state (a draft model's cache) is its own: rows b*N + i of the loop's state are
    drafter i's for prompt b, N = the number of drafters."""

    def __init__(self, drafters):
        super().__init__()
        if len(drafters) < 2:
            raise ValueError("MixedPaths wants at least two drafters (one drafter needs no mixing)")
        self.drafters = torch.nn.ModuleList(drafters)
        self.k = min(d.k for d in drafters)
        self.reads_text = any(getattr(d, 'reads_text', False) for d in drafters)

    def meaningless(self, temperature, paths):
        N = len(self.drafters)
        if paths != N:
            return [('paths', paths, f"a mix of {N} drafters drafts one path each: use paths={N}")]
        return [found for d in self.drafters for found in d.meaningless(temperature, 1)]

    def does_not_fit(self, target):
        return next((why for d in self.drafters if (why := d.does_not_fit(target))), None)

    def new_state(self, rows, max_len):
        N = len(self.drafters)
        return [d.new_state(rows // N, max_len) for d in self.drafters]

    def read_prompt(self, states, prompt):
        N = len(self.drafters)
        for i, (d, state) in enumerate(zip(self.drafters, states)):
            if state is not None:
                d.read_prompt(state, prompt[i::N])

    @torch.no_grad()
    def draft_paths(self, h, bonus, target, k, paths, temperature=0.0, generator=None, text=None):
        """Path i from drafter i (heads.Drafter.draft_paths): drafts (B, N, k-1), Q (B, N, k-1, V)
        with a point mass as a one-hot row (the same test and residual as Q None, MATH.md §4), or
        None where every path is a point mass."""
        out = []
        for i, d in enumerate(self.drafters):
            own = {'text': Text(text.tokens, text.n, text.state[i])} if getattr(d, 'reads_text', False) else {}
            out.append(d.draft(h, bonus, target, k, temperature, generator, **own))
        drafts = torch.stack([dr for dr, _ in out], 1)                   # (B, N, k-1)
        if all(Q is None for _, Q in out):
            return drafts, None
        dtype = functools.reduce(torch.promote_types, (Q.dtype for _, Q in out if Q is not None))
        V = target.config.vocab_size
        return drafts, torch.stack([F.one_hot(dr, V).to(dtype) if Q is None else Q.to(dtype) for dr, Q in out], 1)
