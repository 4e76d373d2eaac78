"""Exercise 8's checks: verifying a tree of K greedy branches in one target call (README.md)."""
import torch
import torch.nn.functional as F

import decode
from dblast import DBlastDrafter
from exercises import harness
from model import sample, tempered, upcast

NAMES = ('tree_step',)


def branch_paths(drafter, h, bonus, model, k):
    """Every branch's greedy drafts (B, K, k-1): the argmax path of each branch of the mixture."""
    _, logits = drafter.mixture_logits(h, bonus, model, k)
    return logits.argmax(-1)


@torch.no_grad()
def tree_generate(model, prompt, max_new_tokens, drafter=None, temperature=0.0, generator=None, step=None):
    """decode.generate with tree verification: each call verifies all K greedy branches of a DBlast
    drafter (step: a tree_step) -> (out (B, T0 + max_new_tokens), stats with calls and
    accept_lengths)."""
    B, T0 = prompt.shape
    k, K = drafter.k, drafter.K
    total = T0 + max_new_tokens
    cache = model.new_cache(B, total + 1 + K * (k - 1) + k)     # room for the last tree block
    out = torch.zeros(B, total + 2 * k, dtype=torch.long)      # finished rows write past the end
    out[:, :T0] = prompt
    h = model.forward_cached(prompt, cache)[:, -1]
    cache.commit(T0)
    logits = upcast(model.lm_head(h))
    bonus = logits.argmax(-1) if temperature == 0 else sample(F.softmax(tempered(logits, temperature), -1), generator)
    n_out = torch.full((B,), T0)
    taus, calls = [], 1
    while True:
        active = n_out < total
        if not active.any():
            break
        paths = branch_paths(drafter, h, bonus, model, k)
        n_acc, branch, next_bonus, h = step(model, cache, bonus, paths, active, temperature, generator)
        chosen = paths.gather(1, branch.view(B, 1, 1).expand(B, 1, k - 1)).squeeze(1)
        out.scatter_(1, n_out[:, None] + torch.arange(k), torch.cat([bonus[:, None], chosen], 1))
        n_out += (n_acc + 1) * active
        taus += (n_acc + 1)[active].tolist()
        bonus, calls = next_bonus, calls + 1
    return out[:, :total], dict(calls=calls, accept_lengths=taus)


def random_drafter(config, k=4, K=4, seed=2, sharp=True):
    d = harness.peaky(DBlastDrafter(config, k, K, sample_drafts=False), 0.3, seed)
    if sharp:
        with torch.no_grad():
            d.block.ln.weight.mul_(4.0)
    return d


@torch.no_grad()
def single_branch_n_acc(model, prefix, bonus, paths):
    """Each branch verified alone, exactly, on a full forward: (B, K) accepted drafts."""
    B, K, n = paths.shape
    res = torch.zeros(B, K, dtype=torch.long)
    for z in range(K):
        seq = torch.cat([prefix, bonus[:, None], paths[:, z]], 1)
        logits = model(seq)[0][:, prefix.size(1):]                                 # after bonus, d_1..
        _, res[:, z], _ = decode.verify_greedy(logits, paths[:, z])
    return res


