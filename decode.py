"""
Decoding: plain autoregressive, blockwise parallel (BPD, greedy and lossy), and lossless
speculative sampling with a block drafter (BPD heads or DBlast), one block, several drafted paths
or a token tree per target call.

Read in this order (MATH.md has every equation):
  merged_step      one target call: verify the pending block, commit, propose the next (§2)
  tree_step        the same for a token tree (§10)
  the loop         the prefill, advance (a step and what the loop keeps of it), generate
What the target keeps of a block is verification.py's (its acceptance rules and verifiers: read
it first). What only `compile=True` needs (static buffers, compiled steps, several steps a host
call, CUDA graphs) is runner.py's: the loop reads the same without it. generate's argument checks
are arguments.py's. Drafters follow one contract (heads.Drafter); drafters.py holds the ones that
read the text, and loads any drafter. The command line is generate.py's; the model's own
`GPT.generate` (no cache, full recompute) is the reference every greedy path here is tested
against token for token, and plain sampling draw for draw; speculative sampling is tested by
chi-square against the target's enumerated distribution.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

import runner
from arguments import check_accept, check_args
from cli import decoding_threads, num_threads
from heads import Text, grow_tree, sample_tree, tree_size
from model import upcast
from verification import (exact, parse_accept, path_slots, sampled_tree_choice, target_choice, tree_attend,
                          tree_layout, verify, walk_down)
# the names the exercises once read from decode (decode.ACCEPT is verification.ACCEPT, the same table)
from verification import ACCEPT, min_block, top_n, verify_greedy, whole_number  # noqa: F401


# ------------------------------------------------------------------------- the merged step

def merged_step(model, drafter, cache, text, block, Q_block, active, temperature=0.0,
                accept=(exact, None), generator=None, paths=1):
    """One target call verifies `block`, commits what it accepts and proposes the next block (BPD §4
    "Combined Scoring and Proposal Model", p. 3; MATH.md §2).

    block (B, 1 + N(k-1)) = [bonus, path_1 .. path_N], N = `paths` drafted paths of k-1 tokens
    (N = 1: BPD's block [bonus, d_1 .. d_{k-1}]; N > 1: a tree, MATH.md §9). Q_block
    (B, N(k-1), V): for each drafted token the proposal's conditional it was drawn from, given the
    earlier tokens of its path, as the drafter returned it; None for point-mass drafts. The step
    does not know which drafter it has: any proposal verified against its own conditionals is
    lossless. accept: (rule, param) of verification.ACCEPT, for greedy decoding. active (B,) bool:
    rows still generating; the others do not advance. text (heads.Text): each row's committed
    tokens, where the step writes what it commits (and what a drafter that reads the text reads).
    Returns n_acc (B,), the next block and its Q_block.
    Static shapes, no Python loop over positions, no host sync.
    """
    B = block.size(0)
    n = (block.size(1) - 1) // paths                            # drafts per path, k-1
    drafts = block[:, 1:].view(B, paths, n)                     # (B, N, k-1)
    tree = None if paths == 1 else tree_layout(paths, n, block.device)
    h = model.forward_cached(block, cache, tree)                # (B, 1 + N n, C): the one target call
    logits = upcast(model.lm_head(h))                           # (B, 1 + N n, V) after each slot

    n_acc, bonus, path = verify(logits, Q_block, drafts, temperature, accept, generator)

    slots = path_slots(paths, n, block.device)[path]            # (B, k): the kept path's slots
    if paths > 1:                                               # its keys and values next to the bonus
        cache.keep_path(slots[:, 1:])
    cache.commit((n_acc + 1) * active)                          # b, d_1 .. d_{n_acc}
    kept = torch.cat([block[:, :1], drafts[torch.arange(B, device=block.device), path]], dim=1)   # (B, k)
    text = commit_text(text, kept, (n_acc + 1) * active)        # ... and into the text
    if drafter is None:
        return n_acc, bonus[:, None], None

    # propose from the state after the last committed token, the one the new bonus came from.
    # BPD computes proposals at every position in the scoring call; gathering that row first and
    # drafting once gives the same drafts with less work.
    last = slots.gather(1, n_acc[:, None])                      # (B, 1)
    h_acc = h.gather(1, last[:, :, None].expand(B, 1, h.size(-1))).squeeze(1)   # (B, C)
    new_drafts, Q = propose(drafter, h_acc, bonus, model, n + 1, paths, temperature, generator, text)
    return n_acc, torch.cat([bonus[:, None], new_drafts], dim=1), Q


def commit_text(text, kept, tau):
    """Write kept (B, k) at each row's end of text.tokens (the first tau (B,) of them are committed;
    the rest is overwritten by the next step) and return the text after them."""
    text.tokens.scatter_(1, text.n[:, None] + torch.arange(kept.size(1), device=kept.device), kept)
    return Text(text.tokens, text.n + tau, text.state)


def propose(drafter, h, bonus, target, k, paths, temperature, generator, text):
    """The next paths in the block's layout: drafts (B, N(k-1)) and their Q (B, N(k-1), V) or None.
    One path is the contract's `draft`; several are `draft_paths` (heads.Drafter). A drafter that
    reads the text gets it (heads.Text)."""
    own = {'text': text} if getattr(drafter, 'reads_text', False) else {}
    if paths == 1:
        return drafter.draft(h, bonus, target, k, temperature, generator, **own)
    drafts, Q = drafter.draft_paths(h, bonus, target, k, paths, temperature, generator, **own)
    return drafts.flatten(1), None if Q is None else Q.flatten(1, 2)


# ------------------------------------------------------------------------- a token tree, one call
# With nodes=N the block is a tree chosen from the drafter's distributions (heads.grow_tree,
# MATH.md §10): slot 0 the bonus, then up to N drafted tokens, each row its own tree, each slot
# seeing the committed prefix and its ancestors; verification.py walks it with the target's own choices.

def tree_step(model, drafter, cache, text, block, tree, active, temperature, generator, k, nodes, Q=None,
              branching=None):
    """merged_step for a token tree: one target call verifies the tree `block` (B, 1 + m) whose
    shape is `tree` (B, 2, 1 + m), commits the walk's path, and grows the next tree from the state
    after its last token. A sampled tree (branching, its Q (B, 1 + m, V)) is walked by recursive
    rejection sampling. Returns n_acc (B,), the next block, its tree and its Q (None for a
    best-first tree). Static shapes, no host sync."""
    B = block.size(0)
    depth, attend = tree_attend(tree, k - 1)
    h = model.forward_cached(block, cache, (depth, attend))                 # (B, 1 + m, C): the one call
    logits = upcast(model.lm_head(h))
    if branching is None:                                                   # (B, 1 + m) at every node
        choice = target_choice(logits, temperature, generator)
    else:
        choice = sampled_tree_choice(logits, Q, block, tree, temperature, max(branching), generator)
    n_acc, last, slots = walk_down(choice, block, tree, attend, k - 1)
    cache.keep_path(slots)                                                  # the path's keys and values
    cache.commit((n_acc + 1) * active)                                      # b, then the path's n_acc
    text = commit_text(text, torch.cat([block[:, :1], block.gather(1, slots)], dim=1), (n_acc + 1) * active)
    bonus = choice.gather(1, last[:, None]).squeeze(1)                      # the target's own, at the end
    h_last = h.gather(1, last[:, None, None].expand(B, 1, h.size(-1))).squeeze(1)
    drafts, next_tree, next_Q = propose_tree(drafter, h_last, bonus, model, k, nodes, temperature, text, branching,
                                             generator)
    return n_acc, torch.cat([bonus[:, None], drafts], dim=1), next_tree, next_Q


def propose_tree(drafter, h, bonus, target, k, nodes, temperature, text, branching=None, generator=None):
    """The next tree: tokens (B, m), its shape (B, 2, 1 + m) and Q, grown from the drafter's
    distributions after the state h and the bonus: best-first (heads.grow_tree; Q None), or sampled
    with `branching` (heads.sample_tree). A drafter that reads the text gets it (heads.Text)."""
    own = {'text': text} if getattr(drafter, 'reads_text', False) else {}
    log_q = drafter.next_log_q(h, bonus, target, k, temperature, **own)
    if branching is not None:
        return sample_tree(log_q, h.size(0), branching, h.device, generator)
    return *grow_tree(log_q, h.size(0), k - 1, nodes, h.device), None


# ------------------------------------------------------------------------- the loop

class Decoding(NamedTuple):
    """What generate's loop carries from step to step, in buffers written in place (so that several
    steps can run as one graph: runner.py):

        block (B, 1 + N(k-1))     the pending block: the bonus the last call chose, and drafts
                                  (nodes=m: (B, 1 + m), a token tree)
        Q (B, N(k-1), V) or None  the proposal's conditionals the drafts were drawn from (a sampled
                                  tree: (B, 1 + m, V), what each slot's children were drawn from)
        tree (B, 2, 1 + m) or None  a token tree's parent slots and depths (heads.grow_tree)
        out (B, W)                the prompt, then each row's committed tokens (W: room past the end)
        n_out (B,)                tokens committed per row, the prompt included
        total ()                  T0 + max_new_tokens: where every row ends
        taus (S, B)               tau of each step, row by row; 0 where the row took no part
                                  (S: the steps that can run, runner.py's units past the end included)
        t ()                      steps run"""
    block: torch.Tensor
    Q: Optional[torch.Tensor]
    tree: Optional[torch.Tensor]
    out: torch.Tensor
    n_out: torch.Tensor
    total: torch.Tensor
    taus: torch.Tensor
    t: torch.Tensor

    @classmethod
    def like(cls, block, Q, tree, width, rows):
        """Empty buffers for blocks, Q and trees shaped as these, W = width, S = rows."""
        B, long = block.size(0), dict(dtype=torch.long, device=block.device)
        Q, tree = (None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format) for t in (Q, tree))
        return cls(torch.empty_like(block), Q, tree, torch.zeros(B, width, **long), torch.zeros(B, **long),
                   torch.zeros((), **long), torch.zeros(rows, B, **long), torch.zeros((), **long))

    def restart(self, block, Q, tree, prompt):
        """The state after the prefill: its first block, the prompt (B, T0) as the output so far."""
        self.block.copy_(block)
        for buf, t in ((self.Q, Q), (self.tree, tree)):
            if t is not None:
                buf.copy_(t)
        self.out[:, :prompt.size(1)] = prompt
        self.n_out.fill_(prompt.size(1))
        self.taus.zero_()
        self.t.zero_()


def first_block(model, drafter, cache, prompt, temperature, generator, paths, k, nodes=None, state=None,
                branching=None):
    """Call 1, the prefill: the prompt's keys and values into the cache, and from its last hidden
    state the first bonus and drafts. Returns the first block (B, 1 + N(k-1)), its Q, and with
    nodes the first token tree instead (its block (B, 1 + m), Q None (a sampled tree's, with
    branching: (B, 1 + m, V)), its tree). state: the drafter's own (heads.Drafter.new_state), which
    reads the prompt here."""
    h = model.forward_cached(prompt, cache)[:, -1]              # (B, C)
    cache.commit(prompt.size(1))
    bonus = target_choice(upcast(model.lm_head(h)), temperature, generator)
    if drafter is None:
        return bonus[:, None], None, None
    if state is not None:
        drafter.read_prompt(state, prompt.repeat_interleave(paths, 0))   # one row per path
    B, T0 = prompt.shape
    text = Text(F.pad(prompt, (0, 1)), torch.full((B,), T0, device=prompt.device), state)   # room for the bonus
    if nodes:
        drafts, tree, Q = propose_tree(drafter, h, bonus, model, k, nodes, temperature, text, branching, generator)
        return torch.cat([bonus[:, None], drafts], dim=1), Q, tree
    drafts, Q = propose(drafter, h, bonus, model, k, paths, temperature, generator, text)
    return torch.cat([bonus[:, None], drafts], dim=1), Q, None


def advance(model, drafter, cache, d, temperature, accept, generator, paths, k=None, nodes=None, state=None,
            branching=None):
    """One step of generate's loop, in place on its state d (Decoding): the merged step (which writes
    what it commits into d.out), then what the loop keeps of it: each row advanced, tau recorded.
    A step that no row needs any more (each lacks at most its pending bonus) commits nothing and
    leaves each row's pending block as it was, so that a unit of several steps (runner.py) may run
    past the last one needed. With a token tree (d.tree; k and nodes given, and branching for a
    sampled one) the step is tree_step.
    state: the drafter's own, if it keeps one (heads.Drafter.new_state)."""
    needed = d.n_out.min() < d.total - 1
    active = (d.n_out < d.total) & needed                       # (B,) the rows that take part
    text = Text(d.out, d.n_out, state)                          # the step writes what it commits into d.out
    if d.tree is None:
        n_acc, block, Q = merged_step(model, drafter, cache, text, d.block, d.Q, active, temperature, accept,
                                      generator, paths)
    else:
        n_acc, block, tree, Q = tree_step(model, drafter, cache, text, d.block, d.tree, active, temperature,
                                          generator, k, nodes, d.Q, branching)
        d.tree.copy_(torch.where(active[:, None, None], tree, d.tree))    # each row's tree, with its block
    tau = (n_acc.long() + 1) * active                           # (B,); n_acc may come as int32 (exercise 1)
    d.n_out.add_(tau)
    d.taus.index_copy_(0, d.t[None], tau[None])
    d.t.add_(1)
    # a row that took no part keeps its pending block (its bonus is written at the end); its Q is
    # read by no step that counts
    d.block.copy_(torch.where(active[:, None], block, d.block))
    if d.Q is not None:
        d.Q.copy_(Q)


