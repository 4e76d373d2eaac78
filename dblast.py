"""
DBlast: dependent block drafting for speculative *sampling* (our reading of the paper).

An independent block drafter proposes each position from its own marginal. When the target
samples at a high temperature, several continuations are plausible and a product of marginals
mixes them into drafts no single continuation would produce. DBlast adds a latent category z:

    u     = ln(W_u [h ; E(b)])                       anchor: target state h and the bonus b
    log pi(z | u) = log_softmax(W_pi u)              category prior head, z = 1..K
    u_z   = u + g_z(u),  g(u) = W_g2 relu(W_g1 u)    category hidden expander (K offsets)
    q_i(. | u_z)                                     the BPD block head of heads.py on u_z

The proposal. At inference z ~ pi' = softmax(log pi / Z_T) (Z_T = 0: the argmax branch), and
branch z drafts its k-1 tokens in one pass, greedily (the paper's choice) or by sampling. Write
q~_i(. | z) for what branch z drafts with: q_i itself when sampled, the one-hot of its argmax when
greedy. The drafts are then one sample of the mixture

    Q(x_1..x_{k-1}) = sum_z pi'_z prod_i q~_i(x_i | z)

Speculative sampling is lossless for any proposal, provided each draft is verified against the
proposal's own conditional given the drafts before it:

    Q_i(.) = sum_z w_{i,z} q~_i(. | z),     w_{i,z} ∝ pi'_z prod_{l<i} q~_l(d_l | z)

(the posterior of z given the drafts so far; `posterior`, `DBlastDrafter.draft`). The drafter
evaluates all K branches in the one pass, so this costs no extra call. With greedy branches Q is
a mixture of K point-mass paths: up to K candidate continuations verified at once.

Verifying against the drawn branch's q~(. | z) alone ("branch-conditional", `verify="branch"`) is
also lossless, but its expected accepted length is sum_z pi'_z AL(branch z): linear in the prior,
never above the best single branch, whatever K and Z_T. It is kept as the ablation that shows why
the mixture matters. At the first draft the mixture is never worse: E_z min(p, q_z) <= min(p, E_z q_z).

The acceptance-length identity (used by the AL loss and by `expected_accepted`): for x ~ p,

    a_j = sum_{i<=j} min(0, log Q_i(x_i) - log p_i(x_i)),   E_x[exp(a_j)] = P(first j drafts accepted)

because sum_x prod_i min(Q_i, p_i) is symmetric in p and Q. Summed over j it is the expected
number of accepted drafts, exactly, for any proposal: sampled branches (q~ = q) and greedy ones.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from data import PROMPT_LEN
from heads import BlockHeads
from model import LayerNorm, sample, tempered, upcast

VERIFY = ('mixture', 'branch')          # what drafts are verified against (DBlastDrafter.verify)
LOSSES = ('al', 'al-branch', 'nll')     # DBlastDrafter.loss kinds


# ----------------------------------------------------------------------------- the mixture's math

def prior(log_pi, zt):
    """log pi' = log_softmax(log pi / Z_T), (N, K). Z_T = 0: a point mass on the argmax branch."""
    if zt == 0:
        top = F.one_hot(log_pi.argmax(-1), log_pi.size(-1)).bool()
        return torch.where(top, 0.0, -math.inf).to(log_pi.dtype)
    return F.log_softmax(log_pi / zt, dim=-1)


def posterior(log_prior, log_qd):
    """log w (N, n, K): the posterior of z before each drafted position, in log space (no
    underflow however long the block). log_prior (N, K); log_qd (N, K, n) = log q~_l(d_l | z).
    w_{i,z} ∝ pi'_z prod_{l<i} q~_l(d_l | z): position i conditions on the drafts before it only."""
    before = F.pad(log_qd.cumsum(-1)[..., :-1], (1, 0))            # sum_{l<i}, exclusive
    return F.log_softmax(log_prior.unsqueeze(-1) + before, dim=1).transpose(1, 2)


def log_conditionals(log_prior, log_qx):
    """log Q_i(x_i | x_<i) (N, n) of the mixture at a block x; log_qx (N, K, n) = log q~_i(x_i | z).
        log Q_i(x_i) = log sum_z pi'_z prod_{l<=i} q~_l(x_l|z) - log sum_z pi'_z prod_{l<i} q~_l(x_l|z)
    A prefix the proposal cannot produce (greedy branches) gives -inf from there on, not NaN."""
    joint = torch.logsumexp(log_prior.unsqueeze(-1) + log_qx.cumsum(-1), dim=1)  # log Q(x_1..x_i)
    before = F.pad(joint[:, :-1], (1, 0))
    return torch.where(before == -math.inf, -math.inf, joint - before)