def test_greedy_accepts_the_longest_branch(impl):
    """Greedy: the longest matching branch. For K = 4 branches (some sharing a first token, one the
    target's greedy path), n_acc is the longest accepted prefix among them, the bonus the target's
    argmax after it, and the cache afterwards equals a fresh prefill of what was committed.
    Hint: the tree mask lets path z's token i see the prefix, the bonus and path z's tokens < i;
    its position is the prefix length + 1 + i."""
    model = harness.tiny_target()
    B, n = 3, 3
    prefix = torch.randint(32, (B, 6), generator=torch.Generator().manual_seed(0))
    greedy = harness.plain_greedy(model, prefix, 1 + n + 1)[:, 6:]                # bonus, 3 greedy drafts, next
    bonus = greedy[:, 0]
    paths = torch.randint(32, (B, 4, n), generator=torch.Generator().manual_seed(1))
    paths[:, 1] = greedy[:, 1:1 + n]                                              # branch 1: all right
    paths[:, 2, 0] = greedy[:, 1]                                                 # branch 2: one right
    paths[:, 3, 0] = greedy[:, 1]                                                 # branch 3 shares it
    paths[1, 1, 2] = (paths[1, 1, 2] + 1) % 32                                    # row 1: branch 1 two right
    cache = model.new_cache(B, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    n_acc, branch, nxt, h = impl.tree_step(model, cache, bonus, paths, torch.ones(B, dtype=torch.bool), 0.0)
    want = single_branch_n_acc(model, prefix, bonus, paths).max(-1).values
    assert n_acc.tolist() == want.tolist(), f"n_acc {n_acc.tolist()}, want the longest single branch's {want.tolist()}"
    assert branch.tolist() == [1, 1, 1], \
        f"branch {branch.tolist()}, want [1, 1, 1]: branch 1 is the longest in every row"
    committed = [torch.cat([prefix[b], bonus[b:b + 1], paths[b, 1, :int(n_acc[b])]]) for b in range(B)]
    for b in range(B):
        logits = model(committed[b][None])[0][0]
        assert int(nxt[b]) == int(logits[-1].argmax()), \
            f"row {b}: the next bonus is {int(nxt[b])}, want the target's argmax {int(logits[-1].argmax())}"
        assert torch.allclose(h[b], model.hidden(committed[b][None])[0, -1], atol=1e-10), \
            f"row {b}: h differs from the state at the last committed token by " \
            f"{(h[b] - model.hidden(committed[b][None])[0, -1]).abs().max().item():.2e}, want below 1e-10"
    assert cache.lengths.tolist() == [6 + 1 + int(a) for a in n_acc], \
        f"cache lengths {cache.lengths.tolist()}, want {[6 + 1 + int(a) for a in n_acc]} (the prefix, the bonus, n_acc)"
    probe = torch.randint(32, (B, 2), generator=torch.Generator().manual_seed(2))
    got = model.lm_head(model.forward_cached(probe, cache))
    for b in range(B):
        want = model(torch.cat([committed[b], probe[b]])[None])[0][0, -2:]
        assert (got[b] - want).abs().max() < 1e-10, \
            f"row {b}: the cache does not hold the committed tokens: logits after it differ by " \
            f"{(got[b] - want).abs().max().item():.2e}, want below 1e-10"


def test_inactive_rows_stay(impl):
    """Inactive rows do not advance. Hint: commit (n_acc + 1) * active, as merged_step does."""
    model = harness.tiny_target()
    prefix = torch.randint(32, (2, 6), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(2, 32)
    model.forward_cached(prefix, cache)
    cache.commit(6)
    paths = torch.randint(32, (2, 2, 3), generator=torch.Generator().manual_seed(4))
    impl.tree_step(model, cache, prefix[:, -1], paths, torch.tensor([True, False]), 0.0)
    assert cache.lengths[1] == 6 and cache.lengths[0] > 6, f"cache lengths {cache.lengths.tolist()}, want [>6, 6]"


def test_decodes_exactly_greedy(impl):
    """Decodes exactly greedy. Through tree_generate, with a random K = 4 drafter, the output is
    plain greedy decoding's (float64)."""
    model = harness.tiny_target()
    d = random_drafter(model.config)
    prompts = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(5))
    out, _ = tree_generate(model, prompts, 30, drafter=d, step=impl.tree_step)
    ref = harness.plain_greedy(model, prompts, 30)
    assert torch.equal(out, ref), \
        f"the output differs from plain greedy decoding at {harness.first_difference(out, ref, 8)}"


@torch.no_grad()
def test_sampling_the_first_tokens_follow_p(impl):
    """Sampling: the first tokens follow p. 30,000 steps from one prefix with three branches, two of
    them sharing their first token a: the first token committed after the bonus has the target's
    distribution, and so has the second wherever the first was a. Hint: draw one sample per tree
    node (branches with the same prefix share the node and its sample); a branch's token is
    accepted when it equals the sample at its parent node; the bonus is the sample where the walk
    stops."""
    model = harness.float32(harness.target8())
    N, T = 30000, 1.0
    prefix = harness.PROMPT8.expand(N, -1)
    bonus = torch.full((N,), 3)
    paths = torch.tensor([[0, 1, 2], [0, 4, 5], [6, 7, 1]]).expand(N, 3, 3)          # 0 shared by two
    cache = model.new_cache(N, 16)
    model.forward_cached(prefix, cache)
    cache.commit(4)
    n_acc, branch, nxt, _ = impl.tree_step(model, cache, bonus, paths, torch.ones(N, dtype=torch.bool), T,
                                           torch.Generator().manual_seed(0))
    chosen = paths.gather(1, branch.view(N, 1, 1).expand(N, 1, 3)).squeeze(1)
    first = torch.where(n_acc >= 1, chosen[:, 0], nxt)
    seq = torch.cat([harness.PROMPT8[0], torch.tensor([3])])
    p1 = F.softmax(harness.target8()(seq[None])[0][0, -1] / T, -1)
    stat, crit = harness.chi_square(torch.bincount(first, minlength=8).double(), p1)
    assert stat < crit, f"the first token is not the target's: chi-square {stat:.0f}, want below {crit:.0f}"
    at_a = first == 0
    second = torch.where(n_acc[at_a] >= 2, chosen[at_a, 1], nxt[at_a])
    p2 = F.softmax(harness.target8()(torch.cat([seq, torch.tensor([0])])[None])[0][0, -1] / T, -1)
    stat, crit = harness.chi_square(torch.bincount(second, minlength=8).double(), p2)
    assert stat < crit, f"after the shared first token the second is not the target's: chi-square {stat:.0f}, " \
                        f"want below {crit:.0f}"


def test_sampling_is_lossless(impl):
    """Sampling is lossless. Through tree_generate with a K = 4 drafter's greedy branches at
    T = 1.3, every 3-token continuation of the 8-token world comes out with the target's
    probability (chi-square, 20,000 samples)."""
    model = harness.target8()
    d = random_drafter(model.config)
    harness.assert_lossless(model, d, 1.3, decoder=lambda *a, k=None, **kw: tree_generate(*a, step=impl.tree_step, **kw))


def try_it(impl, tryout):
    """train.py's DBlast K = 4 drafter with greedy branches, at T = 0 and 1.5: your tree verification
    of all four branches next to verifying the drawn branch alone and the mixture's conditionals."""
    d = tryout.drafter('dblast_K4.pt')
    d.sample_drafts = False
    rows = []
    for T in (0.0, 1.5):
        for label, verify in (('drawn branch alone (verify=branch)', 'branch'), ("mixture's conditionals", 'mixture')):
            d.verify = verify
            rows.append(tryout.row(label, False, T, drafter=d))
        rows.append(tryout.row('tree of all 4 branches', False, T, drafter=d,
                               decoder=lambda *a, **kw: tree_generate(*a, step=impl.tree_step, **kw)))
    d.sample_drafts, d.verify = True, 'mixture'
    tryout.table(rows)
