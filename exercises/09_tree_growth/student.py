"""Exercise 9: grow a best-first token tree from a drafter's distributions. Write grow_tree below;
it replaces heads.grow_tree, which grows the tree decode.generate(..., nodes=N) verifies. Check it with

    python -m exercises check 9

The statement is in README.md beside this file."""
import math

import torch


def grow_tree(log_q, B, n, nodes, device):
    """The best-first token tree of at most `nodes` drafted tokens below the bonus, for B rows.

    log_q(d, prefix): prefix (B, M, d) long, any M prefixes of d drafted tokens -> (B, M, V), the
        drafter's log-probability of each token at depth d + 1 after each prefix (-inf: none); the
        first call is log_q(0, an empty (B, 1, 0) prefix), and V is its output's last dimension.
    n: the depths (k - 1). A node's score is the sum of log_q along its prefix.
    Returns tokens (B, m) long, the drafted token of slots 1..m, and tree (B, 2, 1 + m) long:
        tree[:, 0] each slot's parent slot (slot 0, the bonus, is its own; -1: padding, a node of
        score -inf, whose token is still one of the vocabulary and depth one of 0..n: the target
        reads every slot), tree[:, 1] its depth (the bonus 0). m = min(nodes, c_1 + .. + c_n) with
        c_j = min(nodes, V ** j). The m best nodes, every one's parent among them (ties to the
        shallower), each slot after its parent's (in any such order). Static shapes: a loop over
        the n depths is fine, none over rows or nodes; no .item() or other host sync; every tensor
        on `device`. log_q's outputs are the drafter's: add to them out of place.
    """
    raise NotImplementedError("exercise 9: write grow_tree in exercises/09_tree_growth/student.py")
