"""Exercise 7's reference: a drafter in the style of Medusa's heads (independent per-offset heads on
the target's last state, here with the bonus token's embedding too), and plausible wrong answers
its checks must catch."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from heads import Drafter
from model import LayerNorm, sample, tempered, upcast


class MyDrafter(Drafter):
    """u = W [h ; E(bonus)]; head i: z_i = u + MLP_i(u); logits_i = lm_head(ln(z_i)), the target's
    own unembedding. The heads are independent given (h, bonus): Q_i = q_i."""

    def __init__(self, config, k, sample_drafts=True):
        super().__init__()
        C = config.n_embd
        self.k, self.sample_drafts = k, sample_drafts
        self.w_in = nn.Linear(2 * C, C)
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(C, 2 * C), nn.GELU(), nn.Linear(2 * C, C))
                                   for _ in range(k - 1))
        self.ln = LayerNorm(C, bias=True)

    def logits(self, h, bonus, target, n):
        """The first n heads' logits (N, n, V)."""
        u = self.w_in(torch.cat([h, target.transformer.wte(bonus)], -1))
        return self.heads_logits(u, self.heads[:n], target)

    def heads_logits(self, u, heads, target):
        """The logits (N, len(heads), V) of `heads` on u (N, C)."""
        z = torch.stack([u + head(u) for head in heads], 1)                   # (N, n, C)
        return upcast(target.lm_head(self.ln(z)))

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        logits = self.logits(h, bonus, target, k - 1)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        q = F.softmax(tempered(logits, temperature), -1)
        return sample(q, generator), q

    def loss(self, h, bonus, target, x, temperature=1.0):
        logits = self.logits(h, bonus, target, x.size(1))
        return F.cross_entropy(tempered(logits, temperature).flatten(0, 1), x.flatten())


class MisTempered(MyDrafter):
    """Drafts sampled at T, but the Q handed to the verifier is the softmax at T = 1."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        return drafts, None if q is None else F.softmax(self.logits(h, bonus, target, k - 1), -1)


class Unnormalised(MyDrafter):
    """Q left as exp(logits / T): not a distribution."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        return drafts, None if q is None else tempered(self.logits(h, bonus, target, k - 1), temperature).exp()


class DrawsByMultinomial(MyDrafter):
    """Draws with torch.multinomial, from `generator`: right on a CPU, a host sync on a GPU."""
    from_generator = True

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        logits = self.logits(h, bonus, target, k - 1)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        q = F.softmax(tempered(logits, temperature), -1)
        draws = torch.multinomial(q.flatten(0, 1), 1, generator=generator if self.from_generator else None)
        return draws.view(q.shape[:-1]), q


class GlobalRandomness(DrawsByMultinomial):
    """Draws with torch.multinomial from the global RNG instead of `generator`."""
    from_generator = False


class DrawsAtOne(MyDrafter):
    """Drafts sampled at T = 1, while the Q handed to the verifier is the softmax at T."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        logits = self.logits(h, bonus, target, k - 1)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        return sample(F.softmax(logits, -1), generator), F.softmax(tempered(logits, temperature), -1)


class TemperedTwice(MyDrafter):
    """The logits come out of a helper already over T, and draft tempers them again: drafts and Q
    agree (lossless), but at T^2, not at the T the loss trained."""

    def tempered_logits(self, h, bonus, target, n, temperature):
        return tempered(self.logits(h, bonus, target, n), temperature)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        if temperature == 0.0 or not self.sample_drafts:
            return self.logits(h, bonus, target, k - 1).argmax(-1), None
        q = F.softmax(tempered(self.tempered_logits(h, bonus, target, k - 1, temperature), temperature), -1)
        return sample(q, generator), q


class LossAtOne(MyDrafter):
    """The loss leaves the temperature out: trained at T = 1 on samples at T, it drafts at T."""

    def loss(self, h, bonus, target, x, temperature=1.0):
        logits = self.logits(h, bonus, target, x.size(1))
        return F.cross_entropy(logits.flatten(0, 1), x.flatten())


class ClampedNotRenormalised(MyDrafter):
    """Q clamped away from 0 (for a log later, say) and not renormalised: its rows sum above 1."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        return drafts, None if q is None else q.clamp(min=1e-6)


