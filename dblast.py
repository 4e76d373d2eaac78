"""
DBlast: dependent block drafting for speculative *sampling* (our reading, DESIGN §4).

An independent block drafter proposes each position from its own marginal. When the target
samples at a high temperature, several continuations are plausible and a product of marginals
mixes them into drafts no single continuation would produce. DBlast adds a latent category z:

    u     = ln(W_u [h ; E(b)])                       anchor: target state h and the bonus b
    log pi(z | u) = log_softmax(W_pi u)              category prior head, z = 1..K
    u_z   = u + g_z(u),  g(u) = W_g2 relu(W_g1 u)    category hidden expander (K offsets)
    q_i(. | u_z)                                     the BPD block head of heads.py on u_z
    q_dep(x_1..x_{k-1}) = sum_z pi_z prod_i q_i(x_i | u_z)     a CP / low-rank mixture

Inference: z ~ softmax(log pi / Z_T) (Z_T = 0: argmax), then the branch is drafted in one pass,
greedily (point mass, the paper's choice) or sampled (its q goes to verification). z is drawn
independently of the target's randomness, so verification stays exactly lossless. K = 1 is the
independent, anchored block drafter.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from decode import sample, upcast
from heads import BlockHeads
from model import LayerNorm


class DBlastDrafter(nn.Module):

    def __init__(self, config, k, K, d_hidden=None):
        super().__init__()
        if K < 1:
            raise ValueError(f"K={K}: need at least one branch")
        C = config.n_embd
        self.k, self.K, self.n_embd = k, K, C
        self.w_u = nn.Linear(2 * C, C, bias=config.bias)
        self.ln_u = LayerNorm(C, bias=config.bias)
        self.w_pi = nn.Linear(C, K)                      # category prior head
        self.g_fc = nn.Linear(C, C)                      # category hidden expander
        self.g_proj = nn.Linear(C, K * C)
        self.block = BlockHeads(config, k, d_hidden)     # the block head, shared by the branches
        for lin in (self.w_u, self.w_pi, self.g_fc, self.g_proj):
            nn.init.normal_(lin.weight, std=0.02)        # random g: branches must start different,
            nn.init.zeros_(lin.bias)                     # or they stay identical forever
        self.zt = 1.0               # category temperature Z_T at inference
        self.sample_drafts = False  # False: greedy branch (point mass); True: sample it

    def branches(self, h, bonus, target):
        """h (N, C), bonus (N,) -> log pi (N, K), branch states u_z (N, K, C)."""
        u = self.ln_u(self.w_u(torch.cat([h, target.transformer.wte(bonus)], dim=-1)))
        log_pi = F.log_softmax(upcast(self.w_pi(u)), dim=-1)
        u_z = u.unsqueeze(1) + self.g_proj(F.relu(self.g_fc(u))).view(-1, self.K, self.n_embd)
        return log_pi, u_z

    def log_q(self, h, bonus, target, x, temperature=1.0):
        """Training view. x (N, k-1): the block after the bonus.
        Returns log pi (N, K) and log q_i(x_i | u_z) (N, K, k-1) at `temperature` (the same
        temperature decoding applies to q)."""
        log_pi, u_z = self.branches(h, bonus, target)
        logits = upcast(self.block(u_z, target.lm_head)) / temperature      # (N, K, k-1, V)
        lq = F.log_softmax(logits, dim=-1)
        return log_pi, lq.gather(-1, x[:, None, :, None].expand(-1, self.K, -1, 1)).squeeze(-1)

    @staticmethod
    def nll(log_pi, log_qx):
        """Mixture NLL per row: -log sum_z pi_z prod_i q_i(x_i | u_z). K = 1: sum of CEs."""
        return -torch.logsumexp(log_pi + log_qx.sum(-1), dim=-1)

    @staticmethod
    def prefix_log_accept(log_pi, log_qx, log_px):
        """a_j = logsumexp_z(log pi_z + sum_{i<=j} min(0, log q_i - log p_i)), (N, k-1).
        For x ~ p and drafts sampled from q(. | z) with z ~ pi, E[exp(a_j)] is exactly the
        probability that the first j drafts are accepted (DESIGN §4)."""
        l = (log_qx - log_px.unsqueeze(1)).clamp(max=0.0)                  # (N, K, k-1)
        return torch.logsumexp(log_pi.unsqueeze(-1) + l.cumsum(-1), dim=1)

    def loss(self, h, bonus, target, x, log_px, temperature=1.0, kind='al',
             tau_threshold=0.01, nll_weight=0.0):
        """Mean loss over rows. x (N, k-1) sampled from the target at `temperature`, log_px (N, k-1)
        the target's log-probabilities of them (detached).

        kind='nll': mixture NLL. kind='al': the acceptance-length surrogate, our reading of DBlast:
        t_j = logsumexp_{j' >= j} a_j' (a_j plus the log of the expected accepted length after j),
        L = -(1/|S|) sum_{j in S} t_j over S = {j : a_j >= log tau_threshold} (chosen without
        gradient); a row with an empty S falls back to its NLL."""
        log_pi, log_qx = self.log_q(h, bonus, target, x, temperature)
        nll = self.nll(log_pi, log_qx)
        if kind == 'nll':
            return nll.mean()
        a = self.prefix_log_accept(log_pi, log_qx, log_px)                  # (N, k-1)
        t = torch.logcumsumexp(a.flip(-1), dim=-1).flip(-1)                 # tail sums
        log_tau = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
        keep = a.detach() >= log_tau                                        # S, no gradient
        n_keep = keep.sum(-1)
        al = -torch.where(keep, t, 0.0).sum(-1) / n_keep.clamp(min=1)
        per_row = torch.where(n_keep > 0, al, nll)
        return per_row.mean() + nll_weight * nll.mean()

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        """Drafter interface: pick a branch, draft its k-1 tokens in one pass.
        Returns drafts (N, k-1) and q (N, k-1, V) when sampled, None for point-mass drafts."""
        log_pi, u_z = self.branches(h, bonus, target)
        if self.zt == 0:
            z = log_pi.argmax(-1)
        else:
            z = sample(F.softmax(log_pi / self.zt, dim=-1), generator)      # (N,)
        u = u_z.gather(1, z[:, None, None].expand(-1, 1, self.n_embd)).squeeze(1)
        logits = self.block(u, target.lm_head, k - 1)                       # (N, k-1, V)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        q = F.softmax(upcast(logits) / temperature, dim=-1)
        return sample(q, generator), q
