"""Exercise 5: the mixture's posterior and conditionals (DBlast). Write posterior and conditionals
below; they replace dblast.posterior and dblast.conditionals. Check them with

    python -m exercises check 5

The statement is in README.md beside this file."""
import math

import torch
import torch.nn.functional as F


def posterior(log_prior, log_qd):
    """The posterior of the branch z before each drafted position, in log space.

    log_prior (N, K): log pi'_z, the prior the branch was drawn from.
    log_qd (N, K, n): log q~_l(d_l | z), how likely branch z makes the drafted token at position l
        (0 / -inf for greedy branches: on or off the branch's path).
    Returns log w (N, n, K): log w_{i,z} = log of pi'_z prod_{l<i} q~_l(d_l | z), normalised over z.
    Position i conditions on the drafts before it only. Never multiply probabilities: over a long
    block the products underflow.
    """
    raise NotImplementedError("exercise 5: write posterior in exercises/05_mixture/student.py")


def conditionals(log_prior, log_q, drafts):
    """The mixture proposal's conditional at each drafted position given the drafts before it.

    log_prior (N, K); log_q (N, K, n, V): log q~_i(. | z), every branch's distribution at every
    position; drafts (N, n).
    Returns Q (N, n, V): Q_i(.) = sum_z w_{i,z} q~_i(. | z), each row a distribution.
    """
    raise NotImplementedError("exercise 5: write conditionals in exercises/05_mixture/student.py (in a handout, "
                              "the DBlast drafter proposes with it: train.py's DBlast demos, generate.py --drafter)")