class KeepsTheUnembedding(MyDrafter):
    """Keeps the target's lm_head as a submodule of its own, taken at the first call: the target's
    (tied) embedding is then one of the drafter's parameters, trained by its optimizer and saved in
    its state."""

    def logits(self, h, bonus, target, n):
        self.unembed = target.lm_head
        return super().logits(h, bonus, target, n)


class SamplesAtZero(MyDrafter):
    """Draws its drafts whenever sample_drafts is set, at T = 0 too: logits / 0 is inf and NaN there,
    the drafts one fixed token and Q NaN. Greedy output stays exact (greedy verification compares
    argmaxes), so nothing but tau shows it: it falls to 1."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        logits = self.logits(h, bonus, target, k - 1)
        if not self.sample_drafts:
            return logits.argmax(-1), None
        q = F.softmax(tempered(logits, temperature), -1)
        return sample(q, generator), q


class ReadsTheText(MyDrafter):
    """Sets reads_text, the door of drafters.py's kind (a draft model, prompt lookup): decode would
    hand it the text, which this drafter never reads, and the exercise's checks call it without."""
    reads_text = True


class DrawsOffTheDevice(MyDrafter):
    """Draws by inverse CDF written out, its uniforms made without the device of h: right on a CPU,
    an error on a GPU."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        if q is None:
            return drafts, q
        cdf = q.cumsum(-1)
        u = torch.rand(q.shape[:-1] + (1,), generator=generator, dtype=q.dtype)     # no device=
        return torch.searchsorted(cdf, u * cdf[..., -1:]).clamp(max=q.size(-1) - 1).squeeze(-1), q


class TrainedOneTokenOn(MyDrafter):
    """Head i trained on the token after its own (x[:, i + 1]; the last head on the last token):
    draft proposes positions its loss never trained."""

    def loss(self, h, bonus, target, x, temperature=1.0):
        logits = self.logits(h, bonus, target, x.size(1))
        y = torch.cat([x[:, 1:], x[:, -1:]], 1)
        return F.cross_entropy(tempered(logits, temperature).flatten(0, 1), y.flatten())


class Recurrent(Drafter):
    """Another right answer, with positions that depend on each other: a recurrent head whose state
    reads each draft before drafting the next (one loop over the k-1 drafted positions, which the
    statement allows for such a drafter). Q_i is the conditional given the drafts before it, which is
    what draft i was drawn from."""

    def __init__(self, config, k, sample_drafts=True):
        super().__init__()
        C = config.n_embd
        self.k, self.sample_drafts = k, sample_drafts
        self.w_in = nn.Linear(2 * C, C)
        self.cell = nn.Linear(2 * C, C)
        self.ln = LayerNorm(C, bias=True)

    def start(self, h, bonus, target):
        return torch.tanh(self.w_in(torch.cat([h, target.transformer.wte(bonus)], -1)))

    def advance(self, s, token, target):
        return torch.tanh(self.cell(torch.cat([s, target.transformer.wte(token)], -1)))

    def logits_at(self, s, target):
        return upcast(target.lm_head(self.ln(s)))

    def teacher_forced(self, h, bonus, target, x):
        """The logits (N, n, V) of every position given the tokens x (N, n) before it."""
        s, out = self.start(h, bonus, target), []
        for i in range(x.size(1)):
            out.append(self.logits_at(s, target))
            s = self.advance(s, x[:, i], target)
        return torch.stack(out, 1)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        sampled = self.sample_drafts and temperature > 0
        s, drafts, qs = self.start(h, bonus, target), [], []
        for _ in range(k - 1):
            logits = self.logits_at(s, target)
            q = F.softmax(tempered(logits, temperature), -1) if sampled else None
            d = sample(q, generator) if sampled else logits.argmax(-1)
            drafts.append(d)
            qs.append(q)
            s = self.advance(s, d, target)
        return torch.stack(drafts, 1), torch.stack(qs, 1) if sampled else None

    def loss(self, h, bonus, target, x, temperature=1.0):
        logits = self.teacher_forced(h, bonus, target, x)
        return F.cross_entropy(tempered(logits, temperature).flatten(0, 1), x.flatten())


class RolloutMismatch(Recurrent):
    """The state is advanced by each position's argmax while the drafts are sampled, and Q is then
    recomputed by teacher forcing on the drafts: Q_i is conditioned on drafts that draft i was not
    drawn after."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        if not (self.sample_drafts and temperature > 0):
            return super().draft(h, bonus, target, k, temperature, generator)
        s, drafts = self.start(h, bonus, target), []
        for _ in range(k - 1):
            logits = self.logits_at(s, target)
            drafts.append(sample(F.softmax(tempered(logits, temperature), -1), generator))
            s = self.advance(s, logits.argmax(-1), target)                # not the draft
        drafts = torch.stack(drafts, 1)
        return drafts, F.softmax(tempered(self.teacher_forced(h, bonus, target, drafts), temperature), -1)


