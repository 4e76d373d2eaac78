"""Exercise 1: BPD verification. Write verify_greedy below; check it with

    python -m exercises check 1

The statement is in README.md beside this file."""
import torch


def verify_greedy(logits, drafts, accept):
    """Greedy verification of one block (BPD §3).

    logits (B, k, V): the target's logits after each position of the block [bonus, d_1 .. d_{k-1}];
        logits[:, j] is the target's prediction for the token after block position j.
    drafts (B, k-1): d_1 .. d_{k-1}.
    accept: (rule, param). ok = rule(logits, drafts, param) is a (B, k-1) bool tensor saying which
        drafts the acceptance rule lets through (verification.exact: draft j+1 equals the argmax of
        logits[:, j]).

    Returns
        accepted (B, k-1) bool: True for the drafts that are committed, False from the first one
            the rule refuses on (whatever the rule says about the drafts after it),
        n_acc (B,) long (int32 works too): how many drafts are committed,
        bonus (B,) long (or int32): the token after the last committed one, the target's own argmax.
    No Python loop over positions or rows, no .item().
    """
    raise NotImplementedError("exercise 1: write verify_greedy in exercises/01_bpd_verify/student.py (in a "
                              "handout, blockwise greedy decoding runs on it: train.py's heads stage and demos, "
                              "generate.py --heads)")
