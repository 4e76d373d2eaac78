"""
DBlast: dependent block drafting for speculative *sampling* (our reading of "DBlast: Dependent
Block Drafting for Stochastic Speculative Decoding"; the math, with every equation, is MATH.md
§5-7).

An independent block drafter proposes each position from its own marginal; at a high temperature
the target's continuations are several, and a product of marginals mixes them into blocks no
single continuation would produce. DBlast adds a latent branch z (MATH.md §5): an anchor state
made from the target's state h and the bonus, the category prior head pi(z | anchor), the
category hidden expander (one offset of the anchor per branch), and the BPD block head of
heads.py run on each branch. At inference z ~ pi' = softmax(log pi / Z_T), and branch z drafts
its k-1 tokens in one pass, by sampling or greedily (the paper's choice).

Here, in reading order:
  the mixture's math    prior, branch order, the branches' log q~, the posterior over z given the
                        drafts, the proposal's conditionals Q_i (what verification must use), and
                        the acceptance-length identity the AL loss and the evaluator rest on
  the target's samples  TargetSamples: what training and the evaluator read, and contexts() of it
  the exact evaluator   expected accepted length on held-out target samples (MATH.md §7)
  the drafter           DBlastDrafter: anchor, prior head, expander, block head; its losses
                        (mixture NLL, the AL surrogate) and the drafter contract (heads.Drafter)

Names: n = k-1 drafts; B rows; log_prior is log pi', the prior the branch is drawn from. The
losses score the target's samples with pi itself (Z_T = 1, where pi' = pi).
"""
import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from cli import BadInput
from data import PROMPT_LEN
from heads import LOGITS_BUDGET, BlockHeads, Drafter, scores_from
from model import LayerNorm, sample, tempered, upcast

VERIFY = ('mixture', 'branch')          # what drafts are verified against (DBlastDrafter.verify)
PATHS_FROM = ('iid', 'branches')        # how several paths per call are drawn (DBlastDrafter.paths_from)
LOSSES = ('al', 'al-branch', 'nll')     # DBlastDrafter.loss kinds


# ----------------------------------------------------------------------------- the mixture's math

def prior(log_pi, zt):
    """log pi' (B, K), the prior a branch is drawn from at category temperature Z_T (MATH.md §1).
    Z_T = 1 leaves pi as it is; Z_T = 0 puts all the mass on the argmax branch."""
    if zt == 1:
        return log_pi
    if zt == 0:
        top = F.one_hot(log_pi.argmax(-1), log_pi.size(-1)).bool()
        return torch.where(top, 0.0, -math.inf).to(log_pi.dtype)
    return F.log_softmax(log_pi / zt, dim=-1)


def branch_order(log_pi, zt, generator=None):
    """The K branches (B, K) in the order of a draw without replacement from pi' (Gumbel top-K:
    log pi / Z_T plus Gumbel noise, sorted); Z_T = 0: by prior, descending. For one path per
    branch, each verified against its own branch, which branches are drawn changes how much is
    accepted and not the distribution (they are chosen before any token; MATH.md §9)."""
    if zt == 0:
        return log_pi.argsort(-1, descending=True)
    unif = torch.rand(log_pi.shape, generator=generator, device=log_pi.device, dtype=log_pi.dtype)
    return (log_pi / zt - torch.log(-torch.log(unif))).argsort(-1, descending=True)


def branch_log_probs(logits, temperature, sample_drafts):
    """log q~_i(. | z) (B, K, n, V) from the branches' logits (B, K, n, V): the tempered
    log-softmax for sampled branches; for greedy ones the one-hot of the argmax (0 there, -inf
    elsewhere), the point mass a greedy branch drafts from."""
    if sample_drafts:
        return F.log_softmax(tempered(logits, temperature), dim=-1)
    top = logits.argmax(-1, keepdim=True)
    return torch.full_like(logits, -math.inf).scatter_(-1, top, 0.0)


def branch_log_q(logits, x, temperature, sample_drafts):
    """log q~_i(x_i | z) (B, K, n) at a block x (B, n): branch_log_probs read at x."""
    log_q = branch_log_probs(logits, temperature, sample_drafts)
    return log_q.gather(-1, x[:, None, :, None].expand(-1, logits.size(1), -1, 1)).squeeze(-1)


