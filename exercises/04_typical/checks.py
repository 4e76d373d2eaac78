"""Exercise 4's checks: typical acceptance (README.md). Your typical and parse_typical are the
entry 'typical' of decode.ACCEPT while a check runs."""
import torch
import torch.nn.functional as F

import decode
from data import BadInput
from exercises import harness
from heads import BlockHeads

NAMES = ('typical', 'parse_typical')
SEAMS = {'decode.ACCEPT[typical]': ('typical', 'parse_typical')}
SETTINGS = [(0.09, 0.3), (0.3, 0.9), (0.01, 0.05)]


def random_block(B=400, k=5, V=50, seed=0):
    """Logits (B, k, V) from flat to peaked (a scale per row), drafts sampled from them (B, k-1)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, B, dtype=torch.float64)[:, None, None]
    logits = torch.randn(B, k, V, generator=g, dtype=torch.float64) * scale
    drafts = decode.sample(F.softmax(logits[:, :-1], -1), g)
    return logits, drafts


def test_the_greedy_token_always_passes(impl):
    """The greedy token always passes. For flat and peaked distributions and several (epsilon, delta),
    the target's own argmax is accepted, as the exact rule would. Hint: exp(-H(p)) <= max p, so
    with delta < 1 the argmax clears delta * exp(-H); compare probabilities, not logits."""
    logits, _ = random_block()
    for param in SETTINGS:
        ok = impl.typical(logits, logits[:, :-1].argmax(-1), param)
        assert ok.shape == (400, 4) and ok.dtype == torch.bool, f"ok should be (B, k-1) bool, got {tuple(ok.shape)}"
        assert ok.all(), f"(epsilon, delta) = {param}: the argmax was refused in {int((~ok).sum())} places"


def test_the_threshold(impl):
    """The threshold. Against the rule written out: accepted exactly when p_j(d) > min(epsilon,
    delta * exp(-H(p_j))), judged by the logits after position j. Hint: draft j+1 is judged by
    logits[:, j] (the target's prediction after the block position before it), so use
    logits[:, :-1]; H = -sum p log p."""
    logits, drafts = random_block(seed=1)
    p = F.softmax(logits[:, :-1], -1)
    H = -(p * p.clamp_min(1e-300).log()).sum(-1)
    p_d = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    for eps, delta in SETTINGS:
        want = p_d > torch.minimum(torch.full_like(H, eps), delta * torch.exp(-H))
        got = impl.typical(logits, drafts, (eps, delta))
        bad = int((got != want).sum())
        assert bad == 0, f"(epsilon, delta) = {(eps, delta)}: {bad} of {want.numel()} drafts judged otherwise"
        assert 0 < want.float().mean() < 1, "the test block should have drafts on both sides"


def test_tau_does_not_fall_as_epsilon_falls(impl):
    """Tau does not fall as epsilon falls. On the same block, a smaller epsilon lowers the bar, so
    every row keeps at least as many drafts. Hint: min(epsilon, ...) only grows with epsilon."""
    logits, drafts = random_block(seed=2)
    prev = None
    for eps in (0.5, 0.2, 0.05, 0.01, 0.001):
        _, n_acc, _ = decode.accept_prefix(impl.typical(logits, drafts, (eps, 0.3)), logits.argmax(-1))
        if prev is not None:
            assert (n_acc >= prev).all(), f"epsilon {eps}: some rows keep fewer drafts than at a larger epsilon"
        prev = n_acc


def test_the_parameter_is_read_and_checked(impl):
    """The parameter is read and checked. 'typical:0.09,0.3' gives (0.09, 0.3); malformed or
    out-of-range values are refused with a one-line error naming --accept. Hint: raise ValueError
    with a short reason; decode.parse_accept adds the rest."""
    assert tuple(impl.parse_typical('0.09,0.3', 50)) == (0.09, 0.3), "'0.09,0.3' should read as (0.09, 0.3)"
    rule, param = decode.parse_accept('typical:0.2,0.5', 50)
    assert rule is impl.typical and tuple(param) == (0.2, 0.5), "decode.parse_accept does not reach your entry"
    for bad in ('0.09', 'a,b', '0,0.3', '0.09,1', '1.5,0.3', '-1,0.3', 'nan,0.3', '0.1,0.2,0.3', ''):
        try:
            decode.parse_accept(f'typical:{bad}', 50, cli=True)
        except BadInput as e:
            assert '--accept' in str(e) and '\n' not in str(e), f"'typical:{bad}': the error should be one line naming --accept"
            continue
        raise AssertionError(f"'typical:{bad}' was accepted; it should be refused")


def test_no_host_sync(impl):
    """No host sync. Hint: torch.minimum with a tensor (or clamp) instead of Python's min on a tensor."""
    logits, drafts = random_block(B=8, seed=3)
    with harness.HostSyncs() as syncs:
        impl.typical(logits, drafts, (0.09, 0.3))
    assert not syncs.seen, f"host syncs: {', '.join(sorted(set(syncs.seen)))}"


@torch.no_grad()
def test_every_committed_draft_passes(impl):
    """Through decode.generate, every committed draft passes the rule. Decoding with
    accept='typical:0.3,0.6' and BPD heads: replayed on a full forward over the output, each
    step's bonus is the target's argmax, its committed drafts pass the rule, the first refused one
    fails it. Hint: if the unit checks pass and this fails, check the rule's shapes: (B, k-1)."""
    model = harness.tiny_target()
    k = 5
    heads = harness.peaky(BlockHeads(model.config, k), 0.1, 1)
    prompts = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(4))
    taus_all = []
    for row in prompts:
        out, stats = decode.generate(model, row[None], 40, drafter=heads, k=k, accept='typical:0.3,0.6')
        H = model.hidden(out)[0]
        logits = model.lm_head(H)
        drafts_at = heads(H, model.lm_head, k - 1).argmax(-1)           # what the heads drafted after t
        t = 8 - 1                                           # the last committed position before a step
        for tau in stats['accept_lengths']:
            s = t + 1                                       # the step's bonus
            assert out[0, s] == logits[t].argmax(), f"step at {s}: the bonus is not the target's argmax"
            m = min(tau, k - 1)                             # its committed drafts, and the refused one
            if s + m < out.size(1):
                ok = impl.typical(logits[None, s:s + m + 1], drafts_at[None, t, :m], (0.3, 0.6))[0]
                assert ok[:tau - 1].all(), f"step at {s}: a committed draft fails the rule"
                assert tau == k or not ok[tau - 1], f"step at {s}: draft {tau} passes the rule but was refused"
            taus_all.append(tau)
            t += tau
    assert max(taus_all) > 2, "the drafts were hardly ever accepted: the check decodes nothing"


@torch.no_grad()
def try_it(impl, tryout):
    """Typical acceptance next to exact and top-k, with the k = 8 heads: tau, agreement with greedy,
    and the original model's NLL of the output (as bench.py's lossy table)."""
    heads = tryout.drafter('heads.pt')
    rows = []
    T0 = tryout.prompts.size(1)
    for accept, yours in [('exact', False), ('topk:2', False), ('topk:3', False), ('typical:0.3,0.6', True),
                          ('typical:0.09,0.3', True), ('typical:0.01,0.1', True)]:
        r = tryout.row(accept, yours, drafter=heads, k=8, accept=accept)
        logits = tryout.model(r['out'][:, :-1])[0].float()
        nll = -F.log_softmax(logits, -1).gather(-1, r['out'][:, 1:, None]).squeeze(-1)[:, T0 - 1:].mean()
        r['nll'] = f"{float(nll):.3f}"
        rows.append(r)
    tryout.table(rows, extra=[('output NLL', 'nll')])
