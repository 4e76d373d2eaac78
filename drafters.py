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

At the end, loading any drafter from its checkpoint: `load_drafter` (BPD heads, DBlast: a kind of
drafter is one entry of DRAFTERS), checked against the target it drafts for before any weight is
made, and `load_draft_model` (a draft model from a target checkpoint), checked once it is built.
"""
import functools

import torch
import torch.nn.functional as F

from cli import BadInput, first_line
from data import Vocab, check_finite, describe, load_checkpoint, target_from, vocab_for
from dblast import DBlastDrafter
from heads import BlockHeads, Drafter, Text, drafts_from, scores_from
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
    read. Then k-2 calls of one token draft the rest (a token tree: one call a depth, next_log_q).
    Static shapes, no host sync.

    model: a GPT of the target's vocabulary and at least its context (arguments.check_args checks).
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

    def catch_up(self, bonus, k, text):
        """Feed the window of the last k committed tokens and the bonus (the class's docstring) and
        return the model's logits after the bonus (B, V); the cache then holds the text and the
        bonus (length n + 1)."""
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
        cache.lengths.copy_(n + 1)
        return self.model.lm_head(hs.gather(1, at).squeeze(1))           # (B, V)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None, text=None):
        """The drafter contract (heads.Drafter); h and target are not read: the draft model has its
        own states. Row i of Q is the model's q after the bonus and drafts 1..i-1."""
        cache = text.state
        logits = self.catch_up(bonus, k, text)
        drafts, qs = [], []
        for i in range(k - 1):   # k is fixed per graph: a compiled step unrolls this
            if i > 0:            # feed the last draft: a draft is fed only when the next is needed
                logits = self.model.lm_head(self.model.forward_cached(drafts[-1][:, None], cache)[:, -1])
                cache.commit(1)
            d, q = drafts_from(logits, temperature, self.sample_drafts, generator)
            drafts.append(d)
            qs.append(q)
        return torch.stack(drafts, 1), None if qs[0] is None else torch.stack(qs, 1)

    @torch.no_grad()
    def next_log_q(self, h, bonus, target, k, temperature=0.0, text=None):
        """heads.Drafter.next_log_q, for token trees (MATH.md §10): the model's own log q at the
        temperature (greedy: 1) after each node's prefix. After the catch-up, each depth d is one
        call of the model: every node's prefix (B, M, d) fed as M chains after the bonus, each chain
        seeing the text, the bonus and its own earlier tokens (written to the cache past the bonus,
        and overwritten by the next depth's). Its state needs room for the chains: new_state's
        max_len includes nodes * k (decode's loop gives it)."""
        cache = text.state
        log_q0 = scores_from(self.catch_up(bonus, k, text), temperature)

        def log_q(d, prefix):                                             # prefix (B, M, d)
            B, M, _ = prefix.shape
            if d == 0:
                return log_q0[:, None].expand(B, M, -1)
            slot = torch.arange(M * d, device=prefix.device)
            depth, chain = slot % d, slot.div(d, rounding_mode='floor')     # (M d,) token j of chain m
            attend = (chain[:, None] == chain[None, :]) & (depth[None, :] <= depth[:, None])
            hs = self.model.forward_cached(prefix.flatten(1), cache, (depth, attend))   # (B, M d, C)
            logits = self.model.lm_head(hs[:, d - 1::d])                 # (B, M, V) after each chain
            return scores_from(logits, temperature)
        return log_q


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

    def occurrences(self, text, bonus, k):
        """Where the text's last n-gram occurred before, and what followed each occurrence:
        hit (B, W) bool, an occurrence of the longest n-gram size with any (ending inside the text,
        with something after it) starting at each position; cont (B, W, k-1), the k-1 tokens after
        each, periodic past the text's end (the class's docstring)."""
        tokens, n = text.tokens, text.n                                   # (B, W), (B,)
        B, W = tokens.shape
        dev = tokens.device
        cur = tokens.scatter(1, n[:, None], bonus[:, None])             # the text so far: n + 1 tokens
        hit = torch.zeros(B, W, dtype=torch.bool, device=dev)
        size = torch.zeros(B, 1, dtype=torch.long, device=dev)           # the n-gram size each row matched
        for g in range(self.ngram, 0, -1):       # the longest n-gram first
            if g > W - 1:
                continue
            last = cur.gather(1, (n[:, None] + 1 - g + torch.arange(g, device=dev)).clamp(min=0))   # (B, g)
            i = torch.arange(W - g + 1, device=dev)
            # a match with at least one token after it, inside the text (the n-gram itself ends at n)
            at = (cur.unfold(1, g, 1) == last[:, None, :]).all(-1) & (i + g <= n[:, None]) & (n[:, None] + 1 >= g)
            new = at.any(-1, keepdim=True) & (size == 0)                  # (B, 1) the first size with a match
            hit = torch.where(new, F.pad(at, (0, g - 1)), hit)
            size = torch.where(new, g, size)
        start = torch.arange(W, device=dev) + size                        # (B, W) where each continuation begins
        period = (n[:, None] + 1 - start).clamp(min=1)                    # tokens from there to the text's end
        j = torch.arange(k - 1, device=dev)
        at = (start[..., None] + j % period[..., None]).clamp(max=W - 1)   # (B, W, k-1)
        return hit, cur.gather(1, at.flatten(1)).view(B, W, k - 1)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None, text=None):
        """The drafter contract (heads.Drafter): drafts (B, k-1), Q None: the continuation of the
        earliest occurrence, or the bonus repeated where there is none."""
        hit, cont = self.occurrences(text, bonus, k)
        first = cont.gather(1, hit.long().argmax(-1)[:, None, None].expand(-1, 1, k - 1)).squeeze(1)  # argmax: earliest
        return torch.where(hit.any(-1, keepdim=True), first, bonus[:, None]), None

    @torch.no_grad()
    def next_log_q(self, h, bonus, target, k, temperature=0.0, text=None):
        """heads.Drafter.next_log_q, for token trees (MATH.md §10): every occurrence of the matched
        n-gram proposes its continuation, and a node's children are scored by how many occurrences
        that continue the node's prefix continue with each token (log of that share; -inf for a
        token none continues with, which grow_tree pads). A tree then holds the continuations the
        text repeats most, where one path holds the earliest's. The temperature plays no part: the
        walk follows the target's own choices, whatever the tree."""
        hit, cont = self.occurrences(text, bonus, k)                      # (B, W), (B, W, k-1)
        V = target.config.vocab_size

        def log_q(d, prefix):                                             # prefix (B, M, d)
            B, M, _ = prefix.shape
            on = hit[:, None, :] & (cont[:, None, :, :d] == prefix[:, :, None, :]).all(-1)   # (B, M, W)
            count = torch.zeros(B, M, V, device=on.device).scatter_add_(
                2, cont[:, None, :, d].expand(B, M, -1), on.float())       # (B, M, V) occurrences per next token
            return count.log() - on.sum(-1, keepdim=True).float().clamp(min=1).log()   # none: -inf, not NaN
        return log_q


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


