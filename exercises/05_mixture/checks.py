"""Exercise 5's checks: the mixture's posterior and conditionals (README.md)."""
import math

import torch
import torch.nn.functional as F

from dblast import DBlastDrafter
from exercises import harness

NAMES = ('posterior', 'conditionals')
SEAMS = {'dblast.posterior': 'posterior', 'dblast.conditionals': 'conditionals'}
REFERENCE = {'posterior': 'dblast.posterior', 'conditionals': 'dblast.conditionals'}   # in a handout: student.py
STUBS = {}   # nothing else of the project is this answer
MAY_USE = ('dblast.prior', 'dblast.branch_log_probs', 'dblast.DBlastDrafter.draft_paths')


def random_mixture(N=6, K=3, n=4, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    log_prior = F.log_softmax(torch.randn(N, K, generator=g, dtype=torch.float64), -1)
    log_q = F.log_softmax(torch.randn(N, K, n, V, generator=g, dtype=torch.float64) * 2, -1)
    drafts = torch.randint(V, (N, n), generator=g)
    return log_prior, log_q, drafts


def drafted(q, drafts):
    """Each branch's q (N, K, n, V), or log q, at the drafts (N, n): (N, K, n), what posterior reads."""
    return q.gather(-1, drafts[:, None, :, None].expand(-1, q.size(1), -1, 1)).squeeze(-1)


def brute_force(log_prior, log_q, drafts, seen=0):
    """w (N, n, K) and Q (N, n, V) from the definitions, in probability space (fine for 4 positions).
    seen: how many drafts position i conditions on beyond those before it (0; for the hints, 1: its
    own draft too)."""
    pi, q = log_prior.exp(), log_q.exp()
    N, K, n, V = q.shape
    qd = drafted(q, drafts)                                                     # (N, K, n)
    w = torch.empty(N, n, K, dtype=q.dtype)
    for i in range(n):
        joint = pi * qd[:, :, :i + seen].prod(-1)                                 # pi_z prod_{l<i}
        w[:, i] = joint / joint.sum(-1, keepdim=True)
    return w, torch.einsum('nik,nkiv->niv', w, q)


PRIOR = ("you gave the prior at every position: position i's posterior weighs each branch by how likely it made "
         "the drafts before i, pi'_z prod_{l<i} q~_l(d_l | z)")
OWN_DRAFT = ("position i saw its own draft: the sum over l < i is exclusive (position 0 sees no draft, so its "
             "posterior is the prior): shift the cumulative sum by one")


def misread(w, log_prior, log_q, drafts):
    """The hint for a posterior w (N, n, K) that a common misreading gives ('' if none)."""
    if (w - log_prior.exp()[:, None]).abs().max() < 1e-9:
        return PRIOR
    if (w - brute_force(log_prior, log_q, drafts, seen=1)[0]).abs().max() < 1e-9:
        return OWN_DRAFT
    return ''


AUTOCAST = ("autocast runs a matmul of float32 tensors (einsum, @, bmm, a triangular matrix summing the logs) in "
            "bfloat16, 3 significant digits, and Q (or the posterior inside it) is then not what the drafts were "
            "drawn from: sum with cumsum and multiply elementwise, or switch autocast off around the matmul, on the "
            "inputs' device (torch.autocast(log_q.device.type, enabled=False))")


def under_autocast(call, *inputs):
    """call(*inputs) with the inputs in float32, under bfloat16 autocast, as generate.py --dtype bfloat16
    decodes (dblast.DBlastDrafter hands conditionals float32 log q~ there): the result, and it in float64."""
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = call(*(t.float() if t.is_floating_point() else t for t in inputs))
    return out, out.double()


def test_the_posterior_by_enumeration(impl):
    """The posterior by enumeration. log w (N, n, K) equals pi'_z prod_{l<i} q~_l(d_l | z),
    normalised, computed directly, for sampled and for greedy branches (log q~ -inf off a path),
    and its gradient in the prior's logits and log_qd (exercise 6 may train through it); the inputs
    left as they were; under bfloat16 autocast (float32 inputs, as generate.py --dtype
    bfloat16 gives) to float32's precision. Hint: position i's
    posterior weighs each branch by the drafts before i only (position 0 sees none: its posterior
    is the prior), normalised over the branches."""
    log_prior, log_q, drafts = random_mixture()
    log_qd = drafted(log_q, drafts)
    log_w = harness.assert_inputs_unchanged(
        'posterior', lambda: impl.posterior(log_prior, log_qd),
        "what fits: an in-place op (cumsum into the input, sub_, a slice assigned) on an input, or on .contiguous() "
        "of one that already is (the same tensor)", log_prior=log_prior, log_qd=log_qd)
    assert log_w.shape == (6, 4, 3), f"log w should be (N, n, K) = (6, 4, 3), got {tuple(log_w.shape)}"
    w, _ = brute_force(log_prior, log_q, drafts)
    err = (log_w.exp() - w).abs().max().item()
    if not err < 1e-12:
        raise harness.Fail(f"the posterior differs from the definition by {err:.1e}, want below 1e-12",
                           misread(log_w.exp(), log_prior, log_q, drafts))
    # its gradient, against the definition's in probability space: exercise 6 may train through it (in a
    # handout, dblast.posterior is this one, and exercise 6 may use it)
    g = torch.Generator().manual_seed(8)
    prior_logits = torch.randn(6, 3, generator=g, dtype=torch.float64).requires_grad_()
    qd = log_qd.detach().clone().requires_grad_()
    log_w = impl.posterior(F.log_softmax(prior_logits, -1), qd * 1.0)
    if not (isinstance(log_w, torch.Tensor) and log_w.requires_grad):
        raise harness.Fail("the posterior has no gradient in log_prior and log_qd, want one: exercise 6 trains the "
                           "drafter through it (in a handout dblast.posterior is yours)",
                           "what fits: @torch.no_grad() or @torch.inference_mode() on posterior, or a .detach() in "
                           "it; on conditionals, which decoding alone calls, either decorator is fine")
    weights = torch.rand(6, 4, 3, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((log_w.exp() * weights).sum(), (prior_logits, qd), allow_unused=True)
    before = torch.cat([torch.ones_like(qd[..., :1]), qd.exp().cumprod(-1)[..., :-1]], -1)        # prod_{l<i}
    joint = F.softmax(prior_logits, -1)[..., None] * before                                       # (N, K, n)
    want = torch.autograd.grad(((joint / joint.sum(1, keepdim=True)).transpose(1, 2) * weights).sum(),
                               (prior_logits, qd))
    err = max(math.inf if x is None else (x - y).abs().max().item() for x, y in zip(got, want))
    if not err < 1e-9:
        raise harness.Fail(f"the posterior's gradient in the prior's logits and log_qd differs from the definition's "
                           f"by {err:.1e}, want below 1e-9", "the values are right and the gradient is not: what "
                           "fits is a part of it detached (a shift by a detached max, log_prior or log_qd "
                           ".detach()ed), or no gradient to one input (None)")
    # greedy branches (one-hot q~: log_qd 0 on a branch's path, -inf off it), the drafts along branch (row mod
    # K)'s path: the posterior alone, which a handout's exercise 6 may call (dblast.posterior is this one there)
    paths = log_q.argmax(-1)                                                      # (N, K, n)
    one_hot = torch.full_like(log_q, -math.inf).scatter_(-1, paths.unsqueeze(-1), 0.0)
    along = paths[torch.arange(6), torch.arange(6) % 3]                           # (N, n)
    log_w = impl.posterior(log_prior, drafted(one_hot, along))
    w, _ = brute_force(log_prior, one_hot, along)
    bad = int(torch.isnan(log_w).sum())
    err = (log_w.exp() - w).abs().max().item()
    if bad or not err < 1e-12:
        raise harness.Fail("greedy branches (log q~ -inf off each branch's path), the drafts along one branch's path: "
                           + (f"{bad} of the posterior's {log_w.numel()} entries are NaN" if bad else
                              f"the posterior differs from the definition by {err:.1e}") + ", want exact to 1e-12, "
                           "no NaN", "-inf in log_qd is fine in sums and log_softmax; what fits a NaN is -inf - -inf "
                           "(an exclusive sum as the inclusive cumsum minus its own term, a shift by a value that is "
                           "-inf) or 0 * -inf (a one-hot multiplied in)")
    # against the definition of the float32-rounded inputs: right answers in float32 come within 4e-7 of it
    # (sixteen written), a matmul left to autocast 4e-3 off
    log_w, got = under_autocast(impl.posterior, log_prior, log_qd)
    w, _ = brute_force(log_prior.float().double(), log_q.float().double(), drafts)
    err = (got.exp() - w).abs().max().item()
    if not err < 1e-5:
        raise harness.Fail(f"under bfloat16 autocast (generate.py --dtype bfloat16), float32 inputs: the posterior "
                           f"({str(log_w.dtype)[6:]}) differs from the definition by {err:.1e}, want below 1e-5, "
                           f"float32's own", AUTOCAST)


INPLACE = ("what fits: an in-place op on an input (exp_, masked_fill_ of its -inf, a slice assigned), or on a view "
           "of one or .contiguous() of one that already is (the same tensor)")


def test_the_conditionals_by_enumeration(impl):
    """The conditionals by enumeration. Q_i = sum_z w_{i,z} q~_i(. | z) for sampled branches, and
    for greedy ones (one-hot q~, log 0 = -inf; the drafts along another branch's path in each row):
    a distribution at every position, no NaN, exactly 0 where no branch drafts; for a block of one
    draft (n = 1), with one row and with three; the inputs left as they were; and under bfloat16
    autocast (float32 inputs) to float32's precision.
    Hint: -inf in log q~ is fine in log space (logsumexp, log_softmax); it is 0 * inf that is not."""
    log_prior, log_q, drafts = random_mixture(seed=1)
    Q = harness.assert_inputs_unchanged('conditionals', lambda: impl.conditionals(log_prior, log_q, drafts), INPLACE,
                                        log_prior=log_prior, log_q=log_q, drafts=drafts)
    assert Q.shape == (6, 4, 5), f"Q should be (N, n, V) = (6, 4, 5), got {tuple(Q.shape)}"
    _, want = brute_force(log_prior, log_q, drafts)
    err = (Q - want).abs().max().item()
    if not err < 1e-12:
        # the posteriors of the common misreadings: does one of them give this Q?
        wrong = [log_prior.exp()[:, None].expand(-1, 4, -1), brute_force(log_prior, log_q, drafts, seen=1)[0]]
        hint = next((misread(w, log_prior, log_q, drafts) for w in wrong
                     if (Q - torch.einsum('nik,nkiv->niv', w, log_q.exp())).abs().max() < 1e-9), '')
        raise harness.Fail(f"Q differs from sum_z w_iz q_i(.|z) by {err:.1e}, want below 1e-12", hint)
    # greedy branches: each branch a path, the drafts along branch (row mod K)'s path, so that in most
    # rows branch 0 leaves the drafts (its log q~ -inf there)
    paths = log_q.argmax(-1)                                                      # (N, K, n)
    one_hot = torch.full_like(log_q, -math.inf).scatter_(-1, paths.unsqueeze(-1), 0.0)
    along = paths[torch.arange(6), torch.arange(6) % 3]                           # (N, n)
    Q = harness.assert_inputs_unchanged('greedy branches: conditionals',
                                        lambda: impl.conditionals(log_prior, one_hot, along), INPLACE,
                                        log_prior=log_prior, log_q=one_hot, drafts=along)
    bad = int((~torch.isfinite(Q)).sum())
    assert bad == 0, f"greedy branches: {bad} of Q's {Q.numel()} entries are NaN or inf, want none"
    total = Q.sum(-1)
    assert torch.allclose(total, torch.ones(6, 4, dtype=Q.dtype)), \
        f"greedy branches: Q's rows sum to {total.min().item():.3g}..{total.max().item():.3g}, want 1"
    _, want = brute_force(log_prior, one_hot, along)
    err = (Q - want).abs().max().item()
    assert err < 1e-12, f"greedy branches: Q differs from the posterior mass on each path's token by {err:.1e}, " \
                        f"want below 1e-12"
    stray = int(((want == 0) & (Q != 0)).sum())
    if stray:
        raise harness.Fail(f"greedy branches: Q gives {stray} tokens that no branch drafts there a mass (largest "
                           f"{Q[want == 0].max().item():.1e}), want exactly 0",
                           "Q is the mixture of what the branches draft, nothing more: what fits is a floor (a clamp, "
                           "an epsilon) under Q or under q~, which over a 50,000-token vocabulary is mass no branch "
                           "gives")
    for N in (1, 3):   # a block of one draft (k = 2: generate.py --k 2), for one row and for three
        log_prior, log_q, drafts = random_mixture(N=N, n=1, seed=4)
        Q = impl.conditionals(log_prior, log_q, drafts)
        if tuple(Q.shape) != (N, 1, 5):
            raise harness.Fail(f"a block of one draft (n = 1), {N} row(s): Q has shape {tuple(Q.shape)}, want "
                               f"(N, n, V) = ({N}, 1, 5)", "squeeze() without a dimension drops every dimension of "
                               "size 1: with one draft (k = 2) the positions' too, with one row the rows'; name the "
                               "dimension")
        err = (Q - brute_force(log_prior, log_q, drafts)[1]).abs().max().item()
        assert err < 1e-12, f"a block of one draft (n = 1): Q differs from the prior's mixture by {err:.1e}, " \
                            f"want below 1e-12"
    # under bfloat16 autocast an einsum of float32 tensors comes back in bfloat16 (rows summing to 1 +- 3e-3);
    # the bound as for the posterior
    log_prior, log_q, drafts = random_mixture(seed=1)
    Q, got = under_autocast(impl.conditionals, log_prior, log_q, drafts)
    err = (got - brute_force(log_prior.float().double(), log_q.float().double(), drafts)[1]).abs().max().item()
    if not err < 1e-5:
        raise harness.Fail(f"under bfloat16 autocast (generate.py --dtype bfloat16), float32 inputs: Q "
                           f"({str(Q.dtype)[6:]}) differs from sum_z w_iz q_i(.|z) by {err:.1e}, want below 1e-5, "
                           f"float32's own", AUTOCAST)


def test_no_underflow_over_32_tokens(impl):
    """No underflow over 32 tokens. Drafts each about e^-40 likely (a product of e^-1280, below
    float64's range), beside a row of likely drafts: the posterior and the conditionals stay finite
    and exact; so does the posterior with a branch the prior rules out (log pi' = -inf), and with
    two branches taking turns being the likelier; a draft given e^-150 by one branch and e^-200 by
    the other weighs them e^-50 apart, and e^-1500 against e^-2500, e^-1000. Hint: sums of logs,
    never products, and no floor under a log."""
    n = 32
    log_qd = torch.tensor([[-40.0], [-40.3], [-41.0]], dtype=torch.float64).expand(3, n)[None]   # (1, K=3, n)
    log_pi = torch.log(torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64))
    # beside a row of likely drafts (e^-1 under every branch), so that a shift shared by the rows (a
    # max over the batch) leaves the first row's joint at e^-1200 and below
    likely = torch.full((1, 3, n), -1.0, dtype=torch.float64)
    w = impl.posterior(log_pi.expand(2, 3), torch.cat([log_qd, likely])).exp()
    bad = ~torch.isfinite(w).all(-1).all(0)
    if bad.any():
        raise harness.Fail(f"the posterior underflowed: NaN or inf from position {int(bad.long().argmax())} on, "
                           f"want finite", "what fits: a product of probabilities, or exp taken of log pi' + sum "
                           "log q~ shifted by anything but its own row and position's largest (a max over the "
                           "batch, or over the block): e^-1280 is 0, and 0 / 0 is NaN")
    i = torch.arange(n, dtype=torch.float64)
    want = torch.exp(-0.3 * i) * 0.3 / 0.2                                        # w_1 / w_0 before position i
    got = w[0, :, 1] / w[0, :, 0]
    off = ~torch.isclose(got, want, rtol=1e-9)
    j = int(off.long().argmax())
    if off.any():
        hint = next((h for h, w in ((PRIOR, torch.full_like(want, 1.5)), (OWN_DRAFT, want * math.exp(-0.3)))
                     if torch.allclose(got, w, rtol=1e-9)), '')
        raise harness.Fail(f"position {j}: the posterior ratio of branches 1 and 0 is {got[j].item():.6g}, want "
                           f"{want[j].item():.6g}", hint)
    # the conditionals over the same block: the drafted token at those logs, the rest of each row's
    # mass spread over the other tokens
    V = 5
    log_q = torch.log((1 - log_qd.exp()) / (V - 1))[..., None].expand(1, 3, n, V).clone()
    log_q[..., 0] = log_qd                                                        # every draft is token 0
    Q = impl.conditionals(log_pi, log_q, torch.zeros(1, n, dtype=torch.long))
    w_all = torch.softmax(log_pi[0][None, :] + F.pad(log_qd[0].T.cumsum(0), (0, 0, 1, 0))[:-1], -1)   # (n, K)
    want = torch.einsum('ik,kiv->iv', w_all, log_q[0].exp())[None]
    if not (torch.isfinite(Q).all() and (Q - want).abs().max() < 1e-12):
        bad = ~torch.isfinite(Q).all(-1)[0]
        raise harness.Fail("the conditionals over the same 32 drafts: "
                           + (f"NaN or inf from position {int(bad.long().argmax())} on" if bad.any() else
                              f"off by {(Q - want).abs().max().item():.1e}") + ", want finite and exact to 1e-12",
                           "the posterior inside Q must be normalised in log space too: what fits is exp taken of "
                           "an unnormalised log pi + sum log q~ (e^-1280 is 0), normalised afterwards")
    # a branch the prior rules out (Z_T = 0: log pi' -inf) beside one whose drafts are each e^-41, and
    # two branches that take turns being the likelier (e^-50 against 1): the posterior from the
    # definition, in log space
    for what, log_pi, log_qd in (
            ("a branch the prior rules out (log pi' = -inf)", torch.tensor([[0.0, -math.inf]], dtype=torch.float64),
             torch.tensor([[-41.0, -1e-3]], dtype=torch.float64)[..., None].expand(1, 2, n)),
            ("two branches taking turns (e^-50 against 1)", torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)),
             torch.where(torch.arange(n) % 2 == torch.arange(2)[:, None], -50.0, 0.0).double()[None])):
        want = F.log_softmax(log_pi[0][None, :] + F.pad(log_qd[0].T.cumsum(0), (0, 0, 1, 0))[:-1], -1)   # (n, K)
        got = impl.posterior(log_pi, log_qd)[0].exp()
        if not (torch.isfinite(got).all() and (got - want.exp()).abs().max() < 1e-12):
            raise harness.Fail(f"{what}, 32 drafts: the posterior is "
                               + ("NaN or inf in places" if not torch.isfinite(got).all() else
                                  f"off by {(got - want.exp()).abs().max().item():.1e}") + ", want finite and exact "
                               "to 1e-12", "what fits: a shift by one branch's value (or a max over positions) that "
                               "is -inf or far off for some rows (-inf - -inf is NaN), or the prior multiplied in "
                               "after a shift that did not count it")
    # a draft far below the others: log q~ of -150 and -200 weighs the branches e^-50 apart, no less
    deep = impl.posterior(torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)),
                          torch.tensor([[[-150.0, -1.0], [-200.0, -1.0]]], dtype=torch.float64))
    want = torch.tensor([1.0, math.exp(-50.0)], dtype=torch.float64) / (1 + math.exp(-50.0))
    if not (deep.exp()[0, 1] - want).abs().max() < 1e-12:
        raise harness.Fail(f"two branches, the first draft given e^-150 and e^-200: the posterior after it is "
                           f"{deep.exp()[0, 1].tolist()}, want {want.tolist()}", "what fits: a floor under log q~ "
                           "(a clamp, or an epsilon added to a probability) that turns both into the same number")
    deeper = impl.posterior(torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64)),
                            torch.tensor([[[-1500.0, -1.0], [-2500.0, -1.0]]], dtype=torch.float64))
    if not (deeper[0, 1].exp() - torch.tensor([1.0, 0.0], dtype=torch.float64)).abs().max() < 1e-12:
        raise harness.Fail(f"two branches, the first draft given e^-1500 and e^-2500 (a low temperature's): the "
                           f"posterior after it is {deeper[0, 1].exp().tolist()}, want [1, e^-1000 (0 in float64)]",
                           "what fits: a floor under log q~ (a clamp at -1000, say) that turns both into the same "
                           "number")


