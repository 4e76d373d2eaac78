"""Exercise 5's reference is the project's own dblast.posterior and dblast.conditionals; these are
the plausible wrong answers its checks must catch."""
import torch
import torch.nn.functional as F

import dblast

project_conditionals = dblast.conditionals   # taken before a check plugs anything in
project_posterior = dblast.posterior


def prior_at_every_position(log_prior, log_qd):
    return F.log_softmax(log_prior, -1).unsqueeze(1).expand(-1, log_qd.size(-1), -1)


def conditioned_on_the_draft_itself(log_prior, log_qd):
    return F.log_softmax(log_prior.unsqueeze(-1) + log_qd.cumsum(-1), dim=1).transpose(1, 2)   # l <= i


def products_of_probabilities(log_prior, log_qd):
    before = torch.cat([torch.ones_like(log_qd[..., :1]), log_qd.exp().cumprod(-1)[..., :-1]], -1)
    joint = log_prior.exp().unsqueeze(-1) * before                                            # underflows
    return (joint / joint.sum(1, keepdim=True)).log().transpose(1, 2)


def a_floor_under_log_q(log_prior, log_qd):
    return project_posterior(log_prior, log_qd.clamp(min=-100.0))                    # e^-150 and e^-200 alike


def shifted_by_branch_0(log_prior, log_qd):
    joint = log_prior.unsqueeze(-1) + F.pad(log_qd.cumsum(-1), (1, 0))[..., :-1]         # (N, K, n)
    rel = joint - joint[:, :1]                          # relative to branch 0: -inf - -inf where it is ruled out
    return (rel - rel.logsumexp(1, keepdim=True)).transpose(1, 2)


def shifted_by_the_batch_max(log_prior, log_qd):
    joint = log_prior.unsqueeze(-1) + F.pad(log_qd.cumsum(-1), (1, 0))[..., :-1]
    e = (joint - joint.amax(dim=(0, 1), keepdim=True)).exp()      # a row far below the batch's best: 0 / 0
    return (e / e.sum(1, keepdim=True)).log().transpose(1, 2)


def sums_by_a_triangular_matmul(log_prior, log_qd):
    n = log_qd.size(-1)
    strict = torch.ones(n, n, dtype=log_qd.dtype, device=log_qd.device).triu(1)           # [l, i]: l < i
    before = torch.nan_to_num(log_qd, neginf=-1e30) @ strict                  # in bfloat16 under autocast
    return F.log_softmax(log_prior.unsqueeze(-1) + before, dim=1).transpose(1, 2)


def a_host_sync_in_the_posterior(log_prior, log_qd):
    joint = log_prior.unsqueeze(-1) + F.pad(log_qd.cumsum(-1), (1, 0))[..., :-1]
    if torch.isneginf(joint).all(1).any():                   # a Python if on a tensor: the host reads it
        raise ValueError("drafts that no branch makes")
    return F.log_softmax(joint, dim=1).transpose(1, 2)


def inclusive_sum_minus_its_own_term(log_prior, log_qd):
    before = log_qd.cumsum(-1) - log_qd           # -inf - -inf = NaN where a greedy branch leaves the drafts
    return F.log_softmax(log_prior.unsqueeze(-1) + before, dim=1).transpose(1, 2)


def with_posterior(wrong):
    """conditionals as the project computes them, but with a wrong posterior."""
    def conditionals(log_prior, log_q, drafts):
        saved, dblast.posterior = dblast.posterior, wrong
        try:
            return project_conditionals(log_prior, log_q, drafts)
        finally:
            dblast.posterior = saved
    return conditionals


def drafts_read_by_squeeze(log_prior, log_q, drafts):
    B, K, n, V = log_q.shape
    log_qd = log_q.gather(-1, drafts.view(B, 1, n, 1).expand(B, K, n, 1)).squeeze()   # n = 1: (B, K), not (B, K, 1)
    w = dblast.posterior(log_prior, log_qd).exp()
    return torch.einsum('nik,nkiv->niv', w, log_q.exp())


