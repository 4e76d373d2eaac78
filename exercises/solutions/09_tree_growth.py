"""Exercise 9's reference is the project's own heads.grow_tree; these are the plausible wrong
answers its checks must catch, each the reference with one mistake."""
import math

import torch


def grown(log_q, B, n, nodes, device, score_of='prefix', per_depth=False, ties='shallower', pad=True, rows=False,
          pad_by='prefix', in_place=False):
    """heads.grow_tree's way, with one of the mistakes switched on."""
    score = torch.zeros(B, 1, device=device)
    prefix = torch.zeros(B, 1, 0, dtype=torch.long, device=device)
    ids = torch.zeros(B, 1, dtype=torch.long, device=device)
    scores, tokens, parents, depths, owns, count = [], [], [], [], [], 1
    for d in range(n):
        own = log_q(d, prefix)                                                       # (B, M, V)
        if in_place:           # written into what log_q returned (a drafter's own tensors, maybe)
            own += score[:, :, None]
            score = torch.zeros_like(score)
        child = own if score_of == 'token' else score[:, :, None] + own
        V = child.size(-1)
        top, flat = child.flatten(1).topk(min(nodes, child.size(1) * V), dim=-1)
        up, token = flat.div(V, rounding_mode='floor'), flat % V
        # the prefix's score rides along, whatever ranks the candidates
        score = (score[:, :, None] + own).flatten(1).gather(1, flat) if score_of == 'token' else top
        prefix = torch.cat([prefix.gather(1, up[:, :, None].expand(-1, -1, d)), token[:, :, None]], dim=2)
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
    elif rows:                 # the selection one row at a time
        keep = torch.stack([rank[b].sort(descending=True, stable=True).indices[:nodes].sort().values
                            for b in range(B)])
    else:
        keep = rank.sort(dim=-1, descending=True, stable=True).indices[:, :nodes].sort(dim=-1).values
    m = keep.size(1)
    slot = torch.zeros(B, count, dtype=torch.long, device=device)
    slot.scatter_(1, 1 + keep, torch.arange(1, m + 1, device=device).expand(B, -1))
    kept_parent = slot.gather(1, parent.gather(1, keep))
    if pad:
        judged = rank if pad_by == 'prefix' else torch.cat(owns, 1)
        kept_parent = torch.where(judged.gather(1, keep) > -math.inf, kept_parent, -1)
    root = torch.zeros(B, 1, dtype=torch.long, device=device)
    tree = torch.stack([torch.cat([root, kept_parent], 1), torch.cat([root, depth.gather(1, keep)], 1)], dim=1)
    return token.gather(1, keep), tree


def mistake(**kw):
    def grow_tree(log_q, B, n, nodes, device):
        return grown(log_q, B, n, nodes, device, **kw)
    return grow_tree


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
}