class TemperedTwiceAfterTheFirst(TemperedTwice):
    """The temperature applied twice at the drafts after the first only (the first, as the loss
    trains it): lossless, and the first draft's scale is right."""

    def tempered_logits(self, h, bonus, target, n, temperature):
        logits = self.logits(h, bonus, target, n)
        return torch.cat([logits[:, :1], tempered(logits[:, 1:], temperature)], 1)


class LastHeads(MyDrafter):
    """At a k below drafter.k, the last k-1 heads draft where the first k-1 are meant."""

    def logits(self, h, bonus, target, n):
        u = self.w_in(torch.cat([h, target.transformer.wte(bonus)], -1))
        return self.heads_logits(u, self.heads[len(self.heads) - n:], target)


class FirstHeadTrained(MyDrafter):
    """The loss trains the first head only: tau, which counts the first draft most, rises, while the
    later drafts stay as untrained as they started."""

    def loss(self, h, bonus, target, x, temperature=1.0):
        logits = self.logits(h, bonus, target, x.size(1))
        return F.cross_entropy(tempered(logits[:, 0], temperature), x[:, 0])


class TemperatureNowhere(MyDrafter):
    """The temperature left out of draft and loss alike: drafts and Q agree (lossless), and the loss
    trains what draft proposes, but at every T the drafter proposes its T = 1 distribution."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        return super().draft(h, bonus, target, k, temperature and 1.0, generator)

    def loss(self, h, bonus, target, x, temperature=1.0):
        return super().loss(h, bonus, target, x, 1.0)


class ThawsTheTarget(MyDrafter):
    """The loss turns the target's gradients on (to reach its embedding, say): a backward then fills
    the target's .grad, and a joint optimizer would train it."""

    def loss(self, h, bonus, target, x, temperature=1.0):
        target.requires_grad_(True)
        return super().loss(h, bonus, target, x, temperature)


