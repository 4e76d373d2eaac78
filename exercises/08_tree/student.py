"""Exercise 8 (capstone): verify all K greedy branches of a DBlast drafter in one target call.
Write tree_step below; check it with

    python -m exercises check 8

The statement is in README.md beside this file, the decoding loop the checks run around your
tree_step with it."""
import torch
import torch.nn.functional as F

from model import sample, tempered, upcast


@torch.no_grad()
def tree_step(model, cache, bonus, paths, active, temperature=0.0, generator=None):
    """One target call that verifies K candidate continuations at once, and commits the best.

    model: the target GPT; cache: its model.KVCache, each row's committed prefix in it.
    bonus (B,): the token to verify the paths after (already decided, about to be committed).
    paths (B, K, n): the K branches' greedy drafts (n = k-1 tokens each).
    active (B,) bool: rows still generating; the others must not advance.
    temperature: 0 for greedy decoding; > 0 for sampling, which must stay lossless.

    Feed [bonus, path_0, .., path_{K-1}] through the target in one call with a tree attention mask
    (each token sees the committed prefix, the bonus and the earlier tokens of its own path, at
    the positions it would have in its path; a slot past the target's last position, near the end
    of the context, gets that last one). Then:
      n_acc (B,): how many tokens of the accepted branch are committed,
      branch (B,): which branch,
      next_bonus (B,): the target's token after them (argmax, or the lossless sample),
      h (B, C): the target's final hidden state at the last committed token (for the next drafts).
    Commit bonus + the branch's first n_acc tokens into the cache, contiguously after the prefix
    (moving the branch's keys and values where they belong), for the active rows.
    Returns (n_acc, branch, next_bonus, h).
    """
    raise NotImplementedError("exercise 8: write tree_step in exercises/08_tree/student.py")