def test_no_host_sync(impl):
    """No host sync, no Python loop, no tensor on another device, nothing kept. posterior and
    conditionals make the host wait for nothing, dispatch as many ops for 8 or 200 rows, 6 positions,
    5 branches or 9 or 9,000 tokens as for 4 rows of 3 positions, 3 branches and 5 tokens, make no
    tensor off their inputs' device (run on PyTorch's 'meta' device, which refuses a mix of devices
    as CUDA does), and five calls of each keep no more of the tensors they make, nor more bytes,
    than one call (they run at every step decoded)."""
    log_prior, log_q, drafts = random_mixture(seed=2)
    log_qd = drafted(log_q, drafts)
    # each alone: a conditionals that does not call posterior leaves the posterior's syncs unseen
    for what, call in (('posterior', lambda: impl.posterior(log_prior, log_qd)),
                       ('conditionals', lambda: impl.conditionals(log_prior, log_q, drafts))):
        with harness.HostSyncs() as syncs:
            call()
        if syncs.seen:
            raise harness.Fail(f"{what}: host syncs: {', '.join(sorted(set(syncs.seen)))}, want none",
                               "the ops listed make the host wait for the device: a value read back (.item(), a "
                               "Python if on a tensor) or a shape that depends on the data (boolean indexing, "
                               "nonzero)")
    sizes = [(f'N={N}, n={n}, K={K}, V={V}', random_mixture(N=N, n=n, K=K, V=V, seed=3))
             for N, n, K, V in ((4, 3, 3, 5), (8, 3, 3, 5), (4, 6, 3, 5), (4, 3, 5, 5), (4, 3, 3, 9), (200, 3, 3, 5),
                                (4, 3, 3, 9000))]
    harness.assert_no_python_loop('conditionals', [(size, lambda m=m: impl.conditionals(*m)) for size, m in sizes])
    harness.assert_no_python_loop('posterior', [(size, lambda m=m: impl.posterior(m[0], drafted(*m[1:])))
                                                for size, m in sizes])

    def posterior_of(i):
        log_prior, log_q, drafts = random_mixture(seed=20 + i)
        return impl.posterior(log_prior, drafted(log_q, drafts))
    harness.assert_keeps_nothing('posterior', posterior_of)
    harness.assert_keeps_nothing('conditionals', lambda i: impl.conditionals(*random_mixture(seed=30 + i)))
    log_prior, log_q, drafts = (harness.on_meta(t) for t in (log_prior, log_q, drafts))
    log_qd = drafted(log_q, drafts)
    harness.assert_on_the_inputs_device('posterior', lambda: impl.posterior(log_prior, log_qd))
    harness.assert_on_the_inputs_device('conditionals', lambda: impl.conditionals(log_prior, log_q, drafts))