class RowByRow(MyDrafter):
    """Drafts one row at a time: right values, and as many launches a step as rows."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        rows = [super(RowByRow, self).draft(h[i:i + 1], bonus[i:i + 1], target, k, temperature, generator)
                for i in range(h.size(0))]
        drafts, Q = zip(*rows)
        return torch.cat(drafts), None if Q[0] is None else torch.cat(Q)


class PriorMixture(MyDrafter):
    """Two branches of heads (the reference's, each on its own input map) and a prior over them: a block
    is drawn by drawing a branch, then its drafts. Q_i weighs the branches by the prior, not by
    their posterior given the drafts before i: after the first draft, not what draft i was drawn
    from (lossy)."""

    def __init__(self, config, k, sample_drafts=True):
        super().__init__(config, k, sample_drafts)
        self.w_in_2 = nn.Linear(2 * config.n_embd, config.n_embd)
        self.prior = nn.Parameter(torch.zeros(2))                   # logits: the same prior in every context

    def branches(self, h, bonus, target, n):
        """The prior's log-weights (N, 2) and each branch's logits (N, 2, n, V)."""
        hb = torch.cat([h, target.transformer.wte(bonus)], -1)
        logits = [self.heads_logits(u, self.heads[:n], target) for u in (self.w_in(hb), self.w_in_2(hb))]
        return F.log_softmax(upcast(self.prior), -1).expand(h.size(0), 2), torch.stack(logits, 1)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        log_prior, logits = self.branches(h, bonus, target, k - 1)
        if temperature == 0.0 or not self.sample_drafts:
            return logits[torch.arange(h.size(0), device=h.device), log_prior.argmax(-1)].argmax(-1), None
        q = F.softmax(tempered(logits, temperature), -1)                          # (N, 2, n, V)
        z = sample(log_prior.exp(), generator)                                    # (N,) the branch
        drafts = sample(q[torch.arange(h.size(0), device=h.device), z], generator)
        return drafts, (log_prior.exp()[:, :, None, None] * q).sum(1)            # the prior's, at every i

    def loss(self, h, bonus, target, x, temperature=1.0):
        log_prior, logits = self.branches(h, bonus, target, x.size(1))
        log_q = F.log_softmax(tempered(logits, temperature), -1)
        log_qx = log_q.gather(-1, x[:, None, :, None].expand(-1, 2, -1, 1)).squeeze(-1).sum(-1)   # (N, 2)
        return -torch.logsumexp(log_prior + log_qx, -1).mean()


class LastHeadsWhenSampling(MyDrafter):
    """Greedy drafts from the first k-1 heads, sampled ones from the last k-1."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        if temperature == 0.0 or not self.sample_drafts:
            return super().draft(h, bonus, target, k, temperature, generator)
        u = self.w_in(torch.cat([h, target.transformer.wte(bonus)], -1))
        q = F.softmax(tempered(self.heads_logits(u, self.heads[len(self.heads) - (k - 1):], target), temperature), -1)
        return sample(q, generator), q


class AntitheticRows(MyDrafter):
    """Rows drawn in pairs from one uniform, u and 1 - u: each row's law is right, the rows are not
    independent (several paths of a call are rows)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        if temperature == 0.0 or not self.sample_drafts:
            return super().draft(h, bonus, target, k, temperature, generator)
        q = F.softmax(tempered(self.logits(h, bonus, target, k - 1), temperature), -1)    # (N, k-1, V)
        N = q.size(0)
        u = torch.rand((N + 1) // 2, k - 1, 1, generator=generator, dtype=q.dtype, device=q.device)
        u = torch.cat([u, 1 - u], 1).view(-1, k - 1, 1)[:N]                                # rows 2i, 2i+1
        cdf = q.cumsum(-1)
        return torch.searchsorted(cdf, u * cdf[..., -1:]).clamp(max=q.size(-1) - 1).squeeze(-1), q


class StaleWeights(MyDrafter):
    """The heads copied once, at the first draft, and kept (a plain list, no submodule): a training
    step no longer reaches what draft reads."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        if 'kept' not in self.__dict__:
            self.__dict__['kept'] = [copy.deepcopy(head) for head in self.heads]
        u = self.w_in(torch.cat([h, target.transformer.wte(bonus)], -1))
        logits = self.heads_logits(u, self.kept[:k - 1], target)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        q = F.softmax(tempered(logits, temperature), -1)
        return sample(q, generator), q


class TemperatureClamped(MyDrafter):
    """The temperature clamped to [0.5, 2] in draft (a guard against extremes)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        T = temperature if temperature == 0.0 else min(max(temperature, 0.5), 2.0)
        return super().draft(h, bonus, target, k, T, generator)


class LossAtLeastOne(MyDrafter):
    """The loss at max(T, 1) (a guard against sharp targets): right at T >= 1, too flat a target below."""

    def loss(self, h, bonus, target, x, temperature=1.0):
        return super().loss(h, bonus, target, x, max(temperature, 1.0))


class NotUpcast(MyDrafter):
    """The logits left as lm_head returns them: under bf16 autocast on a CPU (generate.py --dtype
    bfloat16) the softmax, Q and the draw are then bfloat16: Q's rows sum to 1 within about 2^-8, and
    the drafts' law is about 0.01 in total variation from Q. Right in float32 and float64."""

    def heads_logits(self, u, heads, target):
        return target.lm_head(self.ln(torch.stack([u + head(u) for head in heads], 1)))


class UpcastAfterSoftmax(NotUpcast):
    """Q upcast after a softmax of the bfloat16 logits: float32, but its rows sum to 1 within about
    2^-8 only (the draw normalises by their total, the verifier takes Q as it is)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        logits = self.logits(h, bonus, target, k - 1)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        q = upcast(F.softmax(tempered(logits, temperature), -1))
        return sample(q, generator), q


class BFloat16Noise(NotUpcast):
    """Gumbel-max draws whose uniforms are made in the logits' dtype (bfloat16 under autocast), while
    Q is the softmax of the upcast logits: the draws' law is not Q."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        logits = self.logits(h, bonus, target, k - 1)
        if temperature == 0.0 or not self.sample_drafts:
            return logits.argmax(-1), None
        t = tempered(logits, temperature)
        u = torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype)
        return (t - (-u.log()).log()).argmax(-1), F.softmax(tempered(upcast(logits), temperature), -1)


