"""
Decoding: plain autoregressive, blockwise parallel (BPD, greedy and lossy), and lossless
speculative sampling with a block drafter (BPD heads or DBlast), one block, several drafted paths
or a token tree per target call.

Read in this order (MATH.md has every equation):
  the acceptance rules and verifiers   one block (MATH.md §2, §4) and a tree of paths (§9)
  a token tree                         its block and its walks: with the target's own choices, or a
                                       sampled tree's by recursive rejection sampling (§10)
  merged_step                          one target call: verify, commit, propose
  the loop                             the prefill, advance (a step and what the loop keeps of
                                       it), generate
What only `compile=True` needs (static buffers, compiled steps, several steps a host call, CUDA
graphs) is runner.py's: the loop reads the same without it. generate's argument checks are
arguments.py's (the acceptance rule's text is read here, beside its table: parse_accept).
Drafters follow one contract (heads.Drafter); drafters.py holds the ones that read the text, and
loads any drafter. The command line is generate.py's; the model's own `GPT.generate` (no cache,
full recompute) is the reference every greedy path here is tested against token for token, and
plain sampling draw for draw; speculative sampling is tested by chi-square against the target's
enumerated distribution.
"""
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

import runner
from arguments import check_accept, check_args, named
from cli import BadInput, decoding_threads, num_threads
from heads import Text, grow_tree, sample_tree, tree_size
from model import sample, tempered, upcast


# ------------------------------------------------------------------------- verification
# One decoding step verifies the pending block [bonus, d_1 .. d_{k-1}] with verify_greedy or
# verify_sampled, each built from small pieces named once here: which drafts pass (an acceptance
# rule of the table ACCEPT, or speculative sampling's test accept_sampled), the bonus after a
# rejection (residual), and what is committed (accept_prefix). Exercises replace exactly these.

# Greedy acceptance rules (BPD "Blockwise Parallel Decoding", p. 2; the lossy ones of "Approximate
# Inference", p. 4). A rule reads the target's logits after every block position (B, k, V) and
# the drafts (B, k-1), and says which drafts it lets through: ok (B, k-1) bool, where ok[:, j]
# judges draft j+1 by the logits after position j. Only the prefix before the first refusal is
# committed (accept_prefix), and the bonus is the target's argmax after it, so every rule keeps at
# least the target's own token.

def exact(logits, drafts, param=None):
    """BPD's verify substep (p. 2): draft j+1 is the target's argmax after position j (lossless)."""
    return drafts == logits[:, :-1].argmax(-1)


def top_n(logits, drafts, size):
    """BPD "Top-k Selection" (§5.1, p. 4): any draft among the target's `size` most likely tokens
    (topk:N, N = size)."""
    return (logits[:, :-1].topk(size, dim=-1).indices == drafts.unsqueeze(-1)).any(-1)


def min_block(logits, drafts, size):
    """BPD "Minimum Block Size" (§5.3, pp. 4-5): the first size-1 drafts are taken whatever they
    are, the rest as `exact`, so a step commits at least `size` tokens (minblock:N, N = size)."""
    first = torch.arange(1, drafts.size(1) + 1, device=drafts.device) < size
    return exact(logits, drafts) | first


def whole_number(text, vocab_size, upto_vocab=False):
    """A rule's parameter N >= 1 (and < 2^31; <= vocab_size when upto_vocab)."""
    if not (text.isascii() and text.isdigit() and 1 <= int(text) < 2 ** 31):
        raise ValueError("need a whole number N >= 1 (and < 2^31)")
    if upto_vocab and vocab_size is not None and int(text) > vocab_size:
        raise ValueError(f"N must be <= the vocabulary size {vocab_size}")
    return int(text)


# name -> (rule, how to read 'name:param' (text, vocab_size) -> param, or None: no parameter).
# A new rule is one more entry; every rule but 'exact' is lossy, so greedy-only.
ACCEPT = {
    'exact': (exact, None),
    'topk': (top_n, lambda text, V: whole_number(text, V, upto_vocab=True)),
    'minblock': (min_block, whole_number),
}