@torch.no_grad()
def generate(model, prompt, max_new_tokens, drafter=None, k=None, temperature=0.0,
             accept="exact", generator=None, compile=False, paths=1, threads='auto', nodes=None, branching=None):
    """Generate max_new_tokens after prompt (B, T0) -> (out (B, T0 + max_new_tokens), stats).

    prompt: token ids (B, T0), an integer tensor on the model's device, every id in the model's
    vocabulary; one prompt is one row, (1, T0) (a 1-D prompt is refused, not guessed at:
    prompt[None] makes it a row). Every argument is checked before any work (arguments.py): a bad
    one, or one that means nothing here (k or a lossy accept rule without a drafter, several paths
    that would all be the same), is one BadInput naming it, what was given and what is allowed.

    drafter=None: plain decoding, one target call per token. With a drafter (any heads.Drafter:
    BlockHeads, DBlastDrafter, your own) every call verifies a block of k = 1 bonus + k-1 drafts.
    The rules are exact: greedy output under accept='exact' is plain greedy decoding's, and sampled
    output has the target's distribution. In floating point a k-token verification pass and a
    one-token step round differently, so a near-tie between two tokens can break the other way
    (MATH.md §2); bench.py and generate.py measure agreement with plain greedy instead of assuming it.
    paths=N verifies N drafted paths per call (MATH.md §9): drafter.draft_paths proposes them.
    nodes=N verifies a tree of at most N drafted tokens per call, chosen best-first from the
    drafter's distributions (drafter.next_log_q, heads.grow_tree) and walked with the target's own
    choices (MATH.md §10): greedy, plain greedy decoding's output; sampling, the target's samples.
    branching=(b_1, .., b_{k-1}) (sampling only) verifies a sampled tree instead: children drawn
    without replacement from the drafter's conditional, b_j for the bonus and the first-drawn
    child at depth j-1 (the spine), one for every other node (heads.sample_tree), walked by recursive
    rejection sampling (MATH.md §10, "A sampled tree").
    compile=True runs the same steps compiled, several a host call, on CUDA as CUDA graphs
    (runner.py; the first call of a configuration pays the compilation: warm up first).
    generator: the source of every random draw (where nothing is drawn, as in greedy decoding with
    BPD heads, it is not used; compile=True draws one number from it, the seed of the device's RNG
    for the call: runner.global_rng_from).
    threads: torch's CPU threads for the length of the call, then as the caller had them: 'auto'
    what the scripts choose (cli.decoding_threads: one for a model under 20M parameters on a CPU,
    many times faster beside a busy process; else the caller's), N that many, None the caller's.

    stats: calls (target calls, the prefill included: a call's last bonus is written without one
    more call, so plain decoding takes m calls for m tokens), tokens (new tokens over the batch),
    tokens_per_call (tokens / calls), mean_tau (tokens committed per step, bonus included, over
    every step of every row), accept_lengths (that tau, step by step, row by row), accept_rate
    (per draft position, the share of steps it was accepted). A row's last step may accept drafts
    past max_new_tokens: tau and accept_rate count them (the target verified them), tokens does
    not (they are cut). generate.merged_stats adds up several calls'.
    """
    k = check_args(model, prompt, max_new_tokens, drafter, k, temperature, paths=paths, nodes=nodes,
                   generator=generator, compile=compile, threads=threads, branching=branching)
    rule, param = parse_accept(accept, model.config.vocab_size)
    check_accept(accept, param, temperature, drafter, k, nodes)
    if branching is not None:
        branching, nodes = tuple(branching), tree_size(branching)
    with num_threads(decoding_threads(model, prompt.device) if threads == 'auto' else threads):
        return decode_loop(model, prompt, max_new_tokens, drafter, k, temperature, (rule, param), generator, compile,
                           paths, nodes, branching)