def prefix_log_accept(log_prior, log_qx, log_px, verify='mixture'):
    """a_j (N, n): log of the probability weight that drafts 1..j are all accepted, at x ~ p.
    verify='mixture':  a_j = sum_{i<=j} min(0, log Q_i(x_i) - log p_i(x_i))
    verify='branch':   a_j = logsumexp_z(log pi'_z + sum_{i<=j} min(0, log q~_i(x_i|z) - log p_i(x_i)))
    (z drawn first, each draft verified against its own branch). E_{x~p}[exp(a_j)] is the probability
    that the first j drafts are accepted under that verification."""
    if verify == 'mixture':
        return (log_conditionals(log_prior, log_qx) - log_px).clamp(max=0.0).cumsum(-1)
    l = (log_qx - log_px.unsqueeze(1)).clamp(max=0.0)                  # (N, K, n)
    return torch.logsumexp(log_prior.unsqueeze(-1) + l.cumsum(-1), dim=1)


def branch_log_q(logits, x, temperature, branches):
    """log q~_i(x_i | z) (N, K, n) from branch logits (N, K, n, V): the tempered softmax for sampled
    branches, 0 / -inf (the one-hot of the argmax) for greedy ones."""
    if branches == 'greedy':
        return torch.where(logits.argmax(-1) == x.unsqueeze(1), 0.0, -math.inf).to(logits.dtype)
    lq = F.log_softmax(tempered(logits, temperature), dim=-1)
    return lq.gather(-1, x[:, None, :, None].expand(-1, logits.size(1), -1, 1)).squeeze(-1)


@torch.no_grad()
def expected_accepted(drafter, h, bonus, target, x, log_px, temperature, branches, verify, zt=1.0):
    """The expected number of accepted drafts per anchor (N,), by the identity above: sum_j exp(a_j)
    at target samples x (N, n) with the target's log-probabilities log_px (N, n). In each context
    (prefix and bonus) its expectation over x is exactly the decoder's, with far less variance (no
    drafts or coins are drawn). Works for any drafter with `mixture_logits` (BPD heads: K = 1)."""
    log_pi, logits = drafter.mixture_logits(h, bonus, target, x.size(1))
    log_qx = branch_log_q(upcast(logits), x, temperature, branches)
    a = prefix_log_accept(prior(log_pi, zt), log_qx, log_px, verify)
    return a.exp().sum(-1)


def anchors(data, k, r, t):
    """Anchors of target samples (train.dblast_data: seqs, H, LP) at rows r, positions t (both (N,)):
    h after s[t], the bonus s[t+1], the k-1 drafts' targets s[t+2 .. t+k] and their target
    log-probabilities. Valid t: PROMPT_LEN - 1 <= t < S - k (the bonus is sampled, the block fits)."""
    seqs, H, LP = data
    offs = torch.arange(k - 1, device=seqs.device)
    return H[r, t], seqs[r, t + 1], seqs[r[:, None], t[:, None] + 2 + offs], LP[r[:, None], t[:, None] + 1 + offs]


@torch.no_grad()
def expected_tau(drafter, model, data, k, temperature, branches, verify, zt=1.0, chunk=2048):
    """Expected tau (bonus included), averaged over every anchor of held-out target samples, by the
    acceptance-length identity (expected_accepted): the cheap, low-variance measure of a
    drafter's acceptance. Exact per context; decoding averages over the positions its blocks start
    at instead of every position, so the two can differ a little where acceptance varies along
    the text (MATH.md §7). Decoding measures speed."""
    seqs = data[0]
    lo, hi = PROMPT_LEN - 1, seqs.size(1) - k
    r = torch.arange(len(seqs), device=seqs.device).repeat_interleave(hi - lo)
    t = torch.arange(lo, hi, device=seqs.device).repeat(len(seqs))
    total = 0.0
    for i in range(0, len(r), chunk):
        h, bonus, x, log_px = anchors(data, k, r[i:i + chunk], t[i:i + chunk])
        total += float(expected_accepted(drafter, h.to(model.lm_head.weight.dtype), bonus, model, x, log_px,
                                         temperature, branches, verify, zt).sum())
    return 1 + total / len(r)


# ----------------------------------------------------------------------------- the drafter

