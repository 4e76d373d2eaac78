"""The exercises' checks on answers the negative controls of exercises/solutions/ (which
tests/test_exercises.py runs) do not cover: a tensor made off the inputs' device, in every exercise
whose controls have none, and exercise 8's layout moved there from the host; right drafters of other designs than the reference's, which exercise 7's
training checks must pass whatever their initialisation; hints that name no op of the answer; and
`try` announcing only the rows it prints."""
import ast
import functools
import math
import os
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import in_process
from exercises import harness
from exercises.__main__ import main as exercises_main

HAVE_SOLUTIONS = all(harness.solution_path(n) for n in harness.exercises())
needs_solutions = pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout: exercises/solutions/ was removed")


def verify_greedy_off_device(logits, drafts, accept):
    rule, param = accept
    ok = rule(logits, drafts, param)
    n = drafts.size(1)
    at = torch.arange(n)                                        # no device=: the CPU's
    n_acc = torch.where(ok, n, at).min(-1).values
    return at < n_acc[:, None], n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)


def write_off_device(cache, layer_idx, k, v, pos):
    shift = torch.zeros(1, 1, 1, 1, dtype=torch.long)           # no device=
    idx = pos[:, None, :, None].expand(-1, k.size(1), -1, k.size(3)) + shift
    cache.k[layer_idx].scatter_(2, idx, k.to(cache.k.dtype))
    cache.v[layer_idx].scatter_(2, idx, v.to(cache.v.dtype))
    return cache.k[layer_idx], cache.v[layer_idx]


def typical_off_device(logits, drafts, param):
    epsilon, delta = param
    p = F.softmax(logits[:, :-1].double(), -1)
    H = -torch.special.xlogy(p, p).sum(-1)
    bar = torch.minimum(torch.full(H.shape, epsilon, dtype=H.dtype), delta * torch.exp(-H))   # no device=
    return p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > bar


def posterior_off_device(log_prior, log_qd):
    start = torch.zeros(log_qd.shape[:-1] + (1,), dtype=log_qd.dtype)                       # no device=
    before = torch.cat([start, log_qd.cumsum(-1)[..., :-1]], -1)
    return F.log_softmax(log_prior.unsqueeze(-1) + before, dim=1).transpose(1, 2)


def tree_layout_moved_from_the_host(K, n, device):
    depth = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(1, n + 1).repeat(K)]).to(device)   # a copy
    branch = torch.cat([torch.tensor([-1]), torch.arange(K).repeat_interleave(n)]).to(device)
    attend = (branch[None, :] == -1) | ((branch[:, None] == branch[None, :]) & (depth[None, :] <= depth[:, None]))
    return depth, attend


def al_surrogate_off_device(a, nll, tau_threshold):
    floor = torch.full(a.shape, math.log(tau_threshold) if tau_threshold > 0 else -math.inf)   # no device=
    keep = a.detach() >= floor
    tail = torch.logcumsumexp(a.flip(-1), -1).flip(-1)
    n_keep = keep.sum(-1)
    return torch.where(n_keep > 0, -torch.where(keep, tail, 0.0).sum(-1) / n_keep.clamp(min=1), nll)


OFF_DEVICE = [(1, 'verify_greedy', verify_greedy_off_device, 'test_no_host_sync'),
              (3, 'write', write_off_device, 'test_no_host_sync'),
              (4, 'typical', typical_off_device, 'test_no_host_sync'),
              (5, 'posterior', posterior_off_device, 'test_no_host_sync'),
              (6, 'al_surrogate', al_surrogate_off_device, 'test_no_tensor_on_another_device'),
              (8, 'tree_step.tree_layout', tree_layout_moved_from_the_host, 'test_no_host_sync')]


@needs_solutions
@pytest.mark.parametrize('n,name,wrong,check', OFF_DEVICE, ids=[f"{n}-{wrong.__name__}" for n, _, wrong, _ in OFF_DEVICE])
def test_a_tensor_made_off_the_device_fails_on_a_cpu(n, name, wrong, check, monkeypatch):
    """Right on a CPU, an error on a GPU (or, moved there by .to(), a copy from the host that waits
    for the GPU): the device check fails it on a CPU, naming the op and the line; the other checks
    pass it (it is right otherwise)."""
    checks = harness.checks_of(n)
    impl = harness.implementation(n, 'solution')
    if '.' in name:                 # a helper of the function the checks call, in the solution's module
        called, helper = name.split('.')
        monkeypatch.setitem(getattr(impl, called).__globals__, helper, wrong)
    else:
        setattr(impl, name, wrong)  # (exercise 5's conditionals calls the posterior plugged into dblast)
    r = harness.run_check(checks, impl, check, getattr(checks, check))
    assert not r.passed and 'made a tensor on the CPU' in r.reason and 'want every tensor' in r.reason, r.reason


