"""Exercise 4's checks: typical acceptance (README.md). Your typical and parse_typical are the
entry 'typical' of verification.ACCEPT while a check runs."""
import torch
import torch.nn.functional as F

import decode
import verification
from cli import BadInput
from exercises import harness
from heads import BlockHeads
from model import sample

NAMES = ('typical', 'parse_typical')
SEAMS = {'verification.ACCEPT[typical]': ('typical', 'parse_typical')}
STUBS = {}   # a new rule: its answer was only ever in exercises/solutions/
MAY_USE = ('verification.ACCEPT', 'verification.exact', 'verification.top_n', 'verification.parse_accept',
           'verification.whole_number')
SETTINGS = [(0.09, 0.3), (0.3, 0.9), (0.01, 0.05)]


def random_block(B=400, k=5, V=50, seed=0, sliced=False):
    """Logits (B, k, V) from flat to peaked (a scale per row), drafts sampled from them (B, k-1);
    sliced: laid out as decode.merged_step passes them, the slice block[:, 1:] of the block
    [bonus, drafts] (B, k), not contiguous when B > 1."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, B, dtype=torch.float64)[:, None, None]
    logits = torch.randn(B, k, V, generator=g, dtype=torch.float64) * scale
    drafts = sample(F.softmax(logits[:, :-1], -1), g)
    return logits, F.pad(drafts, (1, 0))[:, 1:] if sliced else drafts      # a slice of the block, as the step's


def test_the_greedy_token_always_passes(impl):
    """The greedy token always passes. For flat and peaked distributions and several (epsilon, delta),
    the target's own argmax is accepted, as the exact rule would (exp(-H(p)) <= max p, so with
    delta < 1 the argmax clears delta * exp(-H))."""
    logits, _ = random_block()
    for param in SETTINGS:
        ok = impl.typical(logits, logits[:, :-1].argmax(-1), param)
        assert ok.shape == (400, 4) and ok.dtype == torch.bool, \
            f"ok should be (B, k-1) = (400, 4) bool, got {tuple(ok.shape)} {ok.dtype}"
        if not ok.all():
            raise harness.Fail(f"(epsilon, delta) = {param}: the argmax was refused in {int((~ok).sum())} of "
                               f"{ok.numel()} places, want none",
                               misread(ok, logits, logits[:, :-1].argmax(-1), *param))


def bar(logits, drafts, eps, delta, judge=slice(None, -1), pick=torch.minimum, sign=-1):
    """The rule written out in float64: each draft's p_j(d) (B, k-1) and the bar it must clear
    (B, k-1). The keywords give the ways it is commonly miswritten, for the hints: judged by other
    logits, another combination of the two bars, exp(+H)."""
    p = F.softmax(logits[:, judge].double(), -1)
    H = -torch.special.xlogy(p, p).sum(-1)                              # 0 log 0 = 0
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1), pick(torch.full_like(H, eps), delta * torch.exp(sign * H))


def rule(logits, drafts, eps, delta, **how):
    p_d, threshold = bar(logits, drafts, eps, delta, **how)
    return p_d > threshold


MISREAD = [   # (how the rule was misread, the hint that says so)
    (dict(judge=slice(1, None)), "your verdicts are exactly the rule's with draft j+1 judged by logits[:, j + 1], "
                                 "one position late: it is judged by the target's prediction after the block "
                                 "position before it"),
    (dict(pick=torch.maximum), "your verdicts are exactly the rule's with the larger of the two bars: the bar is "
                               "min(epsilon, delta exp(-H))"),
    (dict(sign=1), "your verdicts are exactly the rule's with exp(+H): the bar is delta exp(-H(p)), lower where "
                   "the target is unsure"),
]


def misread(got, logits, drafts, eps, delta):
    """The hint for verdicts `got`: the common misreading that gives them exactly, else what fits
    the way they differ from the rule's (more accepted, fewer, or both)."""
    exact = next((hint for how, hint in MISREAD if torch.equal(got, rule(logits, drafts, eps, delta, **how))), '')
    if exact:
        return exact
    want = rule(logits, drafts, eps, delta)
    if torch.equal(got, want.long().cumprod(-1).bool()):
        return ("your verdicts are exactly the rule's accepted prefix (a cumprod, as Medusa's evaluate_posterior "
                "takes it): a rule judges each draft on its own, ok[:, j] whatever the drafts before it got, and "
                "the project takes the prefix itself (verification.accept_prefix)")
    more, fewer = int((got & ~want).sum()), int((~got & want).sum())
    seen = f"it accepted {more} drafts the rule refuses and refused {fewer} it accepts"
    if more and not fewer:
        return f"{seen}: a bar below min(epsilon, delta exp(-H)). What fits: an entropy too large (summed over " \
               f"more than the vocabulary), the two parameters exchanged, or >= where a tie decides nothing"
    if fewer and not more:
        return f"{seen}: a bar above the rule's, or a value below p_j(d). What fits: max for min, exp(+H), an " \
               f"entropy too small or NaN (0 log 0 unguarded), or a logit or log-probability compared with the bar"
    return f"{seen}. What fits: drafts judged by other logits than the position before theirs, epsilon and delta " \
           f"exchanged, or another formula for the bar"