def posterior(log_prior, log_qd):
    """log w (B, n, K): the posterior of z before each drafted position (MATH.md §5), in log
    space (no underflow however long the block). log_prior (B, K); log_qd (B, K, n) =
    log q~_l(d_l | z). Position i conditions on the drafts before it only."""
    before = F.pad(log_qd.cumsum(-1)[..., :-1], (1, 0))            # sum_{l<i}, exclusive
    return F.log_softmax(log_prior.unsqueeze(-1) + before, dim=1).transpose(1, 2)


def conditionals(log_prior, log_q, drafts):
    """Q_i(.) (B, n, V): the mixture's conditional at each drafted position given the drafts
    before it (MATH.md §5), what verification must use. log_q (B, K, n, V) = branch_log_probs;
    drafts (B, n)."""
    B, K, n, V = log_q.shape
    log_qd = log_q.gather(-1, drafts.view(B, 1, n, 1).expand(B, K, n, 1)).squeeze(-1)   # (B, K, n)
    w = posterior(log_prior, log_qd).exp()                                             # (B, n, K)
    # Q must be what the drafts were drawn from, to float32's precision whatever the settings: a
    # product and a sum over the branches, not a matmul, which bf16 autocast would run in bf16 and
    # --tf32 with each factor rounded to 10 bits, so that acceptance and the residual would use a
    # distribution the drafts never came from
    return (w.transpose(1, 2).unsqueeze(-1) * log_q.exp()).sum(1)                   # (B, n, V)


def log_conditionals(log_prior, log_qx):
    """log Q_i(x_i | x_<i) (B, n) of the mixture at a block x, as a difference of two logsumexps
    (MATH.md §6); log_qx (B, K, n) = log q~_i(x_i | z). A prefix the proposal cannot produce
    (greedy branches) gives -inf from there on, not NaN."""
    joint = torch.logsumexp(log_prior.unsqueeze(-1) + log_qx.cumsum(-1), dim=1)  # log Q(x_1..x_i)
    before = F.pad(joint[:, :-1], (1, 0))
    return torch.where(before == -math.inf, -math.inf, joint - before)


def prefix_log_accept(log_prior, log_qx, log_px, verify='mixture'):
    """a_j (B, n): log of the probability weight that drafts 1..j are all accepted, at x ~ p
    (MATH.md §6), against the mixture's conditionals (verify='mixture') or against the drawn
    branch alone (verify='branch'). E_{x~p}[exp(a_j)] is the probability that the first j drafts
    are accepted under that verification."""
    if verify == 'mixture':
        return (log_conditionals(log_prior, log_qx) - log_px).clamp(max=0.0).cumsum(-1)
    l = (log_qx - log_px.unsqueeze(1)).clamp(max=0.0)                  # (B, K, n)
    return torch.logsumexp(log_prior.unsqueeze(-1) + l.cumsum(-1), dim=1)


def al_surrogate(a, nll, tau_threshold):
    """The acceptance-length surrogate per row (DBlast's AL loss, our reading; MATH.md §6): minus
    the mean of the tails lambda_j = logsumexp_{j' >= j} a_j' over the retained prefixes
    R = {j : a_j >= log eta} (eta = tau_threshold; R chosen without gradient), from the prefix
    log-acceptance a (B, n) of prefix_log_accept. A row with an empty R falls back to its nll (B,)."""
    tail = torch.logcumsumexp(a.flip(-1), dim=-1).flip(-1)              # lambda_j
    log_threshold = math.log(tau_threshold) if tau_threshold > 0 else -math.inf
    keep = a.detach() >= log_threshold                                  # R, no gradient
    n_keep = keep.sum(-1)
    al = -torch.where(keep, tail, 0.0).sum(-1) / n_keep.clamp(min=1)
    return torch.where(n_keep > 0, al, nll)


# ----------------------------------------------------------------------------- the target's samples