def test_torch_settings_left_as_they_were(impl):
    """torch's settings left as they were. A call of posterior or of conditionals changes none of
    torch's process-wide settings: the global RNG (torch.manual_seed), grad mode
    (torch.set_grad_enabled as a statement), the default dtype, anomaly detection, deterministic
    algorithms, TF32 and the float32 matmul precision. The DBlast drafter calls conditionals at
    every step, before the step's draws: decode.generate with generator=None draws from the global
    RNG, whose reset at every step would repeat the same draws step after step. A student.py that
    changes one while it loads fails every check."""
    log_prior, log_q, drafts = random_mixture(seed=2)
    log_qd = drafted(log_q, drafts)
    harness.assert_leaves_torch_alone('posterior', lambda: impl.posterior(log_prior, log_qd))
    harness.assert_leaves_torch_alone('conditionals', lambda: impl.conditionals(log_prior, log_q, drafts))


def test_lossless_through_generate(impl):
    """Lossless through decode.generate. A K = 4 DBlast drafter with sampled branches (Z_T = 1,
    T = 1.3) and greedy branches (Z_T = 0.5, T = 0.8), verified against your Q: every 3-token
    continuation comes out with the target's probability (chi-square, 20,000 samples).
    Hint: the drafts were drawn from the branch z ~ pi'; Q must weigh the branches by pi' too; the
    checks above test the posterior and Q alone, and say which is off."""
    model = harness.target8()
    for sample_drafts, zt, T in ((True, 1.0, 1.3), (False, 0.5, 0.8)):
        d = harness.peaky(DBlastDrafter(model.config, 4, 4, sample_drafts=sample_drafts, zt=zt), 0.3, 2)
        with torch.no_grad():   # sharper branches: the drafts say much about z
            d.block.ln.weight.mul_(4.0)
        harness.assert_lossless(model, d, T, what=f"{'sampled' if sample_drafts else 'greedy'} branches: ")


def try_it(impl, tryout):
    """train.py's DBlast K = 4 drafter at T = 1.5 with your posterior and conditionals, sampled and
    greedy branches, next to the reference (in a handout, the target alone), with a chi-square
    p-value of the second token."""
    d = tryout.drafter('dblast_K4.pt')
    rows = []
    for sample_drafts in (True, False):
        d.sample_drafts = sample_drafts
        rows += tryout.pair(f"{'sampled' if sample_drafts else 'greedy'} branches", 1.5, p_value=True, drafter=d)
    d.sample_drafts = True
    tryout.table(rows, extra=[('p-value, 2nd token (4000 decodes)', 'p')])