# ------------------------------------------------------------------------- loading drafters

# A drafter checkpoint's 'kind' -> its class; the class's ARGS name the checkpoint fields its
# constructor takes after the target's config. A new kind of drafter is one more entry.
DRAFTERS = {'heads': BlockHeads, 'dblast': DBlastDrafter}
WHAT = {'heads': 'BPD heads', 'dblast': 'DBlast drafter'}


def load_drafter(path, target, kind=None, vocab=None):
    """A drafter checkpoint of any kind in DRAFTERS, checked against the target it was trained for
    (weights fingerprint, and the vocabulary when both record one). kind: the one kind to accept.
    Its weights' names and shapes are checked against the drafter its fields describe, built on
    the meta device (no memory), before any tensor is made: a crafted size is refused, not
    allocated."""
    if not isinstance(target, GPT):
        raise BadInput(f"target is {describe(target)}; want the model.GPT the drafter was trained for "
                       f"(data.load_target)")
    if kind is not None and kind not in DRAFTERS:
        raise BadInput(f"kind={kind!r}: want one of {', '.join(map(repr, DRAFTERS))}, or None for any")
    if vocab is not None and not isinstance(vocab, Vocab):
        raise BadInput(f"vocab is {describe(vocab)}; want a data.Vocab (data.load_vocab) or None")
    ckpt = load_checkpoint(path)       # every field it carries checked for type and range (data.FIELDS)
    have = ckpt.get('kind')
    if have not in DRAFTERS or (kind is not None and have != kind):
        flag = {'heads': '--heads', 'dblast': '--drafter', None: '--ckpt or --draft-model'}.get(have)   # generate.py's
        raise BadInput(f"{path} is not a {WHAT.get(kind, 'drafter')} checkpoint (it is a "
                       f"{WHAT.get(have, have or 'target model')} checkpoint"
                       + (f": give it with {flag})" if flag else ")"))
    if ckpt.get('base_fingerprint') != target.fingerprint():
        raise BadInput(f"{path} was trained for another base model (fingerprint "
                       f"{ckpt.get('base_fingerprint')} != {target.fingerprint()}); retrain it")
    trained_with = ckpt.get('vocab') and Vocab.from_state(ckpt['vocab'], path)
    if vocab is not None and trained_with and trained_with != vocab:
        raise BadInput(f"{path} was trained with a different vocabulary ({trained_with}) than the "
                       f"target's ({vocab}); give the target's --meta or retrain the drafter")
    cls = DRAFTERS[have]
    missing = [a for a in ('drafter',) + cls.ARGS if a not in ckpt]
    if missing:
        raise BadInput(f"drafter checkpoint {path} is malformed (it has no {missing[0]!r})")
    # built for the target the fingerprint names, whatever config the file says
    args = {a: ckpt[a] for a in cls.ARGS}
    with torch.device('meta'):
        shapes = {n: tuple(t.shape) for n, t in cls(target.config, **args).state_dict().items()}
    held = {n: tuple(t.shape) for n, t in ckpt['drafter'].items()}
    if held != shapes:
        odd = sorted(set(shapes) ^ set(held)) or [n for n in shapes if shapes[n] != held[n]]
        raise BadInput(f"drafter checkpoint {path} is malformed: its {', '.join(f'{a}={v}' for a, v in args.items())} "
                       f"do not fit its weights ({odd[0]}: {held.get(odd[0], 'missing')}, want "
                       f"{shapes.get(odd[0], 'none')})")
    try:
        drafter = cls(target.config, **args)
        drafter.load_state_dict(ckpt['drafter'])
    except Exception as e:  # anything the checks above did not foresee
        raise BadInput(f"drafter checkpoint {path} is malformed ({first_line(e, type(e).__name__)})")
    check_finite(drafter, path)
    p = target.lm_head.weight
    return drafter.to(p.device, p.dtype).eval()


