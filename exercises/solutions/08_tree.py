"""Exercise 8's reference is the project's own step: decode.merged_step with paths=K verifies the
K branches as a tree in one target call (MATH.md §9). Below it, an answer written by hand the way
the statement describes (one sample per node), which carries the plausible wrong answers the
checks must catch."""
import torch
import torch.nn.functional as F

import decode
from heads import Drafter
from model import sample, tempered, upcast


class StateProbe(Drafter):
    """A drafter that drafts nothing and keeps the state merged_step drafts from: the target's state
    after the last committed token."""

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        self.h = h
        return torch.zeros(h.size(0), k - 1, dtype=torch.long, device=h.device), None

    def draft_paths(self, h, bonus, target, k, paths, temperature=0.0, generator=None):
        return self.draft(h, bonus, target, k)[0][:, None].expand(-1, paths, -1), None


@torch.no_grad()
def tree_step(model, cache, bonus, paths, active, temperature=0.0, generator=None):
    """The project's step on the block [bonus, path_0 .. path_{K-1}] of point-mass drafts."""
    B, K, n = paths.shape
    probe = StateProbe()
    probe.k = n + 1
    block = torch.cat([bonus[:, None], paths.flatten(1)], 1)
    n_acc, kept, nxt, _ = decode.merged_step(model, probe, cache, block, None, active, temperature,
                                             generator=generator, paths=K)
    # the kept path is the first one whose drafts are the kept ones (the first of the longest)
    branch = (paths == kept[:, None, 1:]).all(-1).long().argmax(-1)
    return n_acc, branch, nxt[:, 0], probe.h


def tree_forward(model, cache, tokens, depth, attend):
    """The target over a tree block: tokens (B, L) written at slots lengths + 0..L-1, at positions
    lengths + depth (L,), slot j attending to the committed prefix and to the block's slots i with
    attend[j, i]. Returns the final hidden states (B, L, C)."""
    B, L = tokens.shape
    slots = cache.lengths[:, None] + torch.arange(L, device=tokens.device)           # (B, L)
    pos = (cache.lengths[:, None] + depth).clamp(max=model.config.block_size - 1)
    rel = torch.arange(cache.max_len, device=tokens.device)[None] - cache.lengths[:, None]   # (B, max_len)
    in_block = (rel >= 0) & (rel < L)
    block_mask = attend[:, rel.clamp(0, L - 1)].permute(1, 0, 2)                      # (B, L, max_len)
    mask = (rel[:, None, :] < 0) | (in_block[:, None, :] & block_mask)
    x = model.transformer.wte(tokens) + model.transformer.wpe(pos)
    for i, layer in enumerate(model.transformer.h):
        x = layer(x, cache=cache, layer_idx=i, write_pos=slots, mask=mask[:, None])
    return model.transformer.ln_f(x)


def tree_layout(K, n, device):
    """Slot 0 the bonus, then branch z's tokens at slots 1 + z*n + i: each slot's depth (position
    after the bonus) and who may attend to whom (the bonus, and earlier tokens of the own branch)."""
    depth = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(1, n + 1).repeat(K)]).to(device)
    branch = torch.cat([torch.tensor([-1]), torch.arange(K).repeat_interleave(n)]).to(device)
    slot = torch.arange(1 + K * n, device=device)
    attend = (slot[None, :] == 0) | ((branch[:, None] == branch[None, :]) & (depth[None, :] <= depth[:, None]))
    return depth, attend


def commit_branch(cache, branch, n, n_acc, active):
    """Move the accepted branch's keys and values next to the bonus, then commit."""
    B = branch.size(0)
    start = cache.lengths[:, None] + 1
    src = start + branch[:, None] * n + torch.arange(n, device=branch.device)           # (B, n)
    dst = start + torch.arange(n, device=branch.device)
    for buf in (cache.k, cache.v):                                                       # (layers, B, nh, max_len, hs)
        L_, _, nh, _, hs = buf.shape
        idx = lambda at: at[None, :, None, :, None].expand(L_, B, nh, n, hs)            # noqa: E731
        buf.scatter_(3, idx(dst), buf.gather(3, idx(src)))
    cache.commit((n_acc + 1) * active)


@torch.no_grad()
def by_hand(model, cache, bonus, paths, active, temperature=0.0, generator=None, fresh_bonus=False,
            shared_nodes=True, move=True):
    B, K, n = paths.shape
    dev = paths.device
    depth, attend = tree_layout(K, n, dev)
    tokens = torch.cat([bonus[:, None], paths.flatten(1)], 1)                           # (B, 1 + K n)
    H = tree_forward(model, cache, tokens, depth, attend)
    logits = upcast(model.lm_head(H))
    if temperature == 0:
        x = logits.argmax(-1)                                     # the target's token after each node
    else:
        x = sample(F.softmax(tempered(logits, temperature), -1), generator)
    # node slots: the node after path_z[:i+1] is slot 1 + z n + i; branches with the same prefix share
    # the node, and use the first such branch's slot (and its one sample)
    same = (paths[:, :, None, :] == paths[:, None, :, :]).long().cumprod(-1).bool()     # (B, z, z', i)
    canon = same.long().argmax(2) if shared_nodes else torch.arange(K, device=dev)[None, :, None].expand(B, K, n)
    node = 1 + canon * n + torch.arange(n, device=dev)                                  # (B, K, n)
    parent = torch.cat([torch.zeros(B, K, 1, dtype=torch.long, device=dev), node[:, :, :-1]], -1)
    match = x.gather(1, parent.flatten(1)).view(B, K, n) == paths                       # sample at parent = token
    n_acc_z = match.long().cumprod(-1).sum(-1)                                          # (B, K)
    n_acc, branch = n_acc_z.max(-1)
    last = torch.where(n_acc > 0, node.gather(1, branch.view(B, 1, 1).expand(B, 1, n)).squeeze(1)
                       .gather(1, (n_acc - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(n_acc))
    next_bonus = x.gather(1, last[:, None]).squeeze(1)
    if fresh_bonus and temperature > 0:
        next_bonus = sample(F.softmax(tempered(logits.gather(1, last.view(B, 1, 1).expand(B, 1, logits.size(-1)))
                                               .squeeze(1), temperature), -1), generator)
    h = H.gather(1, last.view(B, 1, 1).expand(B, 1, H.size(-1))).squeeze(1)
    commit_branch(cache, branch if move else torch.zeros_like(branch), n, n_acc, active)
    return n_acc, branch, next_bonus, h


CONTROLS = {
    'a fresh sample for the bonus': dict(tree_step=lambda *a, **kw: by_hand(*a, **kw, fresh_bonus=True)),
    'each branch samples shared nodes anew': dict(tree_step=lambda *a, **kw: by_hand(*a, **kw, shared_nodes=False)),
    "branch 0's keys and values committed": dict(tree_step=lambda *a, **kw: by_hand(*a, **kw, move=False)),
}