def parse_accept(accept, vocab_size=None, cli=False):
    """'exact' | 'topk:N' | 'minblock:N' | any entry of ACCEPT -> (rule, param). Without a
    vocab_size only what the text itself says is checked (generate.py does it before loading)."""
    usage = ', '.join(n if read is None else f"{n}:N" for n, (_, read) in ACCEPT.items())
    if not isinstance(accept, str):
        raise BadInput(f"{named('accept', accept, cli)}: want a rule's name, one of {usage}")
    name, colon, text = accept.partition(':')
    if name not in ACCEPT or (ACCEPT[name][1] is None) != (not colon):
        raise BadInput(f"{named('accept', accept, cli)}: use one of {usage}")
    rule, read = ACCEPT[name]
    try:
        return rule, None if read is None else read(text, vocab_size)
    except ValueError as e:
        raise BadInput(f"{named('accept', accept, cli)}: {e} (use one of {usage})")


def accept_sampled(p, Q, drafts, generator=None):
    """Speculative sampling's test (MATH.md §4): draft j+1 is accepted with probability
    min(1, P_j(d) / Q_{j+1}(d)). p (B, k-1, V): the target's distributions after positions
    0..k-2; Q (B, k-1, V): the proposal's conditionals the drafts were drawn from, or None for
    point-mass drafts (Q(d) = 1); drafts (B, k-1). Returns ok (B, k-1) bool."""
    p_d = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    Q_d = 1.0 if Q is None else Q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    coin = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p.dtype)
    return coin * Q_d < p_d


def residual(p, Q, drafts):
    """Where a draft was rejected the bonus comes from norm(max(0, p - Q)) (MATH.md §4).
    p (B, n, V), Q (B, n, V) or None for point-mass (argmax) drafts, drafts (B, n).
    A point mass puts all of Q on the draft, so the residual is p without the draft's mass.
    Returned unnormalised (`sample` normalises); an all-zero row (p == Q, where rejection has
    probability zero, or rounding) falls back to p so it can never divide by zero."""
    if Q is None:
        r = p.scatter(-1, drafts.unsqueeze(-1), 0.0)
    else:
        r = (p - Q).clamp_(min=0.0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def accept_prefix(ok, candidates):
    """What a step keeps (BPD's accept substep, p. 2): the drafts before the first one refused,
    then the bonus there. ok (B, k-1) bool; candidates (B, k): the bonus to take after each block
    position. Returns accepted (B, k-1) bool (False from the first refusal on), n_acc (B,)
    accepted drafts, and the bonus candidates[:, n_acc] (B,)."""
    accepted = ok.long().cumprod(-1).bool()                 # nothing counts past a rejection
    n_acc = accepted.sum(-1)
    return accepted, n_acc, candidates.gather(1, n_acc[:, None]).squeeze(1)


def verify_greedy(logits, drafts, accept=(exact, None)):
    """Greedy verification (BPD, p. 2; MATH.md §2): logits (B, k, V) of the target after each
    block position, drafts (B, k-1), accept = (rule, param) of ACCEPT. Returns accepted (B, k-1),
    n_acc (B,) and the bonus (B,): the target's argmax after the last accepted draft."""
    rule, param = accept
    return accept_prefix(rule(logits, drafts, param), logits.argmax(-1))


def verify_sampled(logits, Q, drafts, temperature, generator=None):
    """Lossless speculative sampling (MATH.md §4): the same as verify_greedy, for temperature > 0.
    Q (B, k-1, V): the proposal's conditionals the drafts were drawn from, at the same
    temperature (None: point masses). The bonus is a sample of the residual after a rejection at
    j, or of p after the last position when every draft passed."""
    p = F.softmax(tempered(logits, temperature), dim=-1)      # (B, k, V) p_target
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    # every position's candidate bonus is drawn now, so the step stays one call without a sync
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], dim=1)
    return accept_prefix(ok, sample(weights, generator))


# ------------------------------------------------------------------------- several paths, one call
# With N > 1 drafted paths the block is a tree (MATH.md §9, with a worked example): slot 0 the
# bonus, then path i's token j at slot 1 + i(k-1) + j, each slot attending to the committed
# prefix, the bonus and the earlier tokens of its own path. Greedy keeps the path with the longest
# agreeing prefix; sampling verifies node by node by multi-step speculative sampling.

def tree_layout(paths, n, device):
    """The block of `paths` paths of n drafts after one bonus: each slot's depth below the bonus
    (L,) and who sees whom, attend (L, L) bool (L = 1 + paths * n)."""
    slot = torch.arange(1 + paths * n, device=device)
    path = (slot - 1).div(n, rounding_mode='floor')                  # the bonus: -1
    depth = torch.where(slot == 0, 0, (slot - 1) % n + 1)
    attend = (slot[None, :] == 0) | ((path[:, None] == path[None, :]) & (depth[None, :] <= depth[:, None]))
    return depth, attend


