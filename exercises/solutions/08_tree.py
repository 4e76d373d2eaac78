"""Exercise 8's reference: tree verification of K greedy branches in one target call, written from
the statement (one sample per tree node), and the plausible wrong answers its checks must catch.
It uses nothing a handout leaves out: the project's own tree (decode.merged_step with paths=K,
MATH.md §9) is this exercise's answer, and tests/test_paths.py tests it."""
import torch
import torch.nn.functional as F

from model import sample, tempered, upcast


def tree_forward(model, cache, tokens, depth, attend, clamp=True):
    """The target over a tree block: tokens (B, L) written at slots lengths + 0..L-1, at positions
    lengths + depth (L,), slot j attending to the committed prefix and to the block's slots i with
    attend[j, i]. Returns the final hidden states (B, L, C). Near the end of the context a slot's
    position may pass the last the target has: it is never committed, and gets that last one."""
    B, L = tokens.shape
    slots = cache.lengths[:, None] + torch.arange(L, device=tokens.device)           # (B, L)
    pos = cache.lengths[:, None] + depth
    if clamp:
        pos = pos.clamp(max=model.config.block_size - 1)
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
    slot = torch.arange(1 + K * n, device=device)
    branch = (slot - 1).div(n, rounding_mode='floor')                 # the bonus: -1
    depth = torch.where(slot == 0, 0, (slot - 1) % n + 1)
    attend = (slot[None, :] == 0) | ((branch[:, None] == branch[None, :]) & (depth[None, :] <= depth[:, None]))
    return depth, attend


def commit_branch(cache, branch, n, n_acc, active, row0_offset=False):
    """Move the accepted branch's keys and values next to the bonus, then commit. row0_offset: the
    wrong answer that moves every row at row 0's offset (code written for one row)."""
    B = branch.size(0)
    start = (cache.lengths[:1].expand(B) if row0_offset else cache.lengths)[:, None] + 1
    src = start + branch[:, None] * n + torch.arange(n, device=branch.device)           # (B, n)
    dst = start + torch.arange(n, device=branch.device)
    for buf in (cache.k, cache.v):                                                       # (layers, B, nh, max_len, hs)
        L_, _, nh, _, hs = buf.shape
        idx = lambda at: at[None, :, None, :, None].expand(L_, B, nh, n, hs)            # noqa: E731
        buf.scatter_(3, idx(dst), buf.gather(3, idx(src)))
    cache.commit((n_acc + 1) * active)


