"""Exercise 1's reference is the project's own verification.verify_greedy; these are the plausible wrong
answers its checks must catch."""
import torch


def counts_past_the_first_rejection(logits, drafts, accept):
    rule, param = accept
    ok = rule(logits, drafts, param)
    n_acc = ok.sum(-1)                                   # every accepted draft, wherever it is
    return ok, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def bonus_one_position_late(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    late = (n_acc + 1).clamp(max=drafts.size(1))
    return accepted, n_acc, logits.argmax(-1).gather(1, late[:, None]).squeeze(1)


def argmax_whatever_the_rule(logits, drafts, accept):
    accepted = (drafts == logits[:, :-1].argmax(-1)).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def one_row_at_a_time(logits, drafts, accept):
    rule, param = accept
    rows = []
    for i in range(logits.size(0)):                      # right, but a Python loop: B times the ops a step
        accepted = rule(logits[i:i + 1], drafts[i:i + 1], param).long().cumprod(-1).bool()
        n_acc = accepted.sum(-1)
        rows.append((accepted, n_acc, logits[i:i + 1].argmax(-1).gather(1, n_acc[:, None]).squeeze(1)))
    return tuple(torch.cat(parts) for parts in zip(*rows))


def every_dimension_squeezed(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze()   # one row: shape (), not (1,)


def prefix_read_on_the_host(logits, drafts, accept):
    rule, param = accept
    ok = rule(logits, drafts, param).tolist()           # the verdicts read back, then counted in Python
    n = [next((j for j, v in enumerate(row) if not v), len(row)) for row in ok]
    n_acc = torch.tensor(n, device=logits.device)
    accepted = torch.arange(drafts.size(1), device=logits.device) < n_acc[:, None]
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def bonus_by_topk(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    best = logits.topk(1, dim=-1).indices[..., 0]        # ties: not always the first of equals, as argmax's
    return accepted, n_acc, best.gather(1, n_acc[:, None]).squeeze(1)


def bonus_from_probabilities(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    best = logits.softmax(-1).argmax(-1)                 # near 0, logits 1e-17 apart round to equal probabilities
    return accepted, n_acc, best.gather(1, n_acc[:, None]).squeeze(1)


def first_refusal_by_an_unstable_sort(logits, drafts, accept):
    rule, param = accept
    ok = rule(logits, drafts, param)
    refused = torch.cat([~ok, torch.ones_like(ok[:, :1])], 1).long()    # a refusal after the last draft
    n_acc = refused.sort(-1, descending=True).indices[:, 0]             # ties: the first of equals only by luck
    accepted = torch.arange(drafts.size(1), device=drafts.device) < n_acc[:, None]
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def writes_into_the_logits(logits, drafts, accept):
    rule, param = accept
    logits -= logits.amax(-1, keepdim=True)              # "for stability", in place: the caller's logits change
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def bonus_logits_picked_by_a_product(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    pick = torch.nn.functional.one_hot(n_acc, logits.size(1)).to(logits.dtype)
    row = torch.einsum('bk,bkv->bv', pick, logits)     # under bf16 autocast: the logits rounded to bfloat16
    return accepted, n_acc, row.argmax(-1)


def bonus_token_picked_by_a_product(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    pick = torch.nn.functional.one_hot(n_acc, logits.size(1)).to(logits.dtype)
    best = logits.argmax(-1).to(logits.dtype)
    return accepted, n_acc, (pick.unsqueeze(1) @ best.unsqueeze(-1)).flatten().long()   # bf16: 3001 -> 3008


n_acc_seen = []


def keeps_every_n_acc(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    n_acc_seen.append(n_acc)                    # "for statistics": grows with the tokens decoded
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)

def a_debugging_print_left_in(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    print("accepted per row:", n_acc)                    # right, but its values are read back to be printed
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def reseeds_the_global_rng(logits, drafts, accept):
    torch.manual_seed(0)                                 # "for determinism": the caller's random stream reseeded
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def leaves_grad_mode_off(logits, drafts, accept):
    torch.set_grad_enabled(False)                        # "inference only", called, not a context: left off
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


out_buffers = {}


def writes_into_buffers_kept_between_calls(logits, drafts, accept):
    key = (tuple(drafts.shape), logits.device)           # made once per shape and device, written at every call
    if key not in out_buffers:
        out_buffers[key] = (torch.empty(drafts.shape, dtype=torch.bool, device=logits.device),
                            torch.empty(drafts.size(0), dtype=torch.long, device=logits.device),
                            torch.empty(drafts.size(0), dtype=torch.long, device=logits.device))
    accepted, n_acc, bonus = out_buffers[key]            # the next call overwrites what the caller holds
    rule, param = accept
    accepted.copy_(rule(logits, drafts, param).long().cumprod(-1).bool())
    torch.sum(accepted, -1, out=n_acc)
    bonus.copy_(logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1))
    return accepted, n_acc, bonus


CONTROLS = {
    'counts past the first rejection': dict(verify_greedy=counts_past_the_first_rejection),
    'bonus one position late': dict(verify_greedy=bonus_one_position_late),
    'ignores the acceptance rule': dict(verify_greedy=argmax_whatever_the_rule),
    'a Python loop over the rows': dict(verify_greedy=one_row_at_a_time),
    'the bonus squeezed of every dimension (one row: a 0-dim tensor)': dict(verify_greedy=every_dimension_squeezed),
    'the prefix counted in Python from .tolist() (a host sync)': dict(verify_greedy=prefix_read_on_the_host),
    'the bonus by topk (a tie broken otherwise than argmax)': dict(verify_greedy=bonus_by_topk),
    'the bonus from softmax probabilities (a near-tie near 0 rounded to a tie)': dict(
        verify_greedy=bonus_from_probabilities),
    'the first refusal by sort (ties in an unspecified order)': dict(verify_greedy=first_refusal_by_an_unstable_sort),
    'writes into its input (logits -= max in place)': dict(verify_greedy=writes_into_the_logits),
    'the bonus position\'s logits picked by a one-hot einsum (bfloat16 under autocast)': dict(
        verify_greedy=bonus_logits_picked_by_a_product),
    'the bonus token picked by a one-hot matmul (bfloat16 under autocast: tokens above 256 rounded)': dict(
        verify_greedy=bonus_token_picked_by_a_product),
    "keeps every step's n_acc in a list (memory grows with the tokens decoded)": dict(verify_greedy=keeps_every_n_acc),
    'a debugging print of n_acc left in (its values read back: a host sync)': dict(verify_greedy=a_debugging_print_left_in),
    "torch.manual_seed inside the call (the caller's global RNG reseeded at every step)": dict(
        verify_greedy=reseeds_the_global_rng),
    'torch.set_grad_enabled(False) called, not used as a context (grad mode left off)': dict(
        verify_greedy=leaves_grad_mode_off),
    'the outputs written into buffers kept between calls (the next call overwrites them)': dict(
        verify_greedy=writes_into_buffers_kept_between_calls),
}