class TargetSamples(NamedTuple):
    """The target's own samples y at temperature T, and what the DBlast losses and the evaluator
    read of them (made by `of`, read by `contexts`; MATH.md §6):

        seqs (B, S)      a corpus prompt of PROMPT_LEN tokens and the target's sampled continuation
        H    (B, S, C)   the frozen target's final hidden states over seqs
        LP   (B, S-1)    LP[:, t] = log p_T(seqs[:, t+1] | seqs[:, <=t]), at the temperature T
    """
    seqs: torch.Tensor
    H: torch.Tensor
    LP: torch.Tensor

    @classmethod
    @torch.no_grad()
    def of(cls, model, seqs, temperature, precision=nullcontext(), chunk=None):
        """H and LP of the sequences seqs (B, S), chunk rows at a time, the target run under
        `precision` (a context manager). chunk=None: 64 rows, or fewer where their logits would
        pass LOGITS_BUDGET elements (rows * S * V; a GPT-2 vocabulary), at least one."""
        S, V = seqs.size(1), model.config.vocab_size
        chunk = chunk or max(1, min(64, LOGITS_BUDGET // (S * V)))
        hs, lps = [], []
        for i in range(0, len(seqs), chunk):
            y = seqs[i:i + chunk]
            with precision:
                h = model.hidden(y)                                           # (rows, S, C)
                logits = model.lm_head(h[:, :-1])                             # (rows, S-1, V)
            logits = tempered(logits.float(), temperature)                    # float32
            # log_softmax read at the sampled token only: no second (rows, S-1, V) tensor of it
            lps.append(logits.gather(-1, y[:, 1:, None]).squeeze(-1) - logits.logsumexp(-1))   # (rows, S-1)
            hs.append(h.float())
            del logits     # before the next chunk's logits: one chunk's alive at a time
        return cls(seqs, torch.cat(hs), torch.cat(lps))

    def positions(self, k):
        """The context positions t with a full block: PROMPT_LEN - 1 <= t < S - k (the bonus y[t+1]
        is sampled, not prompt, and the k-1 tokens after it fit), as the range (lo, hi)."""
        return PROMPT_LEN - 1, self.seqs.size(1) - k


def contexts(samples, k, rows, pos):
    """The contexts at rows, positions pos (both (B,)) of `samples`, the training examples and
    evaluation points of MATH.md §6-7: h after y[pos] (B, C), the bonus y[pos+1] (B,), the block
    after it x = y[pos+2 .. pos+k] (B, k-1) (what the drafts should be), and the target's
    log-probabilities of it log_px (B, k-1)."""
    seqs, H, LP = samples
    offs = torch.arange(k - 1, device=seqs.device)
    at = pos[:, None] + offs                                            # (B, k-1)
    return H[rows, pos], seqs[rows, pos + 1], seqs[rows[:, None], at + 2], LP[rows[:, None], at + 1]


# ----------------------------------------------------------------------------- the exact evaluator

@torch.no_grad()
def expected_accepted(drafter, h, bonus, target, x, log_px, temperature, sample_drafts, verify, zt=1.0):
    """The expected number of accepted drafts per context (B,) (MATH.md §7): sum_j exp(a_j) at
    target samples x (B, n) with the target's log-probabilities log_px (B, n). In each context
    (prefix and bonus) its expectation over x is exactly the decoder's, with far less variance (no
    drafts or coins are drawn). Works for any drafter with `mixture_logits` (BPD heads: K = 1)."""
    log_pi, logits = drafter.mixture_logits(h, bonus, target, x.size(1) + 1)
    log_qx = branch_log_q(upcast(logits), x, temperature, sample_drafts)
    a = prefix_log_accept(prior(log_pi, zt), log_qx, log_px, verify)
    return a.exp().sum(-1)


@torch.no_grad()
def expected_tau(drafter, model, samples, k, temperature, sample_drafts, verify, zt=1.0, chunk=2048):
    """Expected tau (bonus included), averaged over every context of held-out target samples, by the
    acceptance-length identity (expected_accepted): the cheap, low-variance measure of a
    drafter's acceptance. Exact per context; decoding averages over the positions its blocks start
    at instead of every position, so where acceptance varies along the text the two can differ by
    much, either way: in MATH.md §7's example of long easy and hard stretches this reads (k+1)^2/4k
    times a decode's mean tau (1.56 at k = 4). Decoding measures speed."""
    if not callable(getattr(drafter, 'mixture_logits', None)):
        raise BadInput(f"the exact evaluator reads a drafter's distributions from the target's state (mixture_logits: "
                       f"BPD heads, DBlast); {type(drafter).__name__} has none: measure it by decoding")
    seqs = samples.seqs
    lo, hi = samples.positions(k)
    rows = torch.arange(len(seqs), device=seqs.device).repeat_interleave(hi - lo)
    pos = torch.arange(lo, hi, device=seqs.device).repeat(len(seqs))
    total = 0.0
    for i in range(0, len(rows), chunk):
        h, bonus, x, log_px = contexts(samples, k, rows[i:i + chunk], pos[i:i + chunk])
        total += float(expected_accepted(drafter, h.to(model.lm_head.weight.dtype), bonus, model, x, log_px,
                                         temperature, sample_drafts, verify, zt).sum())
    return 1 + total / len(rows)


# ----------------------------------------------------------------------------- the drafter

class DBlastDrafter(Drafter):
    ARGS = ('k', 'K', 'd_hidden')   # what a checkpoint records to rebuild it (drafters.load_drafter)

    def __init__(self, config, k, K, d_hidden=None, sample_drafts=True, verify='mixture', zt=1.0,
                 paths_from='iid'):
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
        # inference settings, not weights: how a branch drafts (the contract's one name), and what
        # only a mixture has: what the drafts are verified against, the category temperature, and
        # how several paths per call are drawn
        self.sample_drafts, self.verify, self.zt, self.paths_from = sample_drafts, verify, zt, paths_from

    def anchor(self, h, bonus, target):
        """The anchor u from h (B, C) and the bonus (B,) (MATH.md §5) -> log pi (B, K) of the
        category prior head, and the branch states u_z (B, K, C) of the category hidden expander."""
        u = self.ln_u(self.w_u(torch.cat([h, target.transformer.wte(bonus)], dim=-1)))
        log_pi = F.log_softmax(upcast(self.w_pi(u)), dim=-1)
        u_z = u.unsqueeze(1) + self.g_proj(F.relu(self.g_fc(u))).view(-1, self.K, self.n_embd)
        return log_pi, u_z

    def mixture_logits(self, h, bonus, target, k):
        """log pi (B, K) and every branch's logits (B, K, k-1, V) for the k-1 drafts, in one pass."""
        log_pi, u_z = self.anchor(h, bonus, target)
        return log_pi, self.block(u_z, target.lm_head, k - 1)

    def log_q(self, h, bonus, target, x, temperature=1.0):
        """Training view. x (B, k-1): the block after the bonus, a sample of the target at
        `temperature` (the temperature decoding applies to q). Returns log pi' (B, K) at Z_T = 1
        (that is log pi) and log q_i(x_i | z) (B, K, k-1) of sampled branches."""
        log_pi, logits = self.mixture_logits(h, bonus, target, x.size(1) + 1)
        return prior(log_pi, 1.0), branch_log_q(upcast(logits), x, temperature, True)

    @staticmethod
    def nll(log_prior, log_qx):
        """Mixture NLL per row (MATH.md §6). K = 1: the sum of the positions' cross-entropies."""
        return -torch.logsumexp(log_prior + log_qx.sum(-1), dim=-1)

    def loss(self, h, bonus, target, x, log_px, temperature=1.0, kind='al',
             tau_threshold=0.01, nll_weight=0.0):
        """Mean loss over rows. x (B, k-1) sampled from the target at `temperature`, log_px (B, k-1)
        the target's log-probabilities of them (detached).

        kind='nll': mixture NLL. kind='al': the acceptance-length surrogate (al_surrogate) on the
        mixture's conditionals (what mixture verification of sampled branches accepts; our reading
        of DBlast's AL loss); kind='al-branch': the same on branch-conditional acceptance
        (ablation). nll_weight adds that much NLL."""
        log_prior, log_qx = self.log_q(h, bonus, target, x, temperature)
        nll = self.nll(log_prior, log_qx)
        if kind == 'nll':
            return nll.mean()
        a = prefix_log_accept(log_prior, log_qx, log_px, 'mixture' if kind == 'al' else 'branch')
        return al_surrogate(a, nll, tau_threshold).mean() + nll_weight * nll.mean()

    def meaningless(self, temperature, paths):
        """heads.Drafter.meaningless for the mixture. One path per branch is verified against its own
        branch whatever `verify` says, so verify='mixture' beside paths_from='branches' is refused
        (from Python as on the command line). Argmax paths differ only where their branches do: at
        K = 1 every path is the one branch's, i.i.d. or one per branch; at Z_T = 0 i.i.d. paths are all
        the top branch's (drawn every time), while one per branch takes the K most probable."""
        found = []
        if self.paths_from == 'branches' and self.verify != 'branch':
            found.append(('verify', self.verify, "with paths_from='branches' every path is verified against its "
                                                 "own branch; set verify='branch' with it"))
        argmax = not (temperature > 0 and self.sample_drafts)
        if paths > 1 and argmax and (self.K == 1 or (self.zt == 0 and self.paths_from != 'branches')):
            branch = 'its one branch' if self.K == 1 else 'the top branch alone (Z_T = 0)'
            found.append(('paths', paths, f"drafted by argmax from {branch} (greedy decoding, or drafts not sampled), "
                                          f"every path is the same; use one path, or sample the drafts"))
        return found

    @torch.no_grad()
    def next_log_q(self, h, bonus, target, k, temperature=0.0):
        """heads.Drafter.next_log_q for the mixture: a node's children are scored by the mixture's
        conditional at their drafted position given the node's prefix, whose posterior over the
        branches follows the prefix (MATH.md §5), so sibling subtrees get different distributions.
        From the branches' own distributions at the temperature (sample_drafts, how one path is
        drafted, plays no part), the prior at Z_T."""
        log_pi, logits = self.mixture_logits(h, bonus, target, k)
        log_prior = prior(log_pi, self.zt)                                  # (B, K) log pi'
        log_q = scores_from(logits, temperature)                            # (B, K, n, V)
        B, K, _, V = log_q.shape

        def conditional(d, prefix):          # prefix (B, M, d) -> log Q_d(. | prefix) (B, M, V)
            M = prefix.size(1)
            seen = log_q[:, None, :, :d].expand(B, M, K, d, V).gather(
                -1, prefix[:, :, None, :, None].expand(B, M, K, d, 1)).squeeze(-1).sum(-1)   # (B, M, K)
            log_w = F.log_softmax(log_prior[:, None] + seen, dim=-1)                   # posterior of z
            return torch.logsumexp(log_w[..., None] + log_q[:, None, :, d], dim=2)
        return conditional

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        """The drafter contract (heads.Drafter). z ~ pi', then branch z drafts the k-1 tokens from
        q~(. | z): sampled from it, or its argmax path. All K branches come out of the one pass."""
        drafts, Q = self.draft_paths(h, bonus, target, k, 1, temperature, generator)
        return drafts[:, 0], None if Q is None else Q[:, 0]

    @torch.no_grad()
    def draft_paths(self, h, bonus, target, k, paths, temperature=0.0, generator=None):
        """`paths` paths from one pass of the mixture (heads.Drafter.draft_paths), as paths_from says:

        'iid'       i.i.d. samples of the proposal: for each path z ~ pi', then branch z's drafts;
                    each verified against the mixture's conditionals given its own drafts (or its
                    branch's q~ under verify='branch')
        'branches'  one path per branch, the branches in the order of a draw without replacement
                    from pi' (branch_order; past K they come round again); each verified against
                    its own branch's q~ (given its branch, a path's tokens are independent)"""
        log_pi, logits = self.mixture_logits(h, bonus, target, k)
        B, K, n, V = logits.shape
        log_prior = prior(log_pi, self.zt)                                  # (B, K) log pi'
        if self.paths_from == 'branches':
            z = branch_order(log_pi, self.zt, generator)[:, torch.arange(paths, device=h.device) % K]
        else:
            z = sample(log_prior.exp()[:, None].expand(B, paths, K), generator)   # (B, paths)
        sampled = self.sample_drafts and temperature > 0
        log_q = branch_log_probs(upcast(logits), temperature, sampled)      # (B, K, n, V) log q~
        q_z = log_q.gather(1, z[:, :, None, None].expand(B, paths, n, V)).exp()   # (B, paths, n, V)
        drafts = sample(q_z, generator) if sampled else q_z.argmax(-1)      # (B, paths, n)
        # Q of a path is its branch's q~ when verified against its branch, or when the mixture has
        # one branch to weigh (K = 1, or Z_T = 0: the posterior stays on the argmax branch)
        own_branch = self.verify == 'branch' or self.paths_from == 'branches' or K == 1 or self.zt == 0
        if not sampled and (temperature == 0.0 or own_branch):
            return drafts, None       # a point mass: each path is its branch's argmax path
        if own_branch:
            return drafts, q_z        # each path's own branch
        rows = lambda t: t.repeat_interleave(paths, 0)                      # noqa: E731  one row per path
        Q = conditionals(rows(log_prior), rows(log_q), drafts.flatten(0, 1))   # the mixture's Q_i
        return drafts, Q.view(B, paths, n, V)