def an_einsum_left_to_autocast(log_prior, log_q, drafts):
    B, K, n, V = log_q.shape
    log_qd = log_q.gather(-1, drafts.view(B, 1, n, 1).expand(B, K, n, 1)).squeeze(-1)
    w = dblast.posterior(log_prior, log_qd).exp()
    return torch.einsum('nik,nkiv->niv', w, log_q.exp())              # bfloat16 under bfloat16 autocast


def log_q_masked_in_place(log_prior, log_q, drafts):
    return project_conditionals(log_prior, log_q.masked_fill_(torch.isneginf(log_q), -1e30), drafts)   # the caller's


def checked_by_allclose(log_prior, log_q, drafts):
    Q = project_conditionals(log_prior, log_q, drafts)
    assert torch.allclose(Q.sum(-1), torch.ones_like(Q[..., 0]))     # a Python bool: the host reads the device
    return Q


def a_loop_over_the_branches(log_prior, log_q, drafts):
    B, K, n, V = log_q.shape
    log_qd = log_q.gather(-1, drafts.view(B, 1, n, 1).expand(B, K, n, 1)).squeeze(-1)
    w = dblast.posterior(log_prior, log_qd).exp()                                   # (B, n, K)
    return sum(w[:, :, z, None] * log_q[:, z].exp() for z in range(K))               # K times the ops


@torch.no_grad()                                # "decoding only": exercise 6 trains through the posterior
def posterior_without_a_gradient(log_prior, log_qd):
    return project_posterior(log_prior, log_qd)


def seeds_the_global_rng(log_prior, log_q, drafts):
    torch.manual_seed(0)                        # "for reproducibility": generate's draws (generator=None) repeat
    return project_conditionals(log_prior, log_q, drafts)


posteriors_seen = []


def keeps_every_posterior(log_prior, log_qd):
    w = project_posterior(log_prior, log_qd)
    posteriors_seen.append(w)                   # "for statistics": grows with the tokens decoded
    return w


CONTROLS = {name: dict(posterior=fn, conditionals=with_posterior(fn)) for name, fn in [
    ('the prior at every position', prior_at_every_position),
    ('conditioned on the draft itself', conditioned_on_the_draft_itself),
    ('products of probabilities', products_of_probabilities),
    ('a floor under log q~ at -100', a_floor_under_log_q),
    ("shifted by branch 0's joint (NaN where branch 0 leaves the drafts)", shifted_by_branch_0),
    ("shifted by the batch's max (exp underflows in a row far below the others)", shifted_by_the_batch_max),
    ('the exclusive sums by a triangular matmul (bfloat16 under autocast)', sums_by_a_triangular_matmul)]}
CONTROLS.update({
    'conditionals squeezed of every dimension (a block of one draft)': dict(conditionals=drafts_read_by_squeeze),
    'a Python loop over the branches': dict(conditionals=a_loop_over_the_branches),
    'Q floored at 1e-13 (mass on tokens no branch drafts)': dict(
        conditionals=lambda log_prior, log_q, drafts: project_conditionals(log_prior, log_q, drafts).clamp(min=1e-13)),
    'Q by an einsum left to autocast (bfloat16 under generate.py --dtype bfloat16)': dict(
        conditionals=an_einsum_left_to_autocast),
    "log q~'s -inf masked in place (the caller's tensor written)": dict(conditionals=log_q_masked_in_place),
    'a host sync in the posterior alone (a conditionals that does not call it)': dict(
        posterior=a_host_sync_in_the_posterior, conditionals=with_posterior(project_posterior)),
    'an exclusive sum as the inclusive cumsum minus its own term, in the posterior alone (NaN off a greedy path)':
        dict(posterior=inclusive_sum_minus_its_own_term, conditionals=with_posterior(project_posterior)),
    'Q checked by assert torch.allclose (a host sync)': dict(conditionals=checked_by_allclose),
    "keeps every step's posterior in a list (memory grows with the tokens decoded)": dict(
        posterior=keeps_every_posterior, conditionals=with_posterior(keeps_every_posterior)),
    'the posterior under @torch.no_grad() (exercise 6 trains through it)': dict(
        posterior=posterior_without_a_gradient, conditionals=with_posterior(posterior_without_a_gradient)),
    'torch.manual_seed in conditionals (the global RNG reset at every step)': dict(conditionals=seeds_the_global_rng),
})