def path_slots(paths, n, device):
    """(paths, 1 + n): the slots of each path's tokens, its bonus (slot 0) first."""
    return torch.cat([torch.zeros(paths, 1, dtype=torch.long, device=device),
                      1 + torch.arange(paths * n, device=device).view(paths, n)], dim=1)


def tree_nodes(drafts):
    """Which slot holds which node of the tree of paths drafts (B, N, n) (MATH.md §9's example).
    A node is a prefix of drafted tokens; the first path with that prefix holds it at its slot.

    same (B, N, N, n) bool: same[:, i, i', j], paths i and i' agree on their tokens 0..j
    first (B, N, n): the first path that agrees with path i on its tokens 0..j
    node (B, N, 1 + n): the slot of path i's node at depth j, the prefix of its first j tokens
        (depth 0: the bonus, slot 0)
    through (B, 1 + N n, N) bool: path i's next token is a candidate at slot s (path i has slot
        s's prefix, and s is not a leaf)"""
    B, N, n = drafts.shape
    dev = drafts.device
    same = (drafts[:, :, None, :] == drafts[:, None, :, :]).long().cumprod(-1).bool()   # (B, N, N, n)
    first = same.long().argmax(2)                                                        # (B, N, n)
    node = torch.cat([torch.zeros(B, N, 1, dtype=torch.long, device=dev),
                      1 + first * n + torch.arange(n, device=dev)], dim=-1)            # (B, N, 1 + n)
    depth, _ = tree_layout(N, n, dev)
    through = torch.cat([torch.ones(B, 1, N, dtype=torch.bool, device=dev),
                         same.permute(0, 1, 3, 2).flatten(1, 2)], dim=1) & (depth < n)[None, :, None]
    return same, first, node, through


def tree_walk(kept_token, node, drafts):
    """The walk from the bonus down the tree (MATH.md §9's example). kept_token (B, 1 + N n): the
    token accepted at each slot's node (-1: none, or a leaf); node (B, N, 1 + n) of tree_nodes;
    drafts (B, N, n). Path i's token j is kept where it is the token accepted at its parent node
    (match (B, N, n)); n_acc (B,) is the longest kept prefix, path (B,) the first path with it,
    last (B,) the slot where the walk stops, whose p (or what is left of it) gives the bonus."""
    B, N, n = drafts.shape
    match = kept_token.gather(1, node[:, :, :-1].flatten(1)).view(B, N, n) == drafts       # (B, N, n)
    n_acc, path = longest(match.long().cumprod(-1).sum(-1))                              # (B,), (B,)
    last = node[torch.arange(B, device=drafts.device), path, n_acc]
    return match, n_acc, path, last


def longest(n_accs):
    """n_accs (B, N) accepted drafts per path -> the most (B,) and the first path with it (B,)."""
    path = n_accs.argmax(-1)                                    # argmax: the first of equals
    return n_accs.gather(1, path[:, None]).squeeze(1), path


def verify_tree_greedy(logits, drafts, accept=(exact, None)):
    """Greedy verification of N paths (B, N, n) from the logits after every slot (B, 1 + N n, V):
    each path verified as one block by the acceptance rule (verify_greedy), the longest kept
    (ties: the first). Returns n_acc (B,), bonus (B,), path (B,)."""
    B, N, n = drafts.shape
    per_path = logits[:, path_slots(N, n, logits.device)]                      # (B, N, 1 + n, V)
    _, n_accs, bonuses = verify_greedy(per_path.flatten(0, 1), drafts.flatten(0, 1), accept)
    n_acc, path = longest(n_accs.view(B, N))
    return n_acc, bonuses.view(B, N).gather(1, path[:, None]).squeeze(1), path


def try_candidate(r, Q, x, tried, generator=None):
    """One round of multi-step speculative sampling at every node at once (MATH.md §9): where
    `tried` (B, L), candidate x (B, L), drawn from Q (B, L, V) (None: a point mass), is accepted with
    probability min(1, r(x) / Q(x)); where it is refused, what is left of p becomes
    norm(max(0, r - Q)). Returns ok (B, L) and r (B, L, V) after the round."""
    ok = accept_sampled(r, Q, x, generator) & tried
    left = residual(r, Q, x)                                           # r after refusing x
    return ok, torch.where((tried & ~ok)[..., None], left / left.sum(-1, keepdim=True), r)


