"""Exercise 6's reference is the project's own dblast.prefix_log_accept and dblast.al_surrogate;
these are the plausible wrong answers its checks must catch."""
import math

import torch
import torch.nn.functional as F

import dblast
from dblast import log_conditionals, posterior

project_al_surrogate = dblast.al_surrogate   # taken before a check plugs anything in
project_prefix_log_accept = dblast.prefix_log_accept


def no_clamp(log_prior, log_qx, log_px, verify='mixture'):
    return (log_conditionals(log_prior, log_qx) - log_px).cumsum(-1)        # ratios above 1 count too


def conditionals_without_their_guard(log_prior, log_qx, log_px, verify='mixture'):
    joint = torch.logsumexp(log_prior.unsqueeze(-1) + log_qx.cumsum(-1), dim=1)        # log Q(x_1..x_i)
    log_q = joint - F.pad(joint[:, :-1], (1, 0))                 # -inf - (-inf) = NaN once off every path
    return (log_q - log_px).clamp(max=0.0).cumsum(-1)


def tail_without_later_prefixes(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    n_keep = keep.sum(-1)
    al = -torch.where(keep, a, 0.0).sum(-1) / n_keep.clamp(min=1)           # a_j where λ_j belongs
    return torch.where(n_keep > 0, al, nll)


def every_prefix_kept(a, nll, tau_threshold):
    return project_al_surrogate(a, nll, 0.0)                                 # the threshold ignored


def strict_threshold(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() > log_threshold                                        # > where the rule says >=
    n_keep = keep.sum(-1)
    al = -torch.where(keep, torch.logcumsumexp(a.flip(-1), -1).flip(-1), 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


def guarded_log_of_zero(a, nll, tau_threshold):
    return project_al_surrogate(a, nll, max(tau_threshold, 1e-12))         # "log 0" made finite: e^-27.6


def divides_by_an_empty_R(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    n = a.size(-1)
    later = torch.ones(n, n, dtype=torch.bool, device=a.device).triu()          # later[j, j']: j' >= j
    lam = torch.logsumexp(torch.where(later, a[:, None, :], -math.inf), -1)    # λ_j
    n_keep = keep.sum(-1)
    al = -(lam * keep).sum(-1) / n_keep             # 0/0 where R is empty: the forward pass's where() hides it
    return torch.where(n_keep > 0, al, nll)


def clamped_terms_detached(log_prior, log_qx, log_px, verify='mixture'):
    clamped = (log_conditionals(log_prior, log_qx) - log_px).detach() >= 0            # (N, n) Q_i above p_i
    cut = torch.where(clamped[:, None, :], log_qx.detach(), log_qx)   # the later posteriors lose these q~
    return (log_conditionals(log_prior, cut) - log_px).clamp(max=0.0).cumsum(-1)


def log_q_clamped(log_prior, log_qx, log_px, verify='mixture'):
    log_q = log_conditionals(log_prior, log_qx.clamp(min=-30.0))     # "log 0" made finite: e^-30
    return (log_q - log_px).clamp(max=0.0).cumsum(-1)


def guarded_by_the_smallest_number(a, nll, tau_threshold):
    return project_al_surrogate(a, nll, max(tau_threshold, torch.finfo(a.dtype).tiny))   # e^-708 in float64


def tails_in_probability_space(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    lam = a.exp().flip(-1).cumsum(-1).flip(-1).log()              # exp(-750) is 0: log 0 = -inf, the loss inf
    n_keep = keep.sum(-1)
    al = -torch.where(keep, lam, 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


def prior_detached(log_prior, log_qx, log_px, verify='mixture'):
    return project_prefix_log_accept(log_prior.detach(), log_qx, log_px)      # the prior untrained by the AL loss


def tails_shifted_by_a_detached_max(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    shift = a.detach().flip(-1).cummax(-1).values.flip(-1)           # each tail's largest a_j, without gradient
    lam = shift + (a - shift).exp().flip(-1).cumsum(-1).flip(-1).log()   # the right value, a wrong gradient
    n_keep = keep.sum(-1)
    al = -torch.where(keep, lam, 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


def threshold_in_float32(a, nll, tau_threshold):
    keep = a.detach() >= torch.tensor(tau_threshold).log()            # float32: log 0.4 lands above float64's
    lam = torch.logcumsumexp(a.flip(-1), dim=-1).flip(-1)
    n_keep = keep.sum(-1)
    al = -torch.where(keep, lam, 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


def tails_shifted_once_per_row(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    top = a.max(-1, keepdim=True).values                              # one shift for the row: a tail far below is 0
    lam = top + (a - top).exp().flip(-1).cumsum(-1).flip(-1).log()
    n_keep = keep.sum(-1)
    al = -torch.where(keep, lam, 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


def averaged_over_the_batchs_largest_R(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    n_keep = keep.sum(-1)
    tails = torch.logcumsumexp(a.flip(-1), -1).flip(-1)
    al = -torch.where(keep, tails, 0.0).sum(-1) / n_keep.max().clamp(min=1)      # one count for every row
    return torch.where(n_keep > 0, al, nll)


def prior_clamped(log_prior, log_qx, log_px, verify='mixture'):
    return project_prefix_log_accept(log_prior.clamp(min=-30.0), log_qx, log_px, verify)   # a ruled-out branch, e^-30


def joint_by_an_einsum(log_prior, log_qx, log_px, verify='mixture'):
    joint = torch.einsum('bk,bkn->bn', log_prior.exp(), log_qx.cumsum(-1).exp())     # bfloat16 under autocast
    before = torch.cat([torch.ones_like(joint[:, :1]), joint[:, :-1]], 1)
    log_q = torch.where(before > 0, joint.log() - before.log(), -math.inf)
    return (log_q - log_px).clamp(max=0.0).cumsum(-1)


def conditionals_by_an_einsum(log_prior, log_qx, log_px, verify='mixture'):
    w = torch.nan_to_num(posterior(log_prior, log_qx).exp())        # (N, n, K), 0 where the block left every path
    log_q = torch.einsum('bnk,bkn->bn', w, log_qx.exp()).log()      # Q_i(x_i) = sum_z w_iz q~_i, in bfloat16
    return (log_q - log_px).clamp(max=0.0).cumsum(-1)


def prefixes_summed_by_a_triangular_matmul(log_prior, log_qx, log_px, verify='mixture'):
    terms = (log_conditionals(log_prior, log_qx) - log_px).clamp(max=0.0)
    upper = torch.ones(terms.size(-1), terms.size(-1), dtype=terms.dtype, device=terms.device).triu()
    a = torch.nan_to_num(terms, neginf=-1e30) @ upper                  # a_j = sum_{i<=j}: bfloat16 under autocast
    return torch.where(a < -1e29, -math.inf, a)


def mean_over_R_by_an_einsum(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    n_keep = keep.sum(-1)
    tails = torch.logcumsumexp(a.flip(-1), -1).flip(-1)
    share = keep.to(a.dtype) / n_keep.clamp(min=1)[:, None]                 # 1/|R| on R, 0 off it
    al = -torch.einsum('bj,bj->b', share, torch.where(keep, tails, 0.0))    # bfloat16 under autocast
    return torch.where(n_keep > 0, al, nll)


def tails_by_an_einsum(a, nll, tau_threshold):
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold
    n_keep = keep.sum(-1)
    later = torch.ones(a.size(-1), a.size(-1), dtype=a.dtype, device=a.device).triu()      # later[j, j']: j' >= j
    shift = a.detach().clamp(min=-1e30)                                       # each tail's own a_j
    ratio = torch.exp(a[:, None, :] - shift[:, :, None]).nan_to_num(nan=0.0)  # exp(a_j' - a_j)
    tails = shift + torch.einsum('bjk,jk->bj', ratio, later).log()           # bfloat16 under autocast
    al = -torch.where(keep, tails, 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


def nll_detached(a, nll, tau_threshold):
    return project_al_surrogate(a, nll.detach(), tau_threshold)              # a row with an empty R learns nothing


def seeds_the_global_rng(a, nll, tau_threshold):
    torch.manual_seed(0)                        # "for reproducibility": every step's batches and dropout repeat
    return project_al_surrogate(a, nll, tau_threshold)


HISTORY = []


def keeps_every_a(log_prior, log_qx, log_px, verify='mixture'):
    a = project_prefix_log_accept(log_prior, log_qx, log_px, verify)
    HISTORY.append(a)                        # for a running statistic: each step's graph kept alive
    return a


CONTROLS = {
    'no clamp at 1': dict(prefix_log_accept=no_clamp),
    'NaN off every branch, where the answer is -inf': dict(prefix_log_accept=conditionals_without_their_guard),
    'the tail without the later prefixes': dict(al_surrogate=tail_without_later_prefixes),
    'every prefix kept': dict(al_surrogate=every_prefix_kept),
    'a strict threshold (a_j > log tau_threshold)': dict(al_surrogate=strict_threshold),
    'tau_threshold 0 guarded as 1e-12': dict(al_surrogate=guarded_log_of_zero),
    'divides by an empty R (a NaN gradient)': dict(al_surrogate=divides_by_an_empty_R),
    'log q~ detached where its term is clamped (the later posteriors lose it)':
        dict(prefix_log_accept=clamped_terms_detached),
    'log q~ clamped at -30': dict(prefix_log_accept=log_q_clamped),
    'tau_threshold 0 guarded as the smallest positive number': dict(al_surrogate=guarded_by_the_smallest_number),
    'the tails summed in probability space (log of a cumsum of exp)': dict(al_surrogate=tails_in_probability_space),
    'the prior detached': dict(prefix_log_accept=prior_detached),
    'the tails shifted by a detached max (a wrong gradient)': dict(al_surrogate=tails_shifted_by_a_detached_max),
    "the threshold's log taken in float32": dict(al_surrogate=threshold_in_float32),
    "the tails shifted once per row by the row's max": dict(al_surrogate=tails_shifted_once_per_row),
    "each row averaged over the batch's largest R": dict(al_surrogate=averaged_over_the_batchs_largest_R),
    'the log prior clamped at -30 (a ruled-out branch kept at e^-30)': dict(prefix_log_accept=prior_clamped),
    "the mixture's joint Q(x_1..x_i) by an einsum, left to autocast": dict(prefix_log_accept=joint_by_an_einsum),
    'Q_i(x_i) as the posterior by an einsum, left to autocast': dict(prefix_log_accept=conditionals_by_an_einsum),
    'a_j summed by a triangular matmul, left to autocast':
        dict(prefix_log_accept=prefixes_summed_by_a_triangular_matmul),
    'the mean over R by an einsum, left to autocast': dict(al_surrogate=mean_over_R_by_an_einsum),
    'the tails by an einsum with a triangular matrix, left to autocast': dict(al_surrogate=tails_by_an_einsum),
    "the fallback's nll detached": dict(al_surrogate=nll_detached),
    'every a kept in a list (each step\'s graph kept alive)': dict(prefix_log_accept=keeps_every_a),
    'torch.manual_seed in al_surrogate (the global RNG reset at every training step)':
        dict(al_surrogate=seeds_the_global_rng),
}