def load_draft_model(path, target, vocab=None, k=6):
    """A draft model (drafters.DraftModel) from a target checkpoint of this project or nanoGPT's
    (one whose vocabulary is recorded, or found as data.vocab_for finds it), on the target's
    device. Checked against the target: its target's fingerprint first, where it was trained for
    one (train.py --stages draft records it); once built, its vocabulary's size and its context
    (DraftModel.does_not_fit), and its vocabulary against `vocab`, the target's, where given."""
    if not isinstance(target, GPT):
        raise BadInput(f"target is {describe(target)}; want the model.GPT the draft model drafts for")
    ckpt = load_checkpoint(path)
    if ckpt.get('kind') in DRAFTERS:
        raise BadInput(f"{path} is a {WHAT[ckpt['kind']]} checkpoint, not a model's: give it with "
                       f"{'--heads' if ckpt['kind'] == 'heads' else '--drafter'}")
    if 'base_fingerprint' in ckpt and ckpt['base_fingerprint'] != target.fingerprint():
        raise BadInput(f"{path} was trained as a draft model for another target (fingerprint "
                       f"{ckpt['base_fingerprint']} != {target.fingerprint()}); retrain it, or use a plain base model")
    drafter = DraftModel(target_from(ckpt, path, target.lm_head.weight.device), k=k)
    why = drafter.does_not_fit(target)
    if why:
        raise BadInput(f"{path} cannot draft for this target: {why}")
    mine = vocab_for(ckpt, path, drafter.model.config.vocab_size)
    if vocab is not None and mine != vocab:
        raise BadInput(f"{path} has another vocabulary ({mine}) than the target's ({vocab}): its tokens would mean "
                       f"other things")
    return drafter.to(dtype=target.lm_head.weight.dtype).eval()
