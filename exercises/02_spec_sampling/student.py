"""Exercise 2: lossless speculative sampling. Write verify_sampled below; check it with

    python -m exercises check 2

The statement is in README.md beside this file."""
import torch
import torch.nn.functional as F

from model import sample, tempered   # sample(weights, generator): one index per row; tempered: logits / T, safely


def verify_sampled(logits, Q, drafts, temperature, generator=None):
    """Speculative sampling's verification of one block, lossless for any proposal.

    logits (B, k, V): the target's logits after each position of the block [bonus, d_1 .. d_{k-1}].
    Q (B, k-1, V): the proposal's distribution each draft was drawn from, Q_{j+1}(.) for draft j+1,
        at `temperature` already; or None when the drafts are a point mass (Q(d) = 1).
    drafts (B, k-1); temperature > 0; generator: draw every random number from it (the coins and
        the bonuses), never from the global RNG, so the same seed gives the same output.

    Returns accepted (B, k-1) bool, n_acc (B,) long and bonus (B,) long, as verify_greedy does:
    draft j+1 is accepted with probability min(1, P_j(d) / Q_{j+1}(d)) where P_j = softmax of
    logits[:, j] / T; nothing counts past the first rejection; the bonus is a sample of
    norm(max(0, P - Q)) at the rejected position (of P there, row by row, where that residual is
    zero everywhere), or of P_{k-1} when every draft was accepted.
    No Python loop over positions or rows, no .item() or other host sync (torch.multinomial is
    one: it checks its weights on the host), no division by zero, every tensor on the logits' device.
    """
    raise NotImplementedError("exercise 2: write verify_sampled in exercises/02_spec_sampling/student.py "
                              "(in a handout, speculative sampling runs on it: train.py's DBlast demos, "
                              "generate.py --drafter)")
