"""Exercise 2's reference is the project's own verification.verify_sampled; these are the plausible wrong
answers its checks must catch."""
import time

import torch
import torch.nn.functional as F

from model import sample, tempered
from verification import accept_prefix, accept_sampled, residual, verify_sampled


def residual_without_Q(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    return accept_prefix(ok, sample(p, generator))                    # the bonus from p, not p - Q


def temperature_on_the_test_only(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    p1 = F.softmax(logits, -1)                                          # the bonus at T = 1
    weights = torch.cat([residual(p1[:, :-1], Q, drafts), p1[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def counts_past_the_first_rejection(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    n_acc = ok.sum(-1)
    return ok, n_acc, sample(weights, generator).gather(1, n_acc[:, None]).squeeze(1)


def ratio_upside_down(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    p_d = p[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = 1.0 if Q is None else Q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ok = torch.rand(p_d.shape, generator=generator, dtype=p.dtype) * p_d < q_d   # min(1, Q/p)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def coins_from_the_global_rng(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    p_d = p[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = 1.0 if Q is None else Q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ok = torch.rand_like(p_d) * q_d < p_d                               # the right law, not `generator`'s
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def bonus_from_the_global_rng(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights))                          # generator forgotten here


def coins_in(dtype):
    """The coins drawn in a coarse dtype: bfloat16's uniforms are 2^-8 apart, float16's 2^-11."""
    def verify_sampled(logits, Q, drafts, temperature, generator=None):
        p = F.softmax(tempered(logits, temperature), -1)
        p_d = p[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = 1.0 if Q is None else Q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        coin = torch.rand(p_d.shape, generator=generator, dtype=dtype, device=p.device).to(p.dtype)
        weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
        return accept_prefix(coin * q_d < p_d, sample(weights, generator))
    return verify_sampled


def residual_falling_back(fallback):
    """verify_sampled with the residual's fallback to P written as fallback(r, p, logits): r the
    residual max(0, P - Q) and p the target's P (B, k-1, V) at the drafted positions, logits
    (B, k, V). The right one is torch.where(r.sum(-1, keepdim=True) > 0, r, p)."""
    def verify_sampled(logits, Q, drafts, temperature, generator=None):
        p = F.softmax(tempered(logits, temperature), -1)
        ok = accept_sampled(p[:, :-1], Q, drafts, generator)
        r = p[:, :-1].scatter(-1, drafts.unsqueeze(-1), 0.0) if Q is None else (p[:, :-1] - Q).clamp(min=0.0)
        return accept_prefix(ok, sample(torch.cat([fallback(r, p[:, :-1], logits), p[:, -1:]], 1), generator))
    return verify_sampled


# an all-zero row stays all zero
residual_without_its_fallback = residual_falling_back(lambda r, p, logits: r)
# one verdict for every row at once
fallback_over_the_whole_batch = residual_falling_back(lambda r, p, logits: torch.where(r.sum() > 0, r, p))
# one verdict for a row's positions
fallback_over_the_whole_block = residual_falling_back(
    lambda r, p, logits: torch.where(r.sum((-2, -1), keepdim=True) > 0, r, p))
# a small residual taken for none
fallback_by_a_tolerance = residual_falling_back(lambda r, p, logits: torch.where(r.sum(-1, keepdim=True) > 0.05, r, p))
# P at T = 1, not at T
fallback_to_p_at_one = residual_falling_back(
    lambda r, p, logits: torch.where(r.sum(-1, keepdim=True) > 0, r, F.softmax(logits[:, :-1], -1)))
# one verdict for a row's positions, the other way round: any position's zero residual sends all to P
fallback_if_any_position_is_zero = residual_falling_back(
    lambda r, p, logits: torch.where((r.sum(-1) == 0).any(-1)[:, None, None], p, r))
def own_generator_when_none(logits, Q, drafts, temperature, generator=None):
    if generator is None:
        generator = torch.Generator(device=logits.device)              # never seeded: the same draws each call
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def cpu_generator_when_none(logits, Q, drafts, temperature, generator=None):
    return verify_sampled(logits, Q, drafts, temperature,                 # the CPU's: a draw on a GPU refuses it
                          torch.default_generator if generator is None else generator)


def every_dimension_squeezed(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    accepted, n_acc, _ = accept_prefix(ok, weights[..., 0])
    bonus = sample(weights, generator).gather(1, n_acc[:, None]).squeeze()   # one row: shape (), not (1,)
    return accepted, n_acc, bonus


def coins_off_the_logits_device(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    p_d = p[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = 1.0 if Q is None else Q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    coin = torch.rand(p_d.shape, generator=generator, dtype=p.dtype)  # no device=: the CPU's, wherever p is
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(coin * q_d < p_d, sample(weights, generator))


def bonus_by_multinomial(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    bonus = torch.multinomial(weights.flatten(0, 1), 1, generator=generator).view(weights.shape[:-1])   # syncs
    return accept_prefix(ok, bonus)


def read_by(product):
    """P(d) and Q(d) read as product(x, one_hot): a matrix product, which bfloat16 autocast runs in
    bfloat16 (generate.py --dtype bfloat16), so both land on its grid, 3 significant digits."""
    def verify_sampled(logits, Q, drafts, temperature, generator=None):
        p = F.softmax(tempered(logits, temperature), -1)
        one_hot = F.one_hot(drafts, p.size(-1)).to(p.dtype)
        p_d = product(p[:, :-1], one_hot)
        q_d = 1.0 if Q is None else product(Q, one_hot)
        coin = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p.dtype)
        weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
        return accept_prefix(coin * q_d < p_d, sample(weights, generator))
    return verify_sampled


def einsum(x, one_hot):
    return torch.einsum('bkv,bkv->bk', x, one_hot)


def einsum_with_cuda_autocast_off(x, one_hot):
    with torch.autocast('cuda', enabled=False):                        # the CPU's autocast stays on
        return einsum(x, one_hot)


def softmax_normalised_by_a_matmul(logits, Q, drafts, temperature, generator=None):
    e = tempered(logits, temperature).exp()
    p = e / (e @ torch.ones(e.size(-1), 1, dtype=e.dtype, device=e.device))   # bfloat16 under autocast
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def inverse_cdf(cdf_and_total):
    """The bonus drawn by an inverse CDF of u * total, where cdf_and_total(w) gives the cumulative sums
    of the weights w and their total, each by a matrix product (bfloat16 under autocast)."""
    def verify_sampled(logits, Q, drafts, temperature, generator=None):
        p = F.softmax(tempered(logits, temperature), -1)
        ok = accept_sampled(p[:, :-1], Q, drafts, generator)
        w = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
        cdf, total = cdf_and_total(w)
        u = torch.rand(w.shape[:-1] + (1,), generator=generator, device=p.device, dtype=p.dtype)
        bonus = torch.searchsorted(cdf.to(u.dtype), u * total.to(u.dtype), right=True)
        return accept_prefix(ok, bonus.clamp_(max=w.size(-1) - 1).squeeze(-1))
    return verify_sampled


def cdf_by_a_triangular_matmul(w):
    cdf = w @ torch.ones(w.size(-1), w.size(-1), dtype=w.dtype, device=w.device).triu()
    return cdf, cdf[..., -1:]


def normalised_by_a_matmul(w):
    w = w / (w @ torch.ones(w.size(-1), 1, dtype=w.dtype, device=w.device))   # 1 +- 0.4% under autocast
    return w.cumsum(-1), torch.ones_like(w[..., :1])                           # its total taken as 1


def cdf_by_a_vocabulary_square_matmul(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    w = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    V = w.size(-1)
    upper = torch.ones(V, V, device=w.device, dtype=w.dtype).triu()      # (V, V): 2.5e9 elements at V = 50,304
    with torch.autocast(w.device.type, enabled=False):                   # exact, in float32 or wider
        cdf = w @ upper
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=w.device, dtype=w.dtype) * cdf[..., -1:]
    return accept_prefix(ok, torch.searchsorted(cdf, u, right=True).clamp(max=V - 1).squeeze(-1))


verdicts_seen = []


def keeps_every_calls_verdicts(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    ok = accept_sampled(p[:, :-1], Q, drafts, generator)
    verdicts_seen.append(ok)                       # "for the acceptance rate": grows with the tokens decoded
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def eps_added_to_q(logits, Q, drafts, temperature, generator=None):
    p = F.softmax(tempered(logits, temperature), -1)
    p_d = p[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = 1.0 if Q is None else Q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    coin = torch.rand(p_d.shape, generator=generator, device=p.device, dtype=p.dtype)
    ok = coin < p_d / (q_d + 1e-8)                     # "no division by zero": a draft of small Q(d) is refused
    weights = torch.cat([residual(p[:, :-1], Q, drafts), p[:, -1:]], 1)
    return accept_prefix(ok, sample(weights, generator))


def seeds_a_generator_from_a_read_back_draw_when_none(logits, Q, drafts, temperature, generator=None):
    if generator is None:                               # int() of a draw: a host sync at every compiled step
        seed = int(torch.randint(2 ** 62, (), device=logits.device))
        generator = torch.Generator(device=logits.device).manual_seed(seed)
    return verify_sampled(logits, Q, drafts, temperature, generator)


def seeds_a_generator_from_the_clock_when_none(logits, Q, drafts, temperature, generator=None):
    if generator is None:                               # the caller's seed no longer decides the draws
        generator = torch.Generator(device=logits.device).manual_seed(time.time_ns())
    return verify_sampled(logits, Q, drafts, temperature, generator)


def reseeds_the_global_rng_from_the_generator(logits, Q, drafts, temperature, generator=None):
    if generator is not None:                           # "so that the drafter matches": the caller's RNG reseeded
        torch.manual_seed(generator.initial_seed())
    return verify_sampled(logits, Q, drafts, temperature, generator)


def switches_deterministic_algorithms_on(logits, Q, drafts, temperature, generator=None):
    torch.use_deterministic_algorithms(True)            # process-wide, and left on
    return verify_sampled(logits, Q, drafts, temperature, generator)


def draws_inside_fork_rng(logits, Q, drafts, temperature, generator=None):
    with torch.random.fork_rng(devices=[]):             # "leave the global RNG alone": put back after the call,
        return verify_sampled(logits, Q, drafts, temperature, generator)   # so every call draws the same numbers


accepted_so_far = torch.zeros((), dtype=torch.long)     # made at import, on the CPU


def counts_into_a_cpu_tensor_made_at_import(logits, Q, drafts, temperature, generator=None):
    accepted, n_acc, bonus = verify_sampled(logits, Q, drafts, temperature, generator)
    accepted_so_far.add_(n_acc.sum())                   # on a GPU: a CPU tensor written from a CUDA one, refused
    return accepted, n_acc, bonus


CONTROLS = {
    'residual without subtracting Q': dict(verify_sampled=residual_without_Q),
    'temperature on the acceptance test only': dict(verify_sampled=temperature_on_the_test_only),
    'counts past the first rejection': dict(verify_sampled=counts_past_the_first_rejection),
    'acceptance ratio upside down': dict(verify_sampled=ratio_upside_down),
    'the coins drawn from the global RNG': dict(verify_sampled=coins_from_the_global_rng),
    'the bonus drawn from the global RNG': dict(verify_sampled=bonus_from_the_global_rng),
    "the residual's fallback decided over a row's whole block": dict(verify_sampled=fallback_over_the_whole_block),
    "the residual's fallback decided by a tolerance (0.05)": dict(verify_sampled=fallback_by_a_tolerance),
    'the bonus squeezed of every dimension (one row: a 0-dim tensor)': dict(verify_sampled=every_dimension_squeezed),
    'the residual without its fallback to P': dict(verify_sampled=residual_without_its_fallback),
    "the residual's fallback decided over the whole batch": dict(verify_sampled=fallback_over_the_whole_batch),
    "the coins drawn without the logits' device": dict(verify_sampled=coins_off_the_logits_device),
    "the residual's fallback to P at T = 1": dict(verify_sampled=fallback_to_p_at_one),
    'the bonus drawn by torch.multinomial (a host sync on a GPU)': dict(verify_sampled=bonus_by_multinomial),
    'the coins drawn in bfloat16': dict(verify_sampled=coins_in(torch.bfloat16)),
    'the coins drawn in float16': dict(verify_sampled=coins_in(torch.float16)),
    "the residual's fallback decided for a row's whole block when any position's residual is 0":
        dict(verify_sampled=fallback_if_any_position_is_zero),
    'a generator of its own, never seeded, when none is given': dict(verify_sampled=own_generator_when_none),
    "torch.default_generator (the CPU's) when none is given": dict(verify_sampled=cpu_generator_when_none),
    'P(d) and Q(d) read by an einsum with a one-hot (bfloat16 under autocast)': dict(verify_sampled=read_by(einsum)),
    "autocast switched off for 'cuda' around the einsum, not on the logits' device": dict(
        verify_sampled=read_by(einsum_with_cuda_autocast_off)),
    "P normalised by a matmul, e @ ones (bfloat16 under autocast)": dict(verify_sampled=softmax_normalised_by_a_matmul),
    "the bonus's CDF by a triangular matmul (bfloat16 under autocast)": dict(
        verify_sampled=inverse_cdf(cdf_by_a_triangular_matmul)),
    "the bonus's weights normalised by a matmul, u not scaled by their total": dict(
        verify_sampled=inverse_cdf(normalised_by_a_matmul)),
    'the bonus by an inverse CDF from a (V, V) triangular matmul, autocast off (10 GB at V = 50,304)': dict(
        verify_sampled=cdf_by_a_vocabulary_square_matmul),
    "keeps every call's verdicts in a list (memory grows with the tokens decoded)": dict(
        verify_sampled=keeps_every_calls_verdicts),
    'an eps of 1e-8 added to Q(d) in the ratio (a draft of small Q accepted too rarely)': dict(
        verify_sampled=eps_added_to_q),
    'with generator=None, a generator seeded from int() of a draw (a host sync)': dict(
        verify_sampled=seeds_a_generator_from_a_read_back_draw_when_none),
    'with generator=None, a generator seeded from the clock (the same global seed, other draws)': dict(
        verify_sampled=seeds_a_generator_from_the_clock_when_none),
    "the global RNG reseeded from the generator given (the caller's RNG changed)": dict(
        verify_sampled=reseeds_the_global_rng_from_the_generator),
    'torch.use_deterministic_algorithms(True) in the call (a process-wide setting left changed)': dict(
        verify_sampled=switches_deterministic_algorithms_on),
    'with generator=None, the draws inside torch.random.fork_rng (every call draws the same numbers)': dict(
        verify_sampled=draws_inside_fork_rng),
    'a running count in a CPU tensor made at import (written from the device: refused on a GPU)': dict(
        verify_sampled=counts_into_a_cpu_tensor_made_at_import),
}