def decode_loop(model, prompt, max_new_tokens, drafter, k, temperature, accept, generator, compile, paths, nodes=None,
                branching=None):
    """generate's loop, its arguments checked: the prefill (call 1), then merged steps until every
    row lacks at most its pending bonus. compile=True runs the same prefill and steps on static
    buffers, several steps a host call (runner.Compiled), drawing from the device's global RNG
    seeded from `generator` (runner.global_rng_from): a generator passed into a compiled step
    would split its graph at every draw."""
    B, T0 = prompt.shape
    prompt, total = prompt.long(), T0 + max_new_tokens
    # spare room past the end: a row may overshoot `total` by k-1 tokens, and a row that is done
    # still runs (and writes) one block of 1 + paths(k-1) (or 1 + nodes) slots per step until every
    # row is done; none of it is kept
    room = k + 1 + max(paths * (k - 1), nodes or 0)
    # a drafter's own state past the text: the bonus and k-1 drafts, or a tree's chains of drafts
    # (a draft model feeds every node's prefix at each depth: drafters.DraftModel.next_log_q)
    own_room = 2 * k + (nodes or 0) * k
    g = None if compile else generator

    def prefill(cache, state, prompt):
        return first_block(model, drafter, cache, prompt, temperature, g, paths, k, nodes, state, branching)

    def step(cache, state, d):
        advance(model, drafter, cache, d, temperature, accept, g, paths, k, nodes, state, branching)

    def drafter_state(width):   # a drafter's own state (a draft model's cache): one row per path
        new_state = getattr(drafter, 'new_state', None)   # a drafter of its own class may lack it: no state
        return None if new_state is None else new_state(B * paths, width)

    with runner.global_rng_from(generator if compile else None, prompt.device):
        if compile:
            context = model.config.block_size
            loop = runner.Compiled(model, drafter, B, room, (k, paths, nodes, temperature, accept, branching),
                                   prefill, step, lambda block, Q, tree: Decoding.like(
                                       block, Q, tree, context + 2 * k, context + runner.largest_unit()),
                                   lambda: drafter_state(context + own_room))
            d, run = loop.start(prompt, total), loop.steps
        else:
            cache, state = model.new_cache(B, total + room), drafter_state(total + own_room)
            block, Q, tree = prefill(cache, state, prompt)
            d = Decoding.like(block, Q, tree, total + 2 * k, max_new_tokens)
            d.restart(block, Q, tree, prompt)
            d.total.fill_(total)

            def run(n):
                for _ in range(n):
                    step(cache, state, d)
        while (behind := tokens_behind(d.n_out, total)) > 0:   # the loop's one read from the device
            # a step commits at most k tokens a row, so the next ceil(behind / k) steps are needed
            # whatever they accept: run them without asking (the host can queue them)
            run(-(-behind // k))
    return finished(d, B, total, max_new_tokens, k)


def tokens_behind(n_out, total):
    """How many tokens the slowest row still needs target calls for, the loop's one read from the
    device: all it lacks but its pending bonus, which the last call already chose."""
    return int(total - 1 - n_out.min())


def finished(d, B, total, max_new_tokens, k):
    """The output (B, total = T0 + max_new_tokens) and the stats of a loop whose state is d."""
    # every row lacks at most its pending bonus, which the last call chose: it takes no call (a
    # finished row's lands past its end, where nothing is kept)
    d.out.scatter_(1, d.n_out[:, None], d.block[:, :1])
    taus = d.taus[:int(d.t)].cpu()                             # (steps, B), 0: no part in the step
    tau = taus[taus > 0]                                       # step by step, row by row
    accepted = tau[:, None] > torch.arange(1, k)                # (row-steps, k-1) draft j accepted
    calls = 1 + int((taus > 0).any(1).sum())                   # the prefill, and each step a row took part in
    tokens = B * max_new_tokens
    stats = dict(calls=calls, tokens=tokens, tokens_per_call=tokens / calls,
                 mean_tau=float(tau.float().mean()) if len(tau) else float('nan'), accept_lengths=tau.tolist(),
                 accept_rate=accepted.float().mean(0).tolist() if k > 1 and len(tau) else [])
    return d.out[:, :total].clone(), stats
