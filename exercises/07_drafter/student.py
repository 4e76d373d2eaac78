"""Exercise 7: a drafter of your own, behind the drafter contract (heads.Drafter). Write MyDrafter
below; check it with

    python -m exercises check 7

The statement is in README.md beside this file."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from heads import Drafter
from model import LayerNorm, sample, tempered, upcast


class MyDrafter(Drafter):
    """Your drafter. The contract (heads.Drafter) is all decode.generate uses:

        self.k, self.sample_drafts
        drafts, Q = self.draft(h, bonus, target, k, temperature=0.0, generator=None)

    and the checks train it through `loss`. Build it from the target's width (config.n_embd) and
    vocabulary (config.vocab_size); `target` (the GPT) comes in at every call, so you can share
    its embedding target.transformer.wte and unembedding target.lm_head without owning them.
    """

    def __init__(self, config, k, sample_drafts=True):
        super().__init__()
        self.k, self.sample_drafts = k, sample_drafts
        raise NotImplementedError("exercise 7: build MyDrafter in exercises/07_drafter/student.py")

    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        """h (N, C), bonus (N,) -> drafts (N, k-1), Q (N, k-1, V) or None (see heads.Drafter).
        Every draw from `generator`; Q at `temperature`, applied once (not T^2, not 1)."""
        raise NotImplementedError("exercise 7: write MyDrafter.draft")

    def loss(self, h, bonus, target, x, temperature=1.0):
        """The training loss of a block x (N, k-1) the target sampled after the bonus: a scalar
        (for example the cross-entropy of your distributions at `temperature` against x). The
        temperature enters as it does in draft, once: the checks train at T = 1.5 and then ask
        draft for drafts at 1.5."""
        raise NotImplementedError("exercise 7: write MyDrafter.loss")
