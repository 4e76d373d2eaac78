"""Exercise 4's reference: typical acceptance as an entry of verification.ACCEPT, and plausible wrong
answers its checks must catch."""
import torch
import torch.nn.functional as F


def typical(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1].double(), dim=-1)                  # judged by the position before
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)              # (B, k-1); 0 log 0 = 0
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)    # min(epsilon, delta e^-H)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def parse_typical(text, vocab_size):
    try:
        epsilon, delta = (float(x) for x in text.split(','))
    except ValueError:
        raise ValueError("give two numbers, EPSILON,DELTA")
    if not (0 < epsilon <= 1 and 0 < delta < 1):     # also false for nan
        raise ValueError("need 0 < EPSILON <= 1 and 0 < DELTA < 1")
    return epsilon, delta


def max_instead_of_min(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1].double(), dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    threshold = (delta * torch.exp(-entropy)).clamp(min=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def judged_one_position_late(logits, drafts, param):
    shifted = torch.cat([logits[:, 1:], logits[:, -1:]], 1)   # draft j+1 judged by the logits after j+1
    return typical(shifted, drafts, param)


def exp_of_plus_entropy(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1].double(), dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    threshold = (delta * torch.exp(entropy)).clamp(max=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def entropy_without_a_guard(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1], dim=-1)                           # at the logits' own precision
    entropy = -(p * p.log()).sum(-1)                                # 0 * log 0 = NaN where p underflows
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def float64_guard_in_float32(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1], dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)              # 1e-300 is 0 in float32: no guard there
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def parts_swapped(text, vocab_size):
    epsilon, delta = parse_typical(text, vocab_size)
    return delta, epsilon                                           # (delta, epsilon): the rule reads them swapped


def epsilon_of_one_refused(text, vocab_size):
    epsilon, delta = parse_typical(text, vocab_size)
    if not epsilon < 1:                                             # the statement allows EPSILON = 1
        raise ValueError("need 0 < EPSILON < 1 and 0 < DELTA < 1")
    return epsilon, delta


def nan_delta_let_through(text, vocab_size):
    try:
        epsilon, delta = (float(x) for x in text.split(','))
    except ValueError:
        raise ValueError("want EPSILON,DELTA") from None
    if not 0 < epsilon <= 1:
        raise ValueError("need 0 < EPSILON <= 1")
    if delta <= 0 or delta >= 1:                                    # nan compares False: it passes
        raise ValueError("need 0 < DELTA < 1")
    return epsilon, delta


def delta_of_zero_let_through(text, vocab_size):
    try:
        epsilon, delta = (float(x) for x in text.split(','))
    except ValueError:
        raise ValueError("want EPSILON,DELTA") from None
    if not (0 < epsilon <= 1 and delta < 1):                        # DELTA's lower bound forgotten
        raise ValueError("need 0 < EPSILON <= 1 and DELTA < 1")
    return epsilon, delta


def a_guard_added_inside_the_log(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1], dim=-1)
    entropy = -(p * (p + 1e-6).log()).sum(-1)                     # the guard shifts every term a little
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def read_by_literal_eval(text, vocab_size):
    import ast
    try:
        epsilon, delta = ast.literal_eval(text)                    # reads 'True,0.5' and '(0.1,0.2)' too
    except (ValueError, SyntaxError, TypeError):
        raise ValueError("give two numbers, EPSILON,DELTA")
    if not (0 < epsilon <= 1 and 0 < delta < 1):
        raise ValueError("need 0 < EPSILON <= 1 and 0 < DELTA < 1")
    return float(epsilon), float(delta)


def shifted_in_place_in_float32(logits, drafts, param):
    epsilon, delta = param
    x = logits[:, :-1].float()                                      # float32 logits: the same tensor, a view
    x -= x.amax(-1, keepdim=True)                                   # writes into the caller's logits
    p = F.softmax(x.double(), dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def judged_by(entropy, p_d):
    """The rule in float32 with the entropy and p_d as given (entropy(p, log_p), p_d(p, drafts))."""
    def typical(logits, drafts, param):
        epsilon, delta = param
        x = logits[:, :-1]
        p = F.softmax(x, dim=-1)
        threshold = (delta * torch.exp(-entropy(p, F.log_softmax(x, dim=-1)))).clamp(max=epsilon)
        return p_d(p, drafts) > threshold
    return typical


def gathered(p, drafts):
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)


