"""Exercise 6: DBlast's acceptance-length surrogate. Write prefix_log_accept and al_surrogate
below; they replace dblast's own. Check them with

    python -m exercises check 6

The statement is in README.md beside this file."""
import math

import torch
import torch.nn.functional as F


def prefix_log_accept(log_prior, log_qx, log_px, verify='mixture'):
    """a_j (N, n): the log of the probability weight that drafts 1..j are all accepted, at a block
    x sampled from the target (the acceptance-length identity, MATH.md §6).

    log_prior (N, K): log pi'_z; log_qx (N, K, n): log q~_i(x_i | z), each branch's log-probability
    of the block's token at each position; log_px (N, n): the target's log p_i(x_i).
    a_j = sum_{i<=j} min(0, log Q_i(x_i) - log p_i(x_i)), with Q_i the mixture's conditional:
    log Q_i(x_i) = logsumexp_z(log pi'_z + sum_{l<=i} log q~_l) - logsumexp_z(log pi'_z + sum_{l<i} log q~_l).
    Off every greedy branch's path (log q~ = -inf in every branch) Q_i(x_i) = 0 from there on:
    a_j = -inf there, never NaN.
    verify='branch' (the ablation) is optional: only the mixture form is checked.
    """
    raise NotImplementedError("exercise 6: write prefix_log_accept in exercises/06_al_loss/student.py (in a handout, "
                              "train.py's dblast stage trains DBlast with it, and its DBlast demos then decode with "
                              "exercise 5's conditionals too)")


def al_surrogate(a, nll, tau_threshold):
    """The AL loss per row (N,), from a (N, n) and each row's mixture NLL nll (N,):
    λ_j = logsumexp_{j' >= j} a_j'; R = {j : a_j >= log tau_threshold}, chosen without gradient;
    L = -(1/|R|) sum_{j in R} λ_j, or the row's nll where R is empty. tau_threshold >= 0; at 0
    every prefix is kept (log 0 = -inf)."""
    raise NotImplementedError("exercise 6: write al_surrogate in exercises/06_al_loss/student.py")
