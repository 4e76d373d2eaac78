"""
Verification: what the target keeps of a drafted block, from its logits after every slot of it
(BPD's verify and accept substeps, p. 2; lossless speculative sampling), for one block, several
drafted paths and a token tree. decode.py's steps call `verify` (a block or paths) or the token
tree's walks; each verifier is built from small pieces named once here, which the exercises replace.

Read in this order (MATH.md has every equation):
  one block            the acceptance rules (the table ACCEPT), speculative sampling's test, the
                       residual and what is committed: verify_greedy, verify_sampled (§2, §4)
  several paths        the paths' layout as a tree, greedy's longest path and multi-step
                       speculative sampling node by node: verify_tree_greedy, verify_tree_sampled,
                       and `verify`, the verifier a step needs (§9)
  a token tree         its attention, the walk down it with the target's own choices, and a
                       sampled tree's recursive rejection sampling (§10)
Static shapes and no host sync throughout, so that a step runs them inside a compiled graph
(runner.py).
"""
import torch
import torch.nn.functional as F

from arguments import named
from cli import BadInput
from model import sample, tempered


# ------------------------------------------------------------------------- one block
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


# ------------------------------------------------------------------------- a token tree
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