def test_the_device_check_sees_copies_between_the_host_and_the_device():
    """harness.MadeOnCpu's copies (on CUDA each waits for the GPU, and a CUDA graph cannot hold it):
    a list or a number made a tensor on the device, or a tensor copied to the CPU, fails; a 0-dim
    tensor on the host does not, nor one filled on the device, nor a table copied at the first call
    and kept; training code (copies=False) may copy,
    though not mix the devices."""
    x = torch.zeros(3, device='meta')
    for copy, needle in ((lambda: x + torch.tensor([1.0, 2.0, 3.0], device=x.device), 'torch.tensor of Python data'),
                         (lambda: x + torch.as_tensor((1.0, 2.0, 3.0), device=x.device), 'torch.as_tensor'),
                         (lambda: x + x.new_tensor([1.0, 2.0, 3.0]), 'Tensor.new_tensor'),
                         (lambda: x.to('cpu'), 'copied to the CPU'),
                         (lambda: x + torch.arange(3.0).to(x.device), 'made a tensor on the CPU')):
        with pytest.raises(harness.Fail, match=needle):
            harness.assert_on_the_inputs_device('f', copy)
        if needle != 'copied to the CPU':
            harness.assert_on_the_inputs_device('f', copy, copies=False)
    with pytest.raises(harness.Fail, match='torch.tensor of Python data'):     # a number too: copied over
        harness.assert_on_the_inputs_device('f', lambda: x + torch.tensor(1.0, device=x.device))
    harness.assert_on_the_inputs_device('f', lambda: x + torch.tensor(1.0))                # a number on the host
    harness.assert_on_the_inputs_device('f', lambda: x + torch.full((), 1.0, device=x.device))   # filled there
    table = functools.lru_cache(lambda device: torch.tensor([1.0, 2.0, 3.0], device=device))
    harness.assert_on_the_inputs_device('f', lambda: x + table(x.device))   # copied once, and kept
    with pytest.raises(harness.Fail, match='made a tensor on the CPU'):
        harness.assert_on_the_inputs_device('f', lambda: x + torch.arange(3.0), copies=False)


def test_the_host_sync_check_lets_repeat_interleave_given_its_output_size_through():
    """repeat_interleave learns its output's size by reading the repeats back (a host sync), unless
    output_size says it (torch's documentation: "it will avoid stream synchronization")."""
    repeats = torch.tensor([1, 2, 0])
    for output_size, seen in ((None, True), (3, False)):
        with harness.HostSyncs() as syncs:
            torch.arange(3).repeat_interleave(repeats, output_size=output_size)
        assert bool(syncs.seen) == seen, syncs.seen


def other_designs():
    """{name: a right drafter of another design than the reference's}."""
    from heads import Drafter
    from model import tempered, upcast
    solution = harness.load_file(harness.solution_path(7), 'exercise07_solution_designs')

    class RotatedDrafter(solution.MyDrafter):
        """The reference with the bonus's embedding turned by a fixed random rotation first, and a
        random draw more in __init__ than the reference makes (another initialisation)."""

        def __init__(self, config, k, sample_drafts=True):
            torch.rand(1)
            super().__init__(config, k, sample_drafts)
            self.register_buffer('turn', torch.linalg.qr(torch.randn(config.n_embd, config.n_embd))[0])

        def logits(self, h, bonus, target, n):
            u = self.w_in(torch.cat([h, target.transformer.wte(bonus) @ self.turn.to(h.dtype)], -1))
            return self.heads_logits(u, self.heads[:n], target)

    class TanhDrafter(solution.MyDrafter):
        """One linear map of [h; E(bonus)] and a tanh per head, then the target's unembedding: it
        cannot be as sharp as the target (the reference's draft and loss on these logits)."""

        def __init__(self, config, k, sample_drafts=True):
            Drafter.__init__(self)
            self.k, self.sample_drafts = k, sample_drafts
            self.heads = nn.ModuleList(nn.Linear(2 * config.n_embd, config.n_embd) for _ in range(k - 1))

        def logits(self, h, bonus, target, n):
            u = torch.cat([h, target.transformer.wte(bonus)], -1)
            return upcast(target.lm_head(torch.stack([torch.tanh(head(u)) for head in self.heads[:n]], 1)))

    class SmoothedDrafter(solution.MyDrafter):
        """The reference with a label-smoothed loss: a little flatter than the target's samples, and
        yet the temperature applied once in loss and draft alike."""

        def loss(self, h, bonus, target, x, temperature=1.0):
            logits = self.logits(h, bonus, target, x.size(1))
            return F.cross_entropy(tempered(logits, temperature).flatten(0, 1), x.flatten(), label_smoothing=0.1)

    return {'rotated': RotatedDrafter, 'tanh': TanhDrafter, 'smoothed': SmoothedDrafter}