def verify_tree_sampled(logits, Q, drafts, temperature, generator=None):
    """Multi-step speculative sampling over N drafted paths (MATH.md §9), lossless.

    logits (B, L, V) after every slot (L = 1 + N n); drafts (B, N, n); Q (B, N, n, V): Q[:, i, j] is what
    path i's token j was drawn from, given path i's earlier tokens (None: point masses). At each
    node the candidates are the next tokens of the paths through it (tree_nodes), tried in path
    order, each against what is left of p (the residual after the earlier ones). Every node's
    outcome is drawn at once (static shapes, no host sync; a node the walk does not reach is
    never read), then the walk from the bonus follows the accepted tokens: path i's token j is
    kept where it is the token accepted at its parent node, so every path with the accepted
    prefix continues below it, duplicates included. The bonus is a sample of what is left of p
    at the node where the walk stops (all of p after a fully accepted path).
    Returns n_acc (B,), bonus (B,), path (B,): the first path with the kept prefix."""
    B, N, n = drafts.shape
    p = F.softmax(tempered(logits, temperature), dim=-1)               # (B, L, V) p_target at each slot
    _, _, node, through = tree_nodes(drafts)
    depth, _ = tree_layout(N, n, drafts.device)
    at = depth.clamp(max=n - 1)                                        # the candidates' token index
    cand = drafts[:, :, at].transpose(1, 2)                            # (B, L, N)
    r, done = p, torch.zeros(B, 1 + N * n, dtype=torch.bool, device=drafts.device)
    chosen = torch.zeros_like(done, dtype=torch.long)
    for i in range(N):   # candidates in path order; each pass covers every node at once
        Q_path = None if Q is None else Q[:, i, at]                    # (B, L, V) path i's Q
        ok, r = try_candidate(r, Q_path, cand[:, :, i], through[:, :, i] & ~done, generator)
        chosen = torch.where(ok, i, chosen)
        done = done | ok
    kept_token = torch.where(done, cand.gather(-1, chosen[..., None]).squeeze(-1), -1)   # (B, L)
    fallback = sample(r, generator)                                                      # (B, L)
    _, n_acc, path, last = tree_walk(kept_token, node, drafts)
    return n_acc, fallback.gather(1, last[:, None]).squeeze(1), path


def verify(logits, Q, drafts, temperature, accept, generator=None):
    """The verifier a step needs: logits (B, 1 + N n, V) after every slot of the block, drafts
    (B, N, n), Q (B, N n, V) or None. Returns n_acc (B,), bonus (B,) and the kept path (B,)."""
    B, N, n = drafts.shape
    if N > 1:                                                   # a tree of paths (MATH.md §9)
        if temperature == 0.0:
            return verify_tree_greedy(logits, drafts, accept)
        return verify_tree_sampled(logits, None if Q is None else Q.view(B, N, n, -1), drafts, temperature,
                                   generator)
    path = torch.zeros(B, dtype=torch.long, device=drafts.device)
    if n == 0:                                                  # plain decoding: nothing to verify
        return path, target_choice(logits[:, 0], temperature, generator), path
    if temperature == 0.0:                                      # MATH.md §2
        _, n_acc, bonus = verify_greedy(logits, drafts[:, 0], accept)
    else:                                                       # MATH.md §4, the same T on p and Q
        _, n_acc, bonus = verify_sampled(logits, Q, drafts[:, 0], temperature, generator)
    return n_acc, bonus, path


def target_choice(logits, temperature, generator=None):
    """The target's own next token from its logits (B, V): argmax, or a sample at the temperature."""
    if temperature == 0.0:
        return logits.argmax(-1)
    return sample(F.softmax(tempered(logits, temperature), dim=-1), generator)


# ------------------------------------------------------------------------- a token tree, one call
# With nodes=N the block is a tree chosen from the drafter's distributions (heads.grow_tree,
# MATH.md §10): slot 0 the bonus, then up to N drafted tokens, each row its own tree, each slot
# seeing the committed prefix and its ancestors. The target's own choice at every node (its
# argmax, or its sample at the temperature) says which child the walk follows: every committed
# token is the target's own, so the walk is exact greedy decoding, or lossless, by construction.