class OwnGeneratorWhenNone(MyDrafter):
    """A generator made inside draft when none is given, at its default seed: every call draws the
    same numbers, so a step's drafts repeat the last step's random choices (lossy)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        generator = torch.Generator(device=h.device) if generator is None else generator
        return super().draft(h, bonus, target, k, temperature, generator)


class CpuGeneratorWhenNone(MyDrafter):
    """torch.default_generator in place of generator=None: the CPU's, which a draw on a GPU refuses
    (and generator=None is what every compiled step is given)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        generator = torch.default_generator if generator is None else generator
        return super().draft(h, bonus, target, k, temperature, generator)


class SeedReadBack(MyDrafter):
    """Under sampling without a generator, one of its own seeded from the global RNG by .item(): it
    draws anew every call, and reads a number back from the device (a host sync) to do it."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        if generator is None and temperature > 0 and self.sample_drafts:
            seed = torch.randint(2 ** 62, (1,), device=h.device).item()
            generator = torch.Generator(device=h.device).manual_seed(seed)
        return super().draft(h, bonus, target, k, temperature, generator)


class AddsIntoH(MyDrafter):
    """The bonus's embedding added into h in place (h += ...): the caller's h changes, and with
    several drafters in one call (drafters.MixedPaths) the next one drafts from the wrong state."""

    def logits(self, h, bonus, target, n):
        h += target.transformer.wte(bonus).to(h.dtype)
        return self.heads_logits(self.w_in(torch.cat([h, h], -1)), self.heads[:n], target)


class EyeForPointMasses(MyDrafter):
    """Argmax drafts returned with their one-hot as rows of torch.eye(V): right values, and a V x V
    table a call (10 GB in float32 on GPT-2's vocabulary)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        if q is None:
            q = torch.eye(target.lm_head.out_features, dtype=h.dtype, device=h.device)[drafts]
        return drafts, q


class KeepsEveryQ(MyDrafter):
    """Keeps every Q it proposed (for statistics, say) in a list: memory that grows with every step
    decoded, by (rows, k-1, V) a step on a real vocabulary."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        self.__dict__.setdefault('proposed', []).append(drafts if q is None else q)
        return drafts, q


class AttendsAcrossRows(MyDrafter):
    """Self-attention over one token per offset (the anchor u plus a learnt query), by an
    nn.MultiheadAttention left at batch_first=False and given (N, n, C): it reads the rows as the
    sequence and attends across them, so each row's drafts depend on the other rows of the call
    (other prompts, other paths), and one prompt drafted alone gets another proposal than in the
    batches it trained on. Lossless (Q is what the drafts came from), still wrong."""

    def __init__(self, config, k, sample_drafts=True):
        super().__init__(config, k, sample_drafts)
        C = config.n_embd
        self.queries = nn.Parameter(torch.randn(k - 1, C) * 0.5)
        self.attn = nn.MultiheadAttention(C, 2)                           # batch_first=False

    def logits(self, h, bonus, target, n):
        u = self.w_in(torch.cat([h, target.transformer.wte(bonus)], -1))
        x = u[:, None] + self.queries[:n].to(u.dtype)                     # (N, n, C), read as (L=N, B=n, C)
        z = x + self.attn(x, x, x, need_weights=False)[0]
        return self.heads_logits(z.flatten(0, 1), self.heads[:1], target).view(*x.shape[:2], -1)


class DefaultDtypeInInit(MyDrafter):
    """torch.set_default_dtype(torch.float64) in __init__, "for precision": its weights come out in
    float64 beside a float32 target, and every tensor and module the process makes after it (the
    caller's) is float64 too; a setting of the whole process, left changed."""

    def __init__(self, config, k, sample_drafts=True):
        torch.set_default_dtype(torch.float64)
        super().__init__(config, k, sample_drafts)


class LazyBufferOnCpu(MyDrafter):
    """A per-offset index buffer registered at the first call, made without device=: a decode moves the
    drafter (.to(device)) before that call, so on a GPU the buffer lands on the CPU beside CUDA
    inputs (a drafter checked on a CPU, then moved, hides it)."""

    def heads_logits(self, u, heads, target):
        if not hasattr(self, 'order'):
            self.register_buffer('order', torch.arange(self.k - 1), persistent=False)
        return super().heads_logits(u, heads, target).index_select(1, self.order[:len(heads)])


class ReturnsItsBuffer(MyDrafter):
    """Q written into a buffer kept on the drafter (made again only when its shape, dtype or device
    changes) and returned: the next call overwrites the Q a caller still holds (drafters.MixedPaths
    holds one path's while it drafts the next, with the same drafter for two of its paths)."""

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        drafts, q = super().draft(h, bonus, target, k, temperature, generator)
        if q is None:
            return drafts, None
        buf = getattr(self, '_q', None)
        if buf is None or buf.shape != q.shape or buf.dtype != q.dtype or buf.device != q.device:
            self._q = buf = torch.empty_like(q)
        return drafts, buf.copy_(q)


CONTROLS = {
    'Q at temperature 1 while drafting at T': dict(MyDrafter=MisTempered),
    'Q not normalised': dict(MyDrafter=Unnormalised),
    'Q clamped at 1e-6 and not renormalised': dict(MyDrafter=ClampedNotRenormalised),
    'draws from the global RNG': dict(MyDrafter=GlobalRandomness),
    'drafts drawn at T = 1 while Q is at T': dict(MyDrafter=DrawsAtOne),
    'a recurrent Q from another rollout than the drafts': dict(MyDrafter=RolloutMismatch),
    "keeps the target's lm_head as its own submodule": dict(MyDrafter=KeepsTheUnembedding),
    'the temperature applied twice (lossless, at T^2)': dict(MyDrafter=TemperedTwice),
    'the loss without the temperature (trained at T = 1)': dict(MyDrafter=LossAtOne),
    'samples its drafts at T = 0': dict(MyDrafter=SamplesAtZero),
    'draws made without the device of h': dict(MyDrafter=DrawsOffTheDevice),
    'sets reads_text, drafting from the target\'s state': dict(MyDrafter=ReadsTheText),
    "each head trained on the next head's token": dict(MyDrafter=TrainedOneTokenOn),
    'the last heads drafting at a shorter k': dict(MyDrafter=LastHeads),
    'the temperature applied twice after the first draft': dict(MyDrafter=TemperedTwiceAfterTheFirst),
    'draws by torch.multinomial (a host sync on a GPU)': dict(MyDrafter=DrawsByMultinomial),
    'the loss trains the first head only': dict(MyDrafter=FirstHeadTrained),
    'the temperature left out of draft and loss alike': dict(MyDrafter=TemperatureNowhere),
    "the loss turns the target's gradients on": dict(MyDrafter=ThawsTheTarget),
    'drafts one row at a time': dict(MyDrafter=RowByRow),
    "a mixture's Q weighed by the prior, not the posterior": dict(MyDrafter=PriorMixture),
    'the last heads under sampling only, at a shorter k': dict(MyDrafter=LastHeadsWhenSampling),
    'rows drawn in pairs from one uniform (u and 1 - u)': dict(MyDrafter=AntitheticRows),
    'heads copied at the first draft and kept (stale after training)': dict(MyDrafter=StaleWeights),
    'the temperature clamped to [0.5, 2] in draft': dict(MyDrafter=TemperatureClamped),
    'the loss at max(T, 1)': dict(MyDrafter=LossAtLeastOne),
    'logits not upcast: Q in bfloat16 under autocast': dict(MyDrafter=NotUpcast),
    'Q upcast after a bfloat16 softmax': dict(MyDrafter=UpcastAfterSoftmax),
    'Gumbel noise drawn in bfloat16 under autocast': dict(MyDrafter=BFloat16Noise),
    'a generator of its own when none is given': dict(MyDrafter=OwnGeneratorWhenNone),
    "torch.default_generator (the CPU's) when none is given": dict(MyDrafter=CpuGeneratorWhenNone),
    'a host sync without a generator (a seed read back)': dict(MyDrafter=SeedReadBack),
    "the bonus's embedding added into h in place": dict(MyDrafter=AddsIntoH),
    'point masses as rows of torch.eye(V) (V x V on a real vocabulary)': dict(MyDrafter=EyeForPointMasses),
    'every Q kept in a list (memory that grows with the steps)': dict(MyDrafter=KeepsEveryQ),
    'an attention across the rows (nn.MultiheadAttention left batch_first=False)': dict(MyDrafter=AttendsAcrossRows),
    'torch.set_default_dtype(torch.float64) in __init__ (a setting of the whole process, left changed)':
        dict(MyDrafter=DefaultDtypeInInit),
    'a buffer registered at the first call without device= (on the CPU beside a moved drafter)':
        dict(MyDrafter=LazyBufferOnCpu),
    'Q written into a buffer the drafter keeps, and returned (the next call overwrites it)':
        dict(MyDrafter=ReturnsItsBuffer),
}