@torch.no_grad()
def verify_tree(model, cache, bonus, paths, active, temperature=0.0, generator=None, fresh_bonus=False,
                nodes='prefix', move=True, clamp=True, on_device=True, squeeze=False, calls=1, h_at_bonus=True,
                own_generator=True, seeds_its_own=False, seeds_from_os=False, by_sort=False, row0_offset=False):
    """tree_step, and (by its keywords) the wrong answers below: nodes 'prefix' shares a node
    between branches with the same prefix (right), 'none' gives every branch its own, 'token' shares
    it between branches with the same token at that depth, whatever came before, 'first' shares the
    first depth's nodes only, 'sum' shares it between prefixes whose tokens sum alike; own_generator
    False draws from the global RNG, seeds_its_own True from a generator seeded anew when none is
    given, seeds_from_os True from one seeded by the system (Generator.seed()); by_sort True keeps
    the branch a sort of the counts puts first (of equal counts, whichever the sort's order of ties
    gives) and reads the bonus and h at that branch's own slots; nodes 'row0' shares them in every row
    as row 0's branches share them, row0_offset moves every row's kept branch at row 0's offset in
    the cache (a tree and an offset made for batch 1, as Medusa's and EAGLE's are)."""
    B, K, n = paths.shape
    dev = paths.device
    depth, attend = tree_layout(K, n, dev)
    tokens = torch.cat([bonus[:, None], paths.flatten(1)], 1)                           # (B, 1 + K n)
    for _ in range(calls):                                      # calls=2: the same call made twice
        H = tree_forward(model, cache, tokens, depth, attend, clamp)
    logits = upcast(model.lm_head(H))
    if temperature == 0:
        x = logits.argmax(-1)                                     # the target's token after each node
    elif on_device:
        if seeds_its_own and generator is None:                   # every step then draws the same numbers
            generator = torch.Generator(device=logits.device).manual_seed(0)
        if seeds_from_os and generator is None:                   # torch.manual_seed does not fix its draws
            generator = torch.Generator(device=logits.device)
            generator.seed()
        x = sample(F.softmax(tempered(logits, temperature), -1), generator if own_generator else None)
    else:                                                         # by inverse CDF, its uniforms on the CPU
        cdf = F.softmax(tempered(logits, temperature), -1).cumsum(-1)
        u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, dtype=cdf.dtype)
        x = torch.searchsorted(cdf, u * cdf[..., -1:]).clamp(max=cdf.size(-1) - 1).squeeze(-1)
    # node slots: the node after path_z[:i+1] is slot 1 + z n + i; branches with the same prefix share
    # the node, and use the first such branch's slot (and its one sample)
    same = paths[:, :, None, :] == paths[:, None, :, :]                                 # (B, z, z', i)
    if nodes == 'row0':                                         # row 0's tree for every row
        same = (paths[:1, :, None, :] == paths[:1, None, :, :]).expand(B, K, K, n)
    if nodes == 'sum':                                          # prefixes told apart by the sum of their tokens
        total = paths.cumsum(-1)
        same = total[:, :, None, :] == total[:, None, :, :]
    if nodes == 'code':                                         # a prefix coded as one int64: code * V + token
        V = logits.size(-1)
        code = torch.zeros_like(paths[..., 0])
        codes = []
        for i in range(n):
            code = code * V + paths[..., i]                       # wraps past 2^63: early tokens fall out
            codes.append(code)
        code = torch.stack(codes, -1)
        same = code[:, :, None, :] == code[:, None, :, :]
    if nodes in ('prefix', 'row0'):
        same = same.long().cumprod(-1).bool()                                           # the whole prefix
    canon = torch.arange(K, device=dev)[None, :, None].expand(B, K, n) if nodes == 'none' else same.long().argmax(2)
    if nodes == 'first':                                        # below the first depth each branch its own
        canon = torch.cat([canon[..., :1], torch.arange(K, device=dev)[None, :, None].expand(B, K, n - 1)], -1)
    node = 1 + canon * n + torch.arange(n, device=dev)                                  # (B, K, n)
    parent = torch.cat([torch.zeros(B, K, 1, dtype=torch.long, device=dev), node[:, :, :-1]], -1)
    match = x.gather(1, parent.flatten(1)).view(B, K, n) == paths                       # sample at parent = token
    n_acc_z = match.long().cumprod(-1).sum(-1)                                          # (B, K)
    n_acc, branch = n_acc_z.max(-1)
    if by_sort:                                     # right only where the sort keeps the first of equal counts
        n_acc, branch = (t[:, 0] for t in n_acc_z.sort(-1, descending=True))
        node = (1 + torch.arange(K, device=dev)[:, None] * n + torch.arange(n, device=dev)).expand(B, K, n)
    last = torch.where(n_acc > 0, node.gather(1, branch.view(B, 1, 1).expand(B, 1, n)).squeeze(1)
                       .gather(1, (n_acc - 1).clamp(min=0)[:, None]).squeeze(1), torch.zeros_like(n_acc))
    next_bonus = x.gather(1, last[:, None]).squeeze(1)
    if fresh_bonus and temperature > 0:
        next_bonus = sample(F.softmax(tempered(logits.gather(1, last.view(B, 1, 1).expand(B, 1, logits.size(-1)))
                                               .squeeze(1), temperature), -1), generator)
    if not h_at_bonus:                                          # with nothing accepted, the first draft's state
        kept = node.gather(1, branch.view(B, 1, 1).expand(B, 1, n)).squeeze(1)
        last = kept.gather(1, (n_acc - 1).clamp(min=0)[:, None]).squeeze(1)
    h = H.gather(1, last.view(B, 1, 1).expand(B, 1, H.size(-1))).squeeze(1)
    if squeeze:                                                 # one row: shapes () and (C,), not (1,) and (1, C)
        next_bonus, h = next_bonus.squeeze(), h.squeeze()
    commit_branch(cache, branch if move else torch.zeros_like(branch), n, n_acc, active, row0_offset)
    return n_acc, branch, next_bonus, h