@needs_solutions
@pytest.mark.slow
@pytest.mark.second_process   # on the other core (conftest.py)
@pytest.mark.parametrize('design', ['rotated', 'tanh', 'smoothed'])
def test_exercise_7_trains_right_drafters_of_other_designs(design):
    """Exercise 7's training checks pass right drafters other than the reference: one initialised
    otherwise, one that cannot be as sharp as the target (which a sharpness measured against the
    target's own p_T refuses), one trained with label smoothing."""
    checks = harness.checks_of(7)
    impl = types.SimpleNamespace(MyDrafter=other_designs()[design], which=design)
    for name in ('test_training_beats_a_uniform_drafter', 'test_it_proposes_what_its_loss_trains'):
        r = harness.run_check(checks, impl, name, getattr(checks, name))
        assert r.passed, f"{design}: {r.title}: {r.reason}"


DICTATED = {1: ('cumprod', 'cumulative product', 'gather'), 2: ('cumprod', 'cumulative product', 'gather', 'scatter')}


def hint_texts(checks_path):
    """Every string of a checks.py a student reads as a hint: its checks' 'Hint:' paragraphs, what
    each harness.Fail carries as its hint, and what is assigned to a name with 'hint' in it."""
    tree = ast.parse(open(checks_path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith('test_'):
            found.append((ast.get_docstring(node) or '').partition('Hint:')[2])
        parts = node.args[1:] if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'Fail' else \
            [node.value] if isinstance(node, ast.Assign) and any('hint' in getattr(t, 'id', '').lower()
                                                                 for t in node.targets) else []
        found += [c.value for part in parts for c in ast.walk(part)
                  if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return found


@pytest.mark.parametrize('n', sorted(DICTATED))
def test_the_hints_of_exercises_1_and_2_name_no_op_of_the_answer(n):
    """Their hints say what is wrong, not how to write it: the ops the answer is made of are named
    nowhere a student reads a hint (the statement's hints, the checks' hints, student.py)."""
    folder = os.path.join(harness.HERE, harness.exercises()[n])
    readme = open(os.path.join(folder, 'README.md')).read()
    texts = [readme[readme.index('## Hints'):readme.index('## The checks')],
             open(os.path.join(folder, 'student.py')).read()] + hint_texts(os.path.join(folder, 'checks.py'))
    for text in texts:
        for op in DICTATED[n]:
            assert op not in text.lower(), f"exercise {n}: a hint names {op!r}: {text[:200]}"


@pytest.mark.parametrize('n,paired', [(1, True), (6, False), (7, False)])
def test_try_announces_only_the_rows_it_prints(n, paired):
    """`try N` says first what it sets your rows beside: the reference's rows for exercises that
    pair them, nothing of the kind for 6 and 7, which print their own rows (a missing checkpoint
    then stops it: the announcement comes first)."""
    code, out, err = in_process(lambda: exercises_main(['try', str(n), '--out-dir', '/nonexistent/out']))
    assert code == 2 and 'python train.py' in err, err
    announced = out.strip().splitlines()[0]
    assert (("the reference's rows" in announced or 'the target alone' in announced) == paired), announced


def test_tie_order_breaks_only_the_ties_left_unspecified():
    """harness.TieOrder (exercise 9's check 3): a sort without stable=True and a top-k break ties
    first index first, or last first; a stable sort and the values are left as they are."""
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    for last, want in ((False, [1, 2, 4, 0, 3]), (True, [4, 2, 1, 0, 3])):
        with harness.TieOrder(last):
            assert x.sort(dim=-1, descending=True).indices.tolist() == [want]
            assert torch.argsort(x, descending=True).tolist() == [want]
            top = x.topk(3)
            assert top.indices.tolist() == [want[:3]] and top.values.tolist() == [[2.0, 2.0, 2.0]]
            assert x.sort(stable=True, descending=True).indices.tolist() == [[1, 2, 4, 0, 3]]
            assert x.sort(dim=-1).values.tolist() == [[0.0, 1.0, 2.0, 2.0, 2.0]]
            assert x.t().sort(dim=0, descending=True).indices.t().tolist() == [want]


@pytest.mark.slow
def test_exercise_7s_conformance_checks_pass_the_projects_heads():
    """Exercise 7's statement says its conformance checks (1-3, 5 and 6) pass the project's own BPD
    heads (heads.BlockHeads) too."""
    from heads import BlockHeads
    checks = harness.checks_of(7)
    impl = types.SimpleNamespace(MyDrafter=BlockHeads, which='heads.BlockHeads')
    for name in ('test_the_contract', 'test_no_host_sync', 'test_q_is_what_the_drafts_were_drawn_from',
                 'test_greedy_output_is_plain_greedy', 'test_sampling_is_lossless'):
        r = harness.run_check(checks, impl, name, getattr(checks, name))
        assert r.passed, f"heads.BlockHeads: {r.title}: {r.reason}"