def test_the_threshold(impl):
    """The threshold. Against the rule written out: accepted exactly when p_j(d) > min(epsilon,
    delta * exp(-H(p_j))), judged by the logits after position j; for blocks of k = 5 and k = 2
    (one draft), 400 rows, the drafts a slice of the block as decode passes them; the inputs left
    as they were."""
    for k in (5, 2):
        logits, drafts = random_block(k=k, seed=1, sliced=True)
        for eps, delta in SETTINGS:
            want = rule(logits, drafts, eps, delta)
            got = harness.assert_inputs_unchanged(   # a .view() of the slice fails here: harness.VIEW_HINT says why
                'typical', lambda: impl.typical(logits, drafts, (eps, delta)),
                "what fits: an in-place op (softmax_, log_, unsqueeze_, masked_fill_) on an input, or on .double() "
                "of float64 logits, which is the same tensor", logits=logits, drafts=drafts)
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == torch.bool):
                shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise harness.Fail(f"k = {k}, B = 400: ok is {shown}, want {tuple(want.shape)} torch.bool",
                                   "what fits at k = 2 (one draft): a squeeze that drops every dimension of size 1, "
                                   "not only the gathered one")
            bad = int((got != want).sum())
            if bad:
                raise harness.Fail(f"k = {k}, (epsilon, delta) = {(eps, delta)}: {bad} of {want.numel()} drafts judged "
                                   f"otherwise than the rule, want 0", misread(got, logits, drafts, eps, delta))
            assert 0 < want.float().mean() < 1, "the test block should have drafts on both sides"


def test_float32_and_huge_gaps(impl):
    """float32, and tokens far below the rest. Logits in float32, as decoding computes them, where
    some tokens sit 120 and 1,000 below the rest (their probability underflows to 0 in float32):
    the argmax still passes, those tokens are refused, every draft is judged as the rule
    computed in float64 judges it, and the float32 logits are left as they were."""
    base, drafts = random_block(seed=5)
    B, k, V = base.shape
    g = torch.Generator().manual_seed(6)
    far = torch.randint(V, (B, k, 2), generator=g)                        # two tokens per position, far below
    low = base.amin(-1, keepdim=True) - torch.tensor([120.0, 1000.0], dtype=torch.float64)
    logits = base.scatter(-1, far, low).float()
    drafts = torch.where(torch.arange(B)[:, None] % 4 == 0, far[:, :-1, 0], drafts)   # a quarter drafts a far token
    p_d, threshold = bar(logits, drafts, 0.09, 0.3)
    clear = (p_d - threshold).abs() > 1e-4 * threshold                  # float32 may judge a near tie otherwise
    greedy = logits[:, :-1].argmax(-1)
    argmax_ok = harness.assert_inputs_unchanged(
        'typical, on float32 logits,', lambda: impl.typical(logits, greedy, (0.09, 0.3)),
        "what fits: an in-place op on .float() (or .to(torch.float32)) of logits already in float32, the "
        "same tensor (x -= x.amax(...), sub_, clamp_, log_softmax into it): decode's logits are float32",
        logits=logits, drafts=greedy)
    if not argmax_ok.all():
        in_float64 = impl.typical(base, base[:, :-1].argmax(-1), (0.09, 0.3)).all()     # no gaps, float64
        raise harness.Fail(
            f"float32 logits with tokens 120 and 1000 below the rest: the argmax was refused in "
            f"{int((~argmax_ok).sum())} of {argmax_ok.numel()} places, want none",
            "the same rule passes the argmax in float64, so it is the precision: in float32 those tokens' p is 0. "
            "What fits: an entropy that turns NaN there (0 * log 0; NaN > anything is False), a guard that is 0 in "
            "float32 (1e-300 is), or a log of 0 that reaches the bar" if in_float64 else
            "the same logits in float64 are refused too, so it is the rule, not the precision: the checks above "
            "say more")
    got = impl.typical(logits, drafts, (0.09, 0.3))
    bad = int(((got != (p_d > threshold)) & clear).sum())
    if bad:
        raise harness.Fail(f"float32 logits with tokens far below the rest: {bad} of {int(clear.sum())} drafts judged "
                           f"otherwise than the rule in float64, want 0", "the argmax passes, other drafts are judged "
                           "otherwise in float32. What fits: an entropy that loses the far tokens' terms otherwise "
                           "than as 0 (NaN, or a guard's own value), or a comparison made in another precision")