def tree_attend(tree, n):
    """A token tree (B, 2, L) of parent slots and depths (heads.grow_tree) -> (depth (B, L),
    attend (B, L, L) bool): each slot sees itself and its ancestors (padding: itself alone), the
    tree argument of GPT.forward_cached. n: the greatest depth (k-1)."""
    parent, depth = tree[:, 0], tree[:, 1]
    B, L = parent.shape
    up = torch.where(parent < 0, torch.arange(L, device=parent.device), parent)          # (B, L)
    eye = torch.eye(L, dtype=torch.bool, device=parent.device).expand(B, L, L)
    attend = eye
    for _ in range(n):   # a generation of ancestors more each time
        attend = eye | attend.gather(1, up[:, :, None].expand(B, L, L))
    return depth, attend


def walk_down(choice, block, tree, attend, n):
    """The walk from the bonus down a token tree (MATH.md §10): from each node it follows the child
    whose token is the target's choice there (choice (B, L): its argmax, or its sample, at every
    slot), and stops at the node where none is. Children of a node hold distinct tokens, so the walk
    is one path. Returns n_acc (B,) its drafted tokens, last (B,) the slot where it stops, and
    slots (B, n) the path's slot at each depth 1..n (past n_acc: any slot, none of it committed)."""
    parent, depth = tree[:, 0], tree[:, 1]
    up = parent.clamp(min=0)                                                # the bonus is its own parent
    follows = (parent >= 0) & (block == choice.gather(1, up))               # (B, L) what its parent chose
    follows = follows | (torch.arange(block.size(1), device=block.device) == 0)
    on = follows
    for _ in range(n):                                                      # ... and so did every ancestor
        on = follows & on.gather(1, up)
    last = torch.where(on, depth, -1).argmax(-1)                            # (B,) the deepest node walked to
    n_acc = depth.gather(1, last[:, None]).squeeze(1)
    above = attend.gather(1, last[:, None, None].expand(-1, 1, attend.size(-1))).squeeze(1)   # (B, L) its ancestors
    at = depth[:, None, :] == torch.arange(1, n + 1, device=block.device)[None, :, None]       # (B, n, L)
    return n_acc, last, (above[:, None, :] & at).long().argmax(-1)


def sampled_tree_choice(logits, Q, block, tree, temperature, width, generator=None):
    """What a sampled tree's walk follows (MATH.md §10, "A sampled tree"), lossless: at every slot
    at once, recursive rejection sampling of its children, tried in the order they were drawn
    without replacement from Q[:, slot]. Child l is accepted with probability min(1, r(x) / q_l(x))
    (try_candidate, as in verify_tree_sampled), r what is left of p after the earlier ones and q_l
    the slot's Q without the earlier children's tokens, renormalised: what child l was drawn from. logits
    (B, L, V) after every slot; Q (B, L, V); block (B, L); tree (B, 2, L) (heads.sample_tree); width:
    the most children of a node. Returns choice (B, L): the accepted child's token, or where no
    child is accepted (a leaf has none to accept), a sample of what is left of p."""
    p = F.softmax(tempered(logits, temperature), dim=-1)               # (B, L, V) p_target at each slot
    parent, slot = tree[:, 0], torch.arange(tree.size(-1), device=tree.device)
    child = (parent[:, None, :] == slot[None, :, None]) & (slot > 0)   # (B, L, L) [s, c]: c a child of s, not the bonus
    rank = child.long().cumsum(-1) - 1                                 # a child's place among its siblings
    r, q, done = p, Q, torch.zeros_like(parent, dtype=torch.bool)
    chosen = torch.zeros_like(parent)
    for l in range(width):   # the l-th children of every node at once
        has = child & (rank == l)                                      # (B, L, L)
        tried = has.any(-1) & ~done
        x = block.gather(1, has.long().argmax(-1))                     # (B, L) the l-th child's token
        ok, r = try_candidate(r, q, x, tried, generator)
        chosen = torch.where(ok, x, chosen)
        done = done | ok
        rest = q.scatter(-1, x[..., None], 0.0)                        # the next child is drawn from q without x
        q = torch.where(tried[..., None], rest / rest.sum(-1, keepdim=True).clamp(min=1e-30), q)
    return torch.where(done, chosen, sample(r, generator))


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
    lossless. accept: (rule, param) of ACCEPT, for greedy decoding. active (B,) bool: rows still
    generating; the others do not advance. text (heads.Text): each row's committed tokens, where the
    step writes what it commits (and what a drafter that reads the text reads).
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
    one, or one that means nothing here (k or accept without a drafter, several paths that would
    all be the same), is one BadInput naming it, what was given and what is allowed.

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