def tree_step(model, cache, bonus, paths, active, temperature=0.0, generator=None):
    return verify_tree(model, cache, bonus, paths, active, temperature, generator)


def wrong(**how):
    return dict(tree_step=lambda *a, **kw: verify_tree(*a, **kw, **how))


def cpu_generator_when_none(model, cache, bonus, paths, active, temperature=0.0, generator=None):
    """torch.default_generator in place of generator=None: the CPU's, which a draw on a GPU refuses."""
    return verify_tree(model, cache, bonus, paths, active, temperature,
                       torch.default_generator if generator is None else generator)


steps_seen = []


def keeps_every_step(model, cache, bonus, paths, active, temperature=0.0, generator=None):
    out = verify_tree(model, cache, bonus, paths, active, temperature, generator)
    steps_seen.append(out)                      # "for statistics": grows with the tokens decoded
    return out


def grad_off_as_a_statement(model, cache, bonus, paths, active, temperature=0.0, generator=None):
    """torch.set_grad_enabled(False) called as a statement, where @torch.no_grad() was meant: gradients
    stay off for the caller after the step (a training loop that decodes a sample between its
    steps then trains nothing)."""
    torch.set_grad_enabled(False)
    return verify_tree(model, cache, bonus, paths, active, temperature, generator)


CONTROLS = {
    'a fresh sample for the bonus': wrong(fresh_bonus=True),
    'each branch samples shared nodes anew': wrong(nodes='none'),
    'nodes shared by the token at a depth, not by the prefix': wrong(nodes='token'),
    'nodes shared at the first depth only': wrong(nodes='first'),
    'the bonus and h squeezed of every dimension (one row)': wrong(squeeze=True),
    "branch 0's keys and values committed": wrong(move=False),
    'positions not clamped near the end of the context': wrong(clamp=False),
    "the node samples drawn without the logits' device": wrong(on_device=False),
    'the tree run through the target twice': wrong(calls=2),
    "h at the first draft's slot where no draft is accepted": wrong(h_at_bonus=False),
    'nodes shared by the sum of their prefix (a hash that collides)': wrong(nodes='sum'),
    'the node samples drawn from the global RNG, not the generator': wrong(own_generator=False),
    'a generator seeded inside when none is given': wrong(seeds_its_own=True),
    'a generator seeded by the system when none is given': wrong(seeds_from_os=True),
    "torch.default_generator (the CPU's) when none is given": dict(tree_step=cpu_generator_when_none),
    'the branch a sort keeps, the bonus at its own copy of a shared node': wrong(by_sort=True),
    'nodes shared by a prefix coded as one int64 (code * V + token: its first tokens fall out past 2^64)': wrong(
        nodes='code'),
    "keeps every step's outputs in a list (memory grows with the tokens decoded)": dict(tree_step=keeps_every_step),
    "every row's kept branch moved at row 0's offset in the cache (prev_input_len of code for one row)": wrong(
        row0_offset=True),
    "nodes shared as row 0's branches share them, in every row (a tree built once, for one row)": wrong(
        nodes='row0'),
    'torch.set_grad_enabled(False) as a statement (gradients left off for the caller)':
        dict(tree_step=grad_off_as_a_statement),
}