def entropy_by_an_einsum(p, log_p):
    return -torch.einsum('bkv,bkv->bk', p, log_p)                  # bfloat16 under autocast


def entropy_by_an_einsum_cuda_autocast_off(p, log_p):
    with torch.autocast('cuda', enabled=False):                      # the CPU's autocast stays on
        return entropy_by_an_einsum(p, log_p)


def p_d_by_an_einsum(p, drafts):
    return torch.einsum('bkv,bkv->bk', p, F.one_hot(drafts, p.size(-1)).to(p.dtype))   # bfloat16 under autocast


def drafts_flattened_by_view(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1].double(), dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)
    B, n, V = p.shape
    p_d = p.view(-1, V).gather(-1, drafts.view(-1, 1)).view(B, n)   # decode's drafts, block[:, 1:]: no view of them
    return p_d > threshold


def the_accepted_prefix(logits, drafts, param):
    ok = typical(logits, drafts, param)
    return ok.long().cumprod(-1).bool()         # Medusa's cumprod: the prefix, not each draft's verdict (ok[:, j])


entropies_seen = []


def keeps_every_entropy(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1].double(), dim=-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    entropies_seen.append(entropy)              # "for statistics": grows with the tokens decoded
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > threshold


def seeds_the_global_rng(logits, drafts, param):
    torch.manual_seed(0)                        # "for reproducibility": every later draw without a generator repeats
    return typical(logits, drafts, param)


CONTROLS = {
    'max instead of min': dict(typical=max_instead_of_min),
    'each draft judged one position late': dict(typical=judged_one_position_late),
    'exp(+H) instead of exp(-H)': dict(typical=exp_of_plus_entropy),
    'an entropy without a guard (NaN in float32)': dict(typical=entropy_without_a_guard),
    "float64's guard 1e-300 in float32 (where it is 0)": dict(typical=float64_guard_in_float32),
    'parse_typical returns its parts swapped': dict(parse_typical=parts_swapped),
    'parse_typical refuses an epsilon of exactly 1': dict(parse_typical=epsilon_of_one_refused),
    'parse_typical lets a nan DELTA through': dict(parse_typical=nan_delta_let_through),
    'parse_typical lets a DELTA of 0 or below through': dict(parse_typical=delta_of_zero_let_through),
    'a guard added inside the log, log(p + 1e-6) (off over a large vocabulary)': dict(
        typical=a_guard_added_inside_the_log),
    "parse_typical reads with Python's literal_eval (True is a number there)": dict(parse_typical=read_by_literal_eval),
    'logits shifted in place through .float() (the same tensor in float32)': dict(typical=shifted_in_place_in_float32),
    'the entropy by an einsum, p @ log p (bfloat16 under autocast)': dict(
        typical=judged_by(entropy_by_an_einsum, gathered)),
    "autocast switched off for 'cuda' around the entropy's einsum, not on the logits' device": dict(
        typical=judged_by(entropy_by_an_einsum_cuda_autocast_off, gathered)),
    'p_d read by an einsum with a one-hot (bfloat16 under autocast)': dict(
        typical=judged_by(lambda p, log_p: -(p * log_p).sum(-1), p_d_by_an_einsum)),
    "the drafts flattened by .view() (decode's drafts are the block's slice: an error with more than one row)": dict(
        typical=drafts_flattened_by_view),
    "keeps every step's entropies in a list (memory grows with the tokens decoded)": dict(typical=keeps_every_entropy),
    "the accepted prefix returned (Medusa's cumprod), not each draft's own verdict": dict(typical=the_accepted_prefix),
    'torch.manual_seed in the rule (the global RNG reset at every step)': dict(typical=seeds_the_global_rng),
}
