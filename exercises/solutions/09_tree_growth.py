"""Exercise 9's reference is the project's own heads.grow_tree; these are the plausible wrong
answers its checks must catch, each the reference with one mistake."""
import math

import torch


def grown(log_q, B, n, nodes, device, score_of='prefix', per_depth=False, ties='shallower', pad=True, rows=False,
          pad_by='prefix', in_place=False, by_rank=False, every_prefix=False, counted=False, floor=None, coded=False,
          by_product=False, top_k=None):
    """heads.grow_tree's way, with one of the mistakes switched on."""
    width = nodes if top_k is None else min(top_k, nodes)      # each depth's candidates: `nodes`, or EAGLE-2's top_k
    score = torch.zeros(B, 1, device=device)
    prefix = torch.zeros(B, 1, 0, dtype=torch.long, device=device)
    code = torch.zeros(B, 1, dtype=torch.long, device=device)
    ids = torch.zeros(B, 1, dtype=torch.long, device=device)
    scores, tokens, parents, depths, owns, count = [], [], [], [], [], 1
    for d in range(n):
        own = log_q(d, prefix)                                                       # (B, M, V)
        if in_place:           # written into what log_q returned (a drafter's own tensors, maybe)
            own += score[:, :, None]
            score = torch.zeros_like(score)
        if floor is not None:  # -inf replaced by a finite floor, and a score at or below it taken for padding
            own = own.masked_fill(own == -math.inf, floor)
        child = own if score_of == 'token' else score[:, :, None] + own
        V = child.size(-1)
        if by_rank:            # each parent's best children found one rank at a time: a loop over min(nodes, V)
            left, ranked = own.clamp(min=torch.finfo(own.dtype).min), []
            for _ in range(min(nodes, V)):
                ranked.append(left.argmax(-1, keepdim=True))
                left = left.scatter(-1, ranked[-1], -math.inf)
            ranked = torch.cat(ranked, -1)                                           # (B, M, r) best first
            r = ranked.size(-1)
            top, pick = child.gather(-1, ranked).flatten(1).topk(min(nodes, child.size(1) * r), dim=-1)
            flat = pick.div(r, rounding_mode='floor') * V + ranked.flatten(1).gather(1, pick)
        else:                  # every_prefix: all children kept, so log_q is asked about every prefix next
            top, flat = child.flatten(1).topk(child.size(1) * V if every_prefix else min(width, child.size(1) * V),
                                              dim=-1)
        up, token = flat.div(V, rounding_mode='floor'), flat % V
        # the prefix's score rides along, whatever ranks the candidates
        score = (score[:, :, None] + own).flatten(1).gather(1, flat) if score_of == 'token' else top
        prefix = torch.cat([prefix.gather(1, up[:, :, None].expand(-1, -1, d)), token[:, :, None]], dim=2)
        if coded:              # the prefix as one integer, parent * V + token: past int64 once V ** (d + 1) is
            code = code.gather(1, up) * V + token
            prefix = code[:, :, None].div(V ** torch.arange(d, -1, -1, device=device), rounding_mode='floor') % V
        parents.append(ids.gather(1, up))
        ids = count + torch.arange(score.size(1), device=device).expand(B, -1)
        count += score.size(1)
        scores.append(own.flatten(1).gather(1, flat) if score_of == 'token' else score)
        tokens.append(token)
        depths.append(torch.full_like(token, d + 1))
        owns.append(own.flatten(1).gather(1, flat))                                  # the node's own token's
    rank, token, parent, depth = (torch.cat(t, dim=1) for t in (scores, tokens, parents, depths))
    if per_depth:              # the best of each depth, a share of the budget each, not the best of all
        share = max(1, nodes // n)
        starts = [0]
        for t in tokens[:-1]:
            starts.append(starts[-1] + t.size(1))
        keep = torch.cat([torch.arange(s, s + min(share, t.size(1)), device=device).expand(B, -1)
                          for s, t in zip(starts, tokens)], dim=1)[:, :nodes]
    elif ties == 'deeper':     # equal scores: the deeper first
        L = rank.size(1)
        order = rank.flip(-1).sort(dim=-1, descending=True, stable=True).indices
        keep = (L - 1 - order)[:, :nodes].sort(dim=-1).values
    elif ties == 'unspecified':   # a sort not asked to be stable: a CPU's keeps equal scores in order, a GPU's may not
        keep = rank.sort(dim=-1, descending=True).indices[:, :nodes].sort(dim=-1).values
    elif ties == 'penalty':    # equal scores to the shallower by a penalty on depth: a near tie goes there too
        keep = (rank - 1e-6 * depth).topk(min(nodes, rank.size(1)), dim=-1).indices.sort(dim=-1).values
    elif rows:                 # the selection one row at a time
        keep = torch.stack([rank[b].sort(descending=True, stable=True).indices[:nodes].sort().values
                            for b in range(B)])
    else:
        keep = rank.sort(dim=-1, descending=True, stable=True).indices[:, :nodes].sort(dim=-1).values
    m = keep.size(1)
    if counted:                # the id-to-slot table by counting: bincount marks the kept ids, a cumsum numbers them
        marked = torch.bincount((count * torch.arange(B, device=device)[:, None] + 1 + keep).flatten(),
                                minlength=B * count).view(B, count)
        slot = marked.cumsum(1) * marked
    else:
        slot = torch.zeros(B, count, dtype=torch.long, device=device)
        slot.scatter_(1, 1 + keep, torch.arange(1, m + 1, device=device).expand(B, -1))
    kept_parent = slot.gather(1, parent.gather(1, keep))
    if pad and pad_by == 'probability':   # the prefix's probability in float64, 0 below e^-745
        kept_parent = torch.where(rank.gather(1, keep).double().exp() > 0, kept_parent, -1)
    elif pad:
        judged = rank if pad_by == 'prefix' else torch.cat(owns, 1)
        kept_parent = torch.where(judged.gather(1, keep) > (-math.inf if floor is None else floor), kept_parent, -1)
    root = torch.zeros(B, 1, dtype=torch.long, device=device)
    tree = torch.stack([torch.cat([root, kept_parent], 1), torch.cat([root, depth.gather(1, keep)], 1)], dim=1)
    if by_product:             # the kept tokens picked by a one-hot matmul: bfloat16 under autocast, 50000 -> 49920
        pick = torch.nn.functional.one_hot(keep, token.size(1)).float()
        return (pick @ token.float()[:, :, None]).squeeze(-1).long(), tree
    return token.gather(1, keep), tree


TREES = []


def keeps_every_tree(log_q, B, n, nodes, device):
    tree = grown(log_q, B, n, nodes, device)
    TREES.append(tree)                       # every tree grown: memory that grows with the tokens decoded
    return tree


def mistake(**kw):
    def grow_tree(log_q, B, n, nodes, device):
        return grown(log_q, B, n, nodes, device, **kw)
    return grow_tree


def deterministic_left_on(log_q, B, n, nodes, device):
    """torch.use_deterministic_algorithms(True) "for reproducible trees" (the stable sort already makes
    them so), left on: a setting of the whole process, under which the caller's ops that have no
    deterministic kernel on CUDA raise."""
    torch.use_deterministic_algorithms(True)
    return grown(log_q, B, n, nodes, device)


CONTROLS = {
    "each node scored by its own token's probability, not its prefix's": dict(grow_tree=mistake(score_of='token')),
    'the best of each depth, not of all depths': dict(grow_tree=mistake(per_depth=True)),
    'ties to the deeper': dict(grow_tree=mistake(ties='deeper')),
    'the best of all by a sort not asked to be stable (ties in an order a GPU need not keep)':
        dict(grow_tree=mistake(ties='unspecified')),
    'no padding: a node of probability 0 keeps its parent': dict(grow_tree=mistake(pad=False)),
    'the selection one row at a time': dict(grow_tree=mistake(rows=True)),
    "padding judged by the node's own token, not its prefix's score": dict(grow_tree=mistake(pad_by='token')),
    "the scores added into log_q's output in place": dict(grow_tree=mistake(in_place=True)),
    "each parent's children found one rank at a time (a Python loop over min(nodes, V))":
        dict(grow_tree=mistake(by_rank=True)),
    'padding judged by the probability in float64 (0 below e^-745)': dict(grow_tree=mistake(pad_by='probability')),
    'equal scores to the shallower by a penalty on depth (a near tie goes there too)':
        dict(grow_tree=mistake(ties='penalty')),
    'every child kept, log_q asked about every prefix': dict(grow_tree=mistake(every_prefix=True)),
    'the id-to-slot table by bincount (a host sync on CUDA)': dict(grow_tree=mistake(counted=True)),
    "-inf replaced by float64's lowest, which float32 log q cannot hold":
        dict(grow_tree=mistake(floor=torch.finfo(torch.float64).min)),
    '-inf replaced by -1e4 (a mask value), a node at or below it padding': dict(grow_tree=mistake(floor=-1e4)),
    'the prefix as one int64 code, parent * V + token (overflows on a real vocabulary)':
        dict(grow_tree=mistake(coded=True)),
    'the kept tokens picked by a one-hot matmul (bfloat16 under autocast: tokens above 256 rounded)':
        dict(grow_tree=mistake(by_product=True)),
    'every tree kept in a list (memory that grows with the steps)': dict(grow_tree=keeps_every_tree),
    "each depth's candidates EAGLE-2's top_k = 10 best, not the `nodes` best (fewer where nodes > 10)":
        dict(grow_tree=mistake(top_k=10)),
    'torch.use_deterministic_algorithms(True) left on (a setting of the whole process)':
        dict(grow_tree=deterministic_left_on),
}