class DBlastDrafter(nn.Module):

    def __init__(self, config, k, K, d_hidden=None, branches='sampled', verify='mixture'):
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
            nn.init.normal_(lin.weight, std=0.02)
            if lin.bias is not None:   # w_u follows the target's bias setting
                nn.init.zeros_(lin.bias)
        # The branches must start different, or they stay alike: with fan-in scaled g weights each
        # branch's offset starts at about a third of the anchor's scale. At GPT-2's 0.02 the offsets
        # are tiny, and on a multimodal block the K branches were seen to settle on one or two
        # modes instead of one each (the phrase test in tests/test_dblast.py).
        nn.init.normal_(self.g_fc.weight, std=C ** -0.5)
        nn.init.normal_(self.g_proj.weight, std=0.5 * C ** -0.5)
        # inference settings (not weights): category temperature Z_T, how a branch drafts, and
        # what the drafts are verified against
        self.zt, self.branches, self.verify = 1.0, branches, verify

    def anchor(self, h, bonus, target):
        """h (N, C), bonus (N,) -> log pi (N, K), branch states u_z (N, K, C)."""
        u = self.ln_u(self.w_u(torch.cat([h, target.transformer.wte(bonus)], dim=-1)))
        log_pi = F.log_softmax(upcast(self.w_pi(u)), dim=-1)
        u_z = u.unsqueeze(1) + self.g_proj(F.relu(self.g_fc(u))).view(-1, self.K, self.n_embd)
        return log_pi, u_z

    def mixture_logits(self, h, bonus, target, n):
        """log pi (N, K) and every branch's logits (N, K, n, V) for the n drafts, in one pass."""
        log_pi, u_z = self.anchor(h, bonus, target)
        return log_pi, self.block(u_z, target.lm_head, n)

    def log_q(self, h, bonus, target, x, temperature=1.0):
        """Training view. x (N, k-1): the block after the bonus.
        Returns log pi (N, K) and log q_i(x_i | u_z) (N, K, k-1) at `temperature` (the temperature
        decoding applies to q)."""
        log_pi, logits = self.mixture_logits(h, bonus, target, x.size(1))
        return log_pi, branch_log_q(upcast(logits), x, temperature, 'sampled')

    @staticmethod
    def nll(log_pi, log_qx):
        """Mixture NLL per row: -log sum_z pi_z prod_i q_i(x_i | u_z). K = 1: sum of CEs."""
        return -torch.logsumexp(log_pi + log_qx.sum(-1), dim=-1)

    def loss(self, h, bonus, target, x, log_px, temperature=1.0, kind='al',
             tau_threshold=0.01, nll_weight=0.0):
        """Mean loss over rows. x (N, k-1) sampled from the target at `temperature`, log_px (N, k-1)
        the target's log-probabilities of them (detached).

        kind='nll': mixture NLL. kind='al': the acceptance-length surrogate on the mixture's
        conditionals (what mixture verification of sampled branches accepts; our reading of
        DBlast's AL loss); kind='al-branch': the same on branch-conditional acceptance (ablation).
        t_j = logsumexp_{j' >= j} a_j' (a_j plus the log of the expected accepted length after j),
        L = -(1/|S|) sum_{j in S} t_j over S = {j : a_j >= log tau_threshold} (chosen without
        gradient); a row with an empty S falls back to its NLL. nll_weight adds that much NLL."""
        log_pi, log_qx = self.log_q(h, bonus, target, x, temperature)
        nll = self.nll(log_pi, log_qx)
        if kind == 'nll':
            return nll.mean()
        a = prefix_log_accept(log_pi, log_qx, log_px, 'mixture' if kind == 'al' else 'branch')
        t = torch.logcumsumexp(a.flip(-1), dim=-1).flip(-1)                 # tail sums
        log_tau = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
        keep = a.detach() >= log_tau                                        # S, no gradient
        n_keep = keep.sum(-1)
        al = -torch.where(keep, t, 0.0).sum(-1) / n_keep.clamp(min=1)
        per_row = torch.where(n_keep > 0, al, nll)
        return per_row.mean() + nll_weight * nll.mean()

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        """Drafter interface: h (N, C) at the bonus's position, bonus (N,) -> drafts (N, k-1) and
        the proposal's conditionals Q (N, k-1, V) given the drafted prefix, or None for a point
        mass (greedy decoding, or greedy branches verified branch by branch). All K branches in
        one pass; z ~ pi', then branch z drafts."""
        n = k - 1
        log_pi, logits = self.mixture_logits(h, bonus, target, n)
        logits = upcast(logits)                                             # (N, K, n, V)
        N, K, _, V = logits.shape
        log_prior = prior(log_pi, self.zt)                                  # (N, K) log pi'
        z = sample(log_prior.exp(), generator)                              # (N,)
        if temperature == 0.0 or self.branches == 'greedy':
            paths = logits.argmax(-1)                                       # (N, K, n)
            drafts = paths.gather(1, z.view(N, 1, 1).expand(N, 1, n)).squeeze(1)
            if temperature == 0.0 or self.verify == 'branch' or K == 1:
                return drafts, None                                         # point mass
            # Q_i: the posterior weight of every branch whose path passes through the drafts so
            # far, placed on that branch's token at i (a mixture of K point-mass paths)
            log_qd = torch.where(paths == drafts.unsqueeze(1), 0.0, -math.inf).to(logits.dtype)
            w = posterior(log_prior, log_qd).exp()                          # (N, n, K)
            Q = torch.zeros(N, n, V, dtype=w.dtype, device=w.device)
            return drafts, Q.scatter_add_(-1, paths.transpose(1, 2), w)
        lq = F.log_softmax(tempered(logits, temperature), dim=-1)           # (N, K, n, V)
        q = lq.exp()
        q_z = q.gather(1, z.view(N, 1, 1, 1).expand(N, 1, n, V)).squeeze(1)  # (N, n, V)
        drafts = sample(q_z, generator)                                     # (N, n)
        if self.verify == 'branch':
            return drafts, q_z
        log_qd = lq.gather(-1, drafts.view(N, 1, n, 1).expand(N, K, n, 1)).squeeze(-1)  # (N, K, n)
        w = posterior(log_prior, log_qd).exp()                              # (N, n, K)
        return drafts, torch.einsum('nik,nkiv->niv', w, q)
