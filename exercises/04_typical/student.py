"""Exercise 4: a new acceptance rule, typical acceptance. Write typical and parse_typical below;
they become the entry 'typical' of verification.ACCEPT. Check them with

    python -m exercises check 4

The statement is in README.md beside this file."""
import torch
import torch.nn.functional as F


def typical(logits, drafts, param):
    """Typical acceptance (Medusa, Cai et al. 2024): draft j+1 passes when
    p_j(d) > min(epsilon, delta * exp(-H(p_j))), with p_j = softmax(logits[:, j]) and H its entropy.

    logits (B, k, V): the target's logits after each block position; drafts (B, k-1);
    param: (epsilon, delta), what parse_typical returned. Returns ok (B, k-1) bool.
    Like verification.exact, top_n and min_block: no loop, no .item(). The logits may be float32 with
    probabilities that underflow to 0: 0 log 0 is 0 there, never NaN.
    """
    raise NotImplementedError("exercise 4: write typical in exercises/04_typical/student.py")


def parse_typical(text, vocab_size):
    """The parameter of 'typical:EPSILON,DELTA' from its text 'EPSILON,DELTA' -> (epsilon, delta),
    two Python floats: exactly two numbers with 0 < epsilon <= 1 and 0 < delta < 1 (nan refused). Anything else: raise
    ValueError with a short reason (decode turns it into a one-line error naming the flag)."""
    raise NotImplementedError("exercise 4: write parse_typical in exercises/04_typical/student.py")