def near_the_bar(V=50304, rows=64, seed=7):
    """float32 logits (rows, 2, V) of a GPT-2-sized vocabulary, drafts (rows, 1) placed above or
    below the rule's bar (epsilon, delta) = (1, 0.9), and how far from it float32 may misjudge (rows,):
    half the rows a long tail of randn logits, drafts 8e-4 to 5e-2 from the bar (relatively), where
    float32 entropies are off by at most 1.7e-4 (entr, log_softmax, logsumexp - E[x], cross_entropy
    with soft targets, prod p^p, p @ log p measured); half 50,264 tokens at p about 4e-8 each (below
    float32's eps) after 40 large ones, drafts 1.3e-2 to 5e-2 from it, where a sum that adds the tail
    one term at a time to the head's total rounds every term (p @ log p: 4.5e-3; bound 6e-3)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 2, V, generator=g, dtype=torch.float64) * 2.0
    logits[:, :, 1:40] += 9.0
    flat = torch.zeros(V, dtype=torch.float64)
    flat[:40] = 13.25 + torch.linspace(0, 0.5, 40, dtype=torch.float64)
    logits[rows // 2:] = flat
    draft = torch.full((rows, 1), V - 1)
    r = torch.cat([torch.logspace(-3.1, -1.3, rows // 2, dtype=torch.float64),    # 8e-4 to 5e-2
                   torch.logspace(-1.9, -1.3, rows // 2, dtype=torch.float64)])   # 1.3e-2 to 5e-2
    r = torch.where(torch.arange(rows) % 2 == 0, r, -r)                     # above and below the bar
    tolerance = torch.where(torch.arange(rows) < rows // 2, 5e-4, 1e-2)     # float32's error, with room
    rest = torch.logsumexp(logits[:, 0, :-1], -1)
    for _ in range(6):   # the draft's own p moves the bar: placed again until it stays (6 times: to 0.2%)
        _, threshold = bar(logits.float(), draft, 1.0, 0.9)
        want = threshold[:, 0] * (1 + r)
        logits[:, 0, -1] = torch.log(want) + rest - torch.log1p(-want)
    return logits.float(), draft, tolerance


def test_a_large_vocabulary(impl):
    """A large vocabulary in float32. 50,304 tokens (GPT-2's, padded), float32 logits, a long tail of
    small probabilities (some below float32's eps), and drafts placed 8e-4 to 5e-2 above or below
    the bar (relatively; 1.3e-2 to 5e-2 where a float32 sum in another order may be off by 4.5e-3):
    each is judged as the rule in float64 judges it, and so again under bfloat16 autocast (as
    generate.py --dtype bfloat16 decodes). Hint: at V = 50 (the checks above) an entropy that is a
    little off shows in few verdicts; here it moves the bar past drafts. What fits: a guard added
    to p inside the log (log(p + 1e-6)), an entropy over the top tokens only, one computed in
    float16 or bfloat16, or a float32 sum of terms far larger than H added one at a time (E[x]
    of logits not shifted by their max, through a matmul: logsumexp(x) - p @ x)."""
    logits, drafts, tolerance = near_the_bar()
    p_d, threshold = bar(logits, drafts, 1.0, 0.9)
    clear = (p_d - threshold).abs() > tolerance[:, None] * threshold
    want = p_d > threshold
    assert clear.all() and 0 < want.float().mean() < 1, "the test block should have clear drafts on both sides"
    # under bfloat16 autocast (the logits float32, as decode upcasts them) a right answer judges as in float32:
    # autocast leaves elementwise ops, sums, softmax and log alone. It runs a matrix product of float32
    # tensors in bfloat16, and an entropy taken by one (p @ log p, an einsum) is then up to 1.5e-2 off here
    # (an entropy in float16, refused outside autocast, is 5e-3 off), a p_d read by one 3e-3
    for autocast in (False, True):
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
            got = impl.typical(logits, drafts, (1.0, 0.9))
        wrong = (got != want) & clear
        if wrong.any():
            row = int(wrong.nonzero()[0, 0])
            under = ' under bfloat16 autocast (generate.py --dtype bfloat16)' if autocast else ''
            raise harness.Fail(f"V = 50304, float32{under}: {int(wrong.sum())} of {want.numel()} drafts near the bar "
                               f"judged otherwise than the rule in float64, want 0 (the worst: p_d "
                               f"{float(p_d[row, 0]):.4g} against the bar {float(threshold[row, 0]):.4g}; yours says "
                               f"{bool(got[row, 0])})", AUTOCAST if autocast else '')


AUTOCAST = ("the same logits outside autocast are judged right: autocast runs a matrix product of float32 tensors "
            "(@, einsum, bmm, matmul, linalg.vecdot) in bfloat16, 3 significant digits. What fits: the entropy, or "
            "p_d, taken by one (p @ log p, an einsum with a one-hot), or autocast switched off on another device "
            "than the logits' (torch.autocast('cuda', ...) on a CPU); multiply elementwise and sum, or switch "
            "autocast off around the product on the logits' device (torch.autocast(logits.device.type, "
            "enabled=False))")


def test_a_smaller_epsilon_accepts_at_least_as_much(impl):
    """A smaller epsilon accepts at least as much. On the same block, every draft accepted at an
    epsilon is accepted at every smaller one (so no step's tau falls as epsilon falls). Hint:
    min(epsilon, ...) falls as epsilon falls; a bar that rises instead fits max for min, or epsilon
    and delta exchanged."""
    logits, drafts = random_block(seed=2)
    prev, first = None, None
    for eps in (0.5, 0.2, 0.05, 0.01, 0.001):
        ok = impl.typical(logits, drafts, (eps, 0.3))
        if first is None:
            first = ok, ok.clone()
        elif not torch.equal(*first):
            raise harness.Fail(f"the verdicts of the call at epsilon 0.5 changed when typical was called again at "
                               f"epsilon {eps}, want each call's result its own",
                               "what fits: a tensor kept across calls and written again (a buffer given as out=, or "
                               "a result returned in place of a fresh one); decode keeps a step's verdicts while it "
                               "judges others")
        ok = ok.clone()
        if prev is not None:
            lost = prev[1] & ~ok
            if lost.any():
                b, j = (int(i) for i in lost.nonzero()[0])
                raise harness.Fail(f"epsilon {eps}: {int(lost.sum())} drafts accepted at epsilon {prev[0]} are refused "
                                   f"(row {b}, draft {j}), want every one still accepted")
        prev = eps, ok


def test_the_parameter_is_read_and_checked(impl):
    """The parameter is read and checked. 'typical:0.09,0.3' gives (0.09, 0.3); malformed or
    out-of-range values are refused with a one-line error naming --accept. Hint: raise ValueError
    with a short reason; verification.parse_accept adds the rest."""
    got = tuple(impl.parse_typical('0.09,0.3', 50))
    if got == (0.09, 0.3) and not all(isinstance(x, float) for x in got):
        raise harness.Fail(f"parse_typical('0.09,0.3') gave {tuple(type(x).__name__ for x in got)}, want two Python "
                           f"floats", "a tensor (float32 by default) holds 0.3 as 0.30000001192...: the rule would "
                           "judge against another number than the one given; float(text) is exact to float64")
    if got != (0.09, 0.3):
        raise harness.Fail(f"parse_typical('0.09,0.3') gave {got}, want (0.09, 0.3)",
                           "the two numbers come back swapped: the text is EPSILON,DELTA, and parse_typical returns "
                           "(epsilon, delta) in that order (typical reads epsilon, delta = param)"
                           if got == (0.3, 0.09) else "return the two numbers as floats, (epsilon, delta)")
    fn, param = verification.parse_accept('typical:0.2,0.5', 50)
    assert fn is impl.typical and tuple(param) == (0.2, 0.5), \
        f"verification.parse_accept('typical:0.2,0.5') gave ({getattr(fn, '__name__', fn)}, {param}), " \
        f"want (typical, (0.2, 0.5))"
    for edge, want in (('1,0.3', (1.0, 0.3)), ('0.09,0.999', (0.09, 0.999)), ('1e-9,1e-9', (1e-9, 1e-9))):
        try:
            got = tuple(verification.parse_accept(f'typical:{edge}', 50, cli=True)[1])
        except BadInput as e:
            raise harness.Fail(f"'typical:{edge}' was refused ({e}), want it read as {want}: 0 < EPSILON <= 1 "
                               f"and 0 < DELTA < 1 allow it", "a value the statement allows was refused: what fits "
                               "is a bound written otherwise than the statement's (< where it says <=, or the two "
                               "bounds of epsilon and delta exchanged)")
        assert got == want, f"'typical:{edge}' gave {got}, want {want}"
    for bad in ('0.09', 'a,b', '0,0.3', '0.09,1', '1.5,0.3', '-1,0.3', '0.3,0', '0.3,-0.5', 'nan,0.3', '0.3,nan',
                'nan,nan', 'inf,0.3', '0.1,0.2,0.3', '', 'True,0.5', '(0.1,0.2)', '[0.1,0.2]', '0.1,0.2abc',
                'eps=0.1;delta=0.2', 'true,0.5'):
        try:
            verification.parse_accept(f'typical:{bad}', 50, cli=True)
        except BadInput as e:
            assert '--accept' in str(e) and '\n' not in str(e), \
                f"'typical:{bad}': the error {str(e)!r} should be one line naming --accept"
            continue
        raise harness.Fail(f"'typical:{bad}' was accepted; want it refused (0 < EPSILON <= 1, 0 < DELTA < 1)",
                           "a value outside the statement's bounds passed: what fits is a bound written otherwise "
                           "(<= where it says <), a test nan passes (nan compares False with everything), "
                           "extra or missing numbers not counted, or a reader more lenient than float() (Python's "
                           "literal_eval reads True; a regex search skips the text around a number)")


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device, nothing kept. Nothing makes the host
    wait for the device, as many ops for 6 rows, 8 positions or a vocabulary of 200 as for 3 rows of 5
    over 50, no tensor is made off the logits' device (run on PyTorch's 'meta' device, which refuses
    a mix of devices as CUDA does), and five calls keep no more of the tensors they make, nor
    more bytes, than one call (the rule runs at every step decoded)."""
    logits, drafts = random_block(B=8, seed=3)
    with harness.HostSyncs() as syncs:
        impl.typical(logits, drafts, (0.09, 0.3))
    if syncs.seen:
        raise harness.Fail(f"host syncs: {', '.join(sorted(set(syncs.seen)))}, want none",
                           "the ops listed make the host wait for the device: a value read back (.item(), float() "
                           "or bool() of a tensor, Python's min or max or an if on one) or a shape that depends on "
                           "the data (boolean indexing, nonzero)")
    harness.assert_no_python_loop('typical', [(f'B={B}, k={k}, V={V}', lambda B=B, k=k, V=V: impl.typical(
        *random_block(B, k, V, seed=4), (0.09, 0.3))) for B, k, V in ((3, 5, 50), (6, 5, 50), (3, 8, 50), (3, 5, 200))])
    harness.assert_keeps_nothing('typical', lambda i: impl.typical(*random_block(B=4, seed=10 + i), (0.09, 0.3)))
    logits, drafts = harness.on_meta(logits), harness.on_meta(drafts)
    harness.assert_on_the_inputs_device('typical', lambda: impl.typical(logits, drafts, (0.09, 0.3)))


@torch.no_grad()
def test_every_committed_draft_passes(impl):
    """Through decode.generate, every committed draft passes the rule. Decoding with
    accept='typical:0.3,0.6' and BPD heads: replayed on a full forward over the output, each
    step's bonus is the target's argmax, its committed drafts pass the rule, the first refused one
    fails it. Hint: the checks above judge the rule alone; what fits a failure here only: a rule that
    assumes a batch or a block size, verdicts shaped otherwise than (B, k-1), or a parameter read
    otherwise through verification.parse_accept."""
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
            assert out[0, s] == logits[t].argmax(), \
                f"step at position {s}: the bonus is {int(out[0, s])}, want the target's argmax " \
                f"{int(logits[t].argmax())}"
            m = min(tau, k - 1)                             # its committed drafts, and the refused one
            if s + m < out.size(1):
                ok = impl.typical(logits[None, s:s + m + 1], drafts_at[None, t, :m], (0.3, 0.6))[0]
                assert ok[:tau - 1].all(), \
                    f"step at position {s}: the rule says {ok[:tau - 1].tolist()} of its {tau - 1} committed " \
                    f"drafts, want all True"
                assert tau == k or not ok[tau - 1], \
                    f"step at position {s}: its draft {tau - 1} (from 0) passes the rule but was refused, " \
                    f"want it committed"
            taus_all.append(tau)
            t += tau
    if not max(taus_all) > 2:
        raise harness.Fail(f"your rule let through at most {max(taus_all) - 1} of a step's drafts, want 2 or more at "
                           f"some steps: these heads' drafts are often typical",
                           "the checks above test the rule alone, and say what is off")


def test_torch_settings_left_as_they_were(impl):
    """torch's settings left as they were. A call of typical changes none of torch's process-wide
    settings: the global RNG (torch.manual_seed), grad mode (torch.set_grad_enabled as a
    statement), the default dtype, anomaly detection, deterministic algorithms, TF32 and the
    float32 matmul precision. decode calls the rule at every step: the process's draws without a
    generator (a sampled decode's) and its forwards must go on as without it. A student.py that
    changes one while it loads fails every check."""
    logits, drafts = random_block(B=8, seed=3)
    harness.assert_leaves_torch_alone('typical', lambda: impl.typical(logits, drafts, (0.09, 0.3)))


@torch.no_grad()
def try_it(impl, tryout):
    """Typical acceptance, yours next to the reference (in a handout, the target alone), beside exact
    and top-k, with the k = 8 heads: tau, agreement with greedy, and the original model's NLL of the
    output (as bench.py's lossy table)."""
    heads = tryout.drafter('heads.pt')
    T0 = tryout.prompts.size(1)
    typical = [r for accept in ('typical:0.3,0.6', 'typical:0.09,0.3', 'typical:0.01,0.1')
               for r in tryout.pair(accept, drafter=heads, k=8, accept=accept)]          # first: yours may be unwritten
    rows = [tryout.row(f"{accept} (the project's rule)", None, drafter=heads, k=8, accept=accept)
            for accept in ('exact', 'topk:2', 'topk:3')] + typical
    for r in rows:
        logits = tryout.model(r['out'][:, :-1])[0].float()
        nll = -F.log_softmax(logits, -1).gather(-1, r['out'][:, 1:, None]).squeeze(-1)[:, T0 - 1:].mean()
        r['nll'] = f"{float(nll):.3f}"
    tryout.table(rows, extra=[('output NLL', 'nll')])
