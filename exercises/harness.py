"""
What every exercise shares: finding a student's code or the reference, plugging it into the
project's seams for the length of a check, running the checks and saying why one failed, the
small worlds and statistics the checks are built from, and the watches that hold code run on a
CPU to what a GPU asks (host syncs, allocations, tensors made off the inputs' device).

An exercise is a folder NN_name/ with README.md (the task), student.py (the stubs) and checks.py.
checks.py names what the student writes (NAMES), where the project calls it (SEAMS: 'module.attr'
-> name), the reference when it is the project's own code (REFERENCE: name -> 'module.attr'; else
exercises/solutions/NN_name.py), the rest of the answer a handout leaves out (STUBS) and what the
student may use (MAY_USE; exercises/handout.py), and the checks: functions test_*(impl), written
once, run against whichever implementation `impl` holds. exercises/solutions/NN_name.py also holds
CONTROLS: plausible wrong answers ({what is wrong: {name: function}}) that the checks must catch.
"""
import copy
import gc
import importlib
import importlib.util
import itertools
import math
import os
import sys
import time
import traceback
import types
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from cli import BadInput, first_line  # noqa: E402
from data import (PROMPT_LEN, heldout_prompts, load_checkpoint, load_dataset, newline_id, target_from,  # noqa: E402
                  vocab_for)
from decode import generate  # noqa: E402
from drafters import load_drafter  # noqa: E402
from heads import Drafter  # noqa: E402
from model import GPT, GPTConfig, upcast  # noqa: E402
import train  # noqa: E402

ALPHA = 1e-5   # a statistical check fails a correct answer by chance once in 100,000 runs


# ----------------------------------------------------------------------------- finding the code

def exercises():
    """{number: folder name} of every exercise, NN_name."""
    names = sorted(d for d in os.listdir(HERE) if d[:2].isdigit() and os.path.isdir(os.path.join(HERE, d)))
    return {int(d[:2]): d for d in names}


def load_file(path, name):
    """The Python file at `path` as a module called `name` (exercise folders are not packages).
    SettingsChanged if loading it changed one of torch's process-wide settings (put back)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    before = torch_settings()
    spec.loader.exec_module(module)
    changed = settings_changed(before)
    if changed:
        raise SettingsChanged(left_changed(os.path.basename(path), changed + ', at import'))
    return module


# ----------------------------------------------------------------------------- torch's process-wide settings
# What one line can switch for the whole process and leave switched: everything the program runs after it
# (the project's decoding and training, the caller's own code) then runs under it. Code under test that
# sets one as a statement (torch.set_grad_enabled(False) rather than `with torch.no_grad():`,
# torch.set_default_dtype, torch.use_deterministic_algorithms, TF32 switched on) changes code it was never
# asked to touch. run_check reads them before and after each check, and load_file around an import: a
# change fails the check (at import, every check) and is put back.

def backend_flag(path, attr):
    """(read, write) of torch.backends.<path>.<attr>."""
    def owner():
        obj = torch.backends
        for part in path.split('.'):
            obj = getattr(obj, part)
        return obj
    return (lambda: getattr(owner(), attr)), (lambda value: setattr(owner(), attr, value))


# what -> (read, write), put back in this order. The float32 matmul precision is read through the legacy
# settings alone: each of them writes the newer fp32_precision ones too, which can change without changing
# what they mean (set_float32_matmul_precision('highest') writes 'ieee' where 'none' meant the same), and
# TF32 switched on through those changes a legacy reading (or makes it fail: a mix of the two APIs)
SETTINGS = {
    'the default dtype (torch.set_default_dtype)': (torch.get_default_dtype, torch.set_default_dtype),
    'the default device (torch.set_default_device)': (torch.get_default_device, torch.set_default_device),
    'grad mode (torch.set_grad_enabled called, not used as a context)': (torch.is_grad_enabled,
                                                                         torch.set_grad_enabled),
    'deterministic algorithms (torch.use_deterministic_algorithms)': (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
    'anomaly detection (torch.autograd.set_detect_anomaly)': (
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        lambda value: torch.autograd.set_detect_anomaly(*value)),
    'the float32 matmul precision (torch.set_float32_matmul_precision)': (torch.get_float32_matmul_precision,
                                                                          torch.set_float32_matmul_precision),
    'TF32 in CUDA matmuls (torch.backends.cuda.matmul.allow_tf32)': backend_flag('cuda.matmul', 'allow_tf32'),
    'TF32 in cuDNN (torch.backends.cudnn.allow_tf32)': backend_flag('cudnn', 'allow_tf32'),
    **{f'torch.backends.cuda.matmul.{a}': backend_flag('cuda.matmul', a)
       for a in ('allow_fp16_reduced_precision_reduction', 'allow_bf16_reduced_precision_reduction')},
    **{f'torch.backends.cudnn.{a}': backend_flag('cudnn', a) for a in ('enabled', 'benchmark', 'deterministic')},
    **{f'torch.backends.cuda.enable_{kind}_sdp': (getattr(torch.backends.cuda, f'{kind}_sdp_enabled'),
                                                   getattr(torch.backends.cuda, f'enable_{kind}_sdp'))
       for kind in ('flash', 'mem_efficient', 'math')},
}
SETTINGS_HINT = ("a process-wide setting of torch changed by your code stays changed for everything the program runs "
                 "after it (the project's decoding and training, the caller's code): torch.set_grad_enabled(False) "
                 "called rather than used as a context (`with torch.no_grad():` or the @torch.no_grad() decorator put "
                 "it back), torch.set_default_dtype, torch.use_deterministic_algorithms, "
                 "torch.set_float32_matmul_precision or allow_tf32 (generate.py --tf32 chooses TF32), "
                 "torch.autograd.set_detect_anomaly, torch.set_default_device. Leave them as the caller has them, at "
                 "import as in a call")


class SettingsChanged(Exception):
    """A file changed torch's process-wide settings while it loaded (they are put back)."""


def torch_settings():
    """{what: value} of every setting of SETTINGS (a reading that fails is kept as its error)."""
    values = {}
    for what, (read, _) in SETTINGS.items():
        try:
            values[what] = read()
        except Exception as e:                      # torch refusing a mix of the legacy and new TF32 APIs
            values[what] = f"unreadable ({type(e).__name__})"
    return values


def settings_changed(before):
    """'' if every setting is as in `before` (torch_settings()), else the first that changed, with its
    value before and after; every one that changed is put back."""
    now = torch_settings()
    changed = [what for what in SETTINGS if now[what] != before[what]]
    for what in changed:
        if not str(before[what]).startswith('unreadable'):
            try:
                SETTINGS[what][1](before[what])
            except Exception:
                pass
    changed.sort(key=lambda what: str(now[what]).startswith('unreadable'))     # a readable one to name first
    return f"{changed[0]}, from {before[changed[0]]} to {now[changed[0]]}" if changed else ''


def left_changed(who, changed):
    """The reason a check fails for: `who` changed a setting (settings_changed's description)."""
    return (f"{who} changed {changed} and left it so (put back); want torch's process-wide settings as the caller "
            f"had them")


def assert_leaves_torch_alone(what, call, hint=''):
    """call() once: Fail if it left one of torch's process-wide settings changed (SETTINGS: put back), or
    moved the CPU's global RNG (torch.manual_seed, or a draw without a generator, inside the call). Code
    that draws nothing, or only from the generator it is given, leaves the caller's random stream alone:
    one that reseeds it repeats every later draw of the program. Returns what call() returned."""
    before = torch_settings()
    with torch.random.fork_rng(devices=[]):      # the caller's RNG as it was, afterwards
        torch.manual_seed(20240601)
        torch.rand(3)                             # a state that no torch.manual_seed leaves
        state = torch.get_rng_state()
        try:
            out = call()
        finally:
            changed = settings_changed(before)
        moved = not torch.equal(torch.get_rng_state(), state)
    if changed:
        raise Fail(left_changed(what, changed), SETTINGS_HINT)
    if moved:
        raise Fail(f"{what} changed the state of the global RNG (torch.manual_seed, or a draw from it, inside the "
                   f"call); want it as the caller left it", hint or (
                       "this function has nothing to draw from the global RNG: a torch.manual_seed (or "
                       "torch.seed) inside it reseeds the caller's random stream at every step, so every later "
                       "draw of the program (a sampled decode with generator=None, a dropout in training) "
                       "repeats; seed where the program starts, or pass a torch.Generator"))
    return out


@lru_cache
def checks_of(n):
    """Exercise n's checks.py, loaded once (what the checks cache, such as a trained world, stays)."""
    return load_file(os.path.join(HERE, exercises()[n], 'checks.py'), f'exercise{n:02d}_checks')


def solution_path(n):
    path = os.path.join(HERE, 'solutions', exercises()[n] + '.py')
    return path if os.path.isfile(path) else None


def resolve(dotted):
    """'verification.verify_greedy' -> the object; 'model.KVCache.commit' -> the class's function."""
    module, *attrs = dotted.split('.')
    obj = importlib.import_module(module)
    for a in attrs:
        obj = getattr(obj, a)
    return obj


class NotLoaded(Exception):
    """student.py could not be loaded (a syntax error, a failed import, a name it does not define):
    every check fails with this one line."""


def student_path(n):
    return os.path.join(HERE, exercises()[n], 'student.py')


def load_student(n):
    """Exercise n's student.py as a module, or NotLoaded saying in one line why it is not one."""
    path = student_path(n)
    try:
        return load_file(path, f'exercise{n:02d}_student')
    except SettingsChanged as e:
        raise NotLoaded(str(e)) from None
    except SyntaxError as e:      # raised while compiling: no frame of the file, but its own line
        raise NotLoaded(f"student.py does not load: {type(e).__name__}: {e.msg} "
                        f"({os.path.basename(e.filename or path)} line {e.lineno})") from None
    except SystemExit as e:
        raise NotLoaded(f"student.py called sys.exit({e.code!r}) while loading{where_in_student(e)}") from None
    except Exception as e:
        raise NotLoaded(f"student.py does not load: {type(e).__name__}: {first_line(e)}{where_in_student(e)}") from None


def implementation(n, which='student'):
    """What the checks run against: 'student' (student.py), 'solution' (the reference), or the name
    of a negative control (the reference with a plausible wrong answer in place)."""
    checks = checks_of(n)
    if which == 'student':
        student = load_student(n)
        missing = [name for name in checks.NAMES if not hasattr(student, name)]
        if missing:
            raise NotLoaded(f"student.py defines no {missing[0]} (the checks call {', '.join(checks.NAMES)})")
        return types.SimpleNamespace(**{name: getattr(student, name) for name in checks.NAMES}, which=which)
    solution = solution_path(n)
    if solution is None:
        raise FileNotFoundError(f"no exercises/solutions/{exercises()[n]}.py (this is a handout without solutions)")
    solution = load_file(solution, f'exercise{n:02d}_solution')
    ref = {name: resolve(dotted) for name, dotted in getattr(checks, 'REFERENCE', {}).items()}
    ref.update({name: getattr(solution, name) for name in checks.NAMES if name not in ref})
    if which != 'solution':
        ref.update(solution.CONTROLS[which])
    return types.SimpleNamespace(**ref, which=which)


def controls(n):
    """The names of exercise n's negative controls."""
    return list(load_file(solution_path(n), f'exercise{n:02d}_solution').CONTROLS)


MISSING = object()


@contextmanager
def plugged(checks, impl):
    """The project calls impl's code at its seams for the length of the block. checks.SEAMS maps
    'module.attr' (or 'module.TABLE[key]', an entry of a table) to a name of impl, or to a tuple of
    names (the entry becomes the tuple of those objects)."""
    saved = []
    try:
        for target, names in getattr(checks, 'SEAMS', {}).items():
            value = tuple(getattr(impl, n) for n in names) if isinstance(names, tuple) else getattr(impl, names)
            if target.endswith(']'):
                table, key = target[:-1].split('[')
                owner = resolve(table)
                saved.append((owner, key, owner.get(key, MISSING), True))
                owner[key] = value
            else:
                owner, attr = target.rsplit('.', 1)
                owner = resolve(owner)
                saved.append((owner, attr, getattr(owner, attr), False))
                setattr(owner, attr, value)
        yield
    finally:
        for owner, key, value, item in reversed(saved):
            if not item:
                setattr(owner, key, value)
            elif value is MISSING:
                del owner[key]
            else:
                owner[key] = value


# ----------------------------------------------------------------------------- running checks

@dataclass
class Result:
    name: str          # the check's function name
    title: str         # the first line of its docstring
    passed: bool
    reason: str        # why it failed, one line ('' when it passed)
    hint: str          # the hint of the Fail raised, else the 'Hint:' paragraph of its docstring
    seconds: float
    not_written: bool = False   # failed on a NotImplementedError


class Fail(AssertionError):
    """A check's failure that carries its own hint. Where one check has several causes, the
    docstring's one 'Hint:' would mislead for some of them: raise Fail(reason, hint) at the place
    that knows which cause it saw, and run_check prints that hint instead. reason is one line, with
    what was expected beside what was found."""

    def __init__(self, reason, hint=''):
        super().__init__(reason)
        self.hint = hint


def check_functions(checks):
    return [(name, fn) for name, fn in vars(checks).items() if name.startswith('test_') and callable(fn)]


def docstring_parts(fn):
    """A check's title (the first sentence of its docstring) and hint (its 'Hint:' paragraph)."""
    doc = ' '.join((fn.__doc__ or '').split())
    body, _, hint = doc.partition('Hint:')
    title = body.split('. ')[0].rstrip('.') or fn.__name__
    return title, hint.strip()


def student_lineno(frames):
    """The line of the innermost of these frames that lies in a student's file, or None."""
    lines = [f.lineno for f in frames if os.path.basename(f.filename) == 'student.py']
    return lines[-1] if lines else None


def where_in_student(exc):
    """' (student.py line N)' if the exception was raised inside a student's file, else ''."""
    line = student_lineno(traceback.extract_tb(exc.__traceback__))
    return f" (student.py line {line})" if line else ''


def raised_by_a_stub(exc):
    """Whether a NotImplementedError comes from a `raise` in Python outside torch (a stub, or code a
    student left unwritten), not from an op torch lacks for a dtype or a device (which says so in
    the same type: bincount of floats, say)."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    return last is None or ((last.line or '').lstrip().startswith('raise')
                            and f'{os.sep}torch{os.sep}' not in last.filename)


VIEW_HINT = (".view() reads the memory as it lies, so it fails on a tensor that is not laid out as the new shape "
             "reads it; the project passes some inputs as it keeps them: the drafts as the block's slice "
             "block[:, 1:], a cache write's keys and values as transposed thirds of one projection. What fits: "
             ".reshape() or .flatten(), which copy only where they must")


def run_check(checks, impl, name, fn):
    title, hint = docstring_parts(fn)
    t0 = time.perf_counter()
    reason, not_written = '', False
    settings = torch_settings()
    try:
        with plugged(checks, impl):
            fn(impl)
    except NotImplementedError as e:
        if raised_by_a_stub(e):
            reason, not_written = f"not written yet: {e or 'NotImplementedError'}", True
        else:                # an op torch does not have for what it was given
            reason = f"NotImplementedError: {first_line(e)}{where_in_student(e)}"
    except AssertionError as e:
        reason = first_line(e, 'an assertion failed', limit=None)
        hint = getattr(e, 'hint', '') or hint     # a Fail knows its cause better than the docstring
    except SystemExit as e:  # sys.exit in the code under test ends the check, never the run
        reason, hint = f"SystemExit: the code under test called sys.exit({e.code!r}){where_in_student(e)}", ''
    except Exception as e:   # the code under test crashed: say what and where
        reason = f"{type(e).__name__}: {first_line(e)}{where_in_student(e)}"
        if 'view size is not compatible' in str(e):   # the docstring's hint is about the answer, not its layout
            hint = VIEW_HINT
    changed = settings_changed(settings)          # put back, whatever the check's verdict
    if changed and not not_written:               # the cause of whatever else went wrong after it
        reason, hint = left_changed('the code under test', changed), SETTINGS_HINT
    return Result(name, title, not reason, reason, hint, time.perf_counter() - t0, not_written)


def failed(name, fn, reason, seconds=0.0):
    """The Result of a check that failed without running to its end (the code under test did not
    load, or stopped the process running it)."""
    return Result(name, docstring_parts(fn)[0], False, reason, '', seconds)


def run(n, which='student', stop_at_first_failure=False):
    """Every check of exercise n against `which` (see implementation), in order, in this process:
    [Result]. `python -m exercises check` runs them in a worker process instead (exercises/worker.py)."""
    checks = checks_of(n)
    try:
        impl = implementation(n, which)
    except NotLoaded as e:
        return [failed(name, fn, str(e)) for name, fn in check_functions(checks)]
    results = []
    for name, fn in check_functions(checks):
        results.append(run_check(checks, impl, name, fn))
        if stop_at_first_failure and not results[-1].passed:
            break
    return results


# ----------------------------------------------------------------------------- small worlds

# An enumerable world: a vocabulary of 8, so every continuation of a few tokens can be listed.
V8 = GPTConfig(block_size=32, vocab_size=8, n_layer=2, n_head=2, n_embd=16)
PROMPT8 = torch.tensor([[1, 5, 2, 7]])


def peaky(module, std=0.3, seed=0):
    """Random weights large enough that p and q are far from uniform (and far from each other), in
    float64."""
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module.double().eval()


@lru_cache
def target8(seed=0):
    """The enumerable world's target, float64."""
    return peaky(GPT(V8), 0.3, seed)


@lru_cache
@torch.no_grad()
def context_target(seed=0, back=2, theta=0.4, sharp=30.0, scale=0.7):
    """A target of the enumerable world whose next token depends on the last `back` + 1 tokens, and
    strongly: two contexts that differ in the token two or three back give conditionals about 0.3
    apart in total variation (entropy about 1.5 nats a token), far more than the sampling noise of
    a check. Random weights give nearly first-order targets (conditionals after [3,3,2], [3,7,2]
    and [1,1,2] agree to about 0.005), under which a verifier that reads a sample drawn in another
    context cannot be told from a right one. Built, not trained, float64:

        wte: token one-hot (dims 0..7); wpe: (cos, sin) of theta * position (dims 8(back+1), +1)
        head h of the one layer attends to position - (h+1) alone (its query is the position
            turned back by theta (h+1), its key the position), and copies that token's one-hot
            to dims 8(h+1)..8(h+1)+7
        the MLP: random weights on those dims (seeded), into the logits' dims 0..7"""
    C, V = 32, 8
    model = GPT(GPTConfig(block_size=32, vocab_size=V, n_layer=1, n_head=back, n_embd=C)).double()
    g = torch.Generator().manual_seed(seed)
    hs, at = C // back, 8 * (back + 1)                   # head size, the position's dims
    layer = model.transformer.h[0]
    for p in model.parameters():
        p.zero_()
    for ln in (layer.ln_1, layer.ln_2, model.transformer.ln_f):
        ln.weight.fill_(1.0)
    model.transformer.wte.weight[:, :V] = scale * torch.eye(V, dtype=torch.float64)
    position = theta * torch.arange(32, dtype=torch.float64)
    wpe = model.transformer.wpe.weight
    wpe[:, at], wpe[:, at + 1] = 3 * position.cos(), 3 * position.sin()
    W, out = layer.attn.c_attn.weight, layer.attn.c_proj.weight          # (3C, C): q, k, v
    for h in range(back):
        c, s = math.cos(theta * (h + 1)), math.sin(theta * (h + 1))
        W[h * hs, at], W[h * hs, at + 1] = sharp * c, sharp * s          # q: the position h+1 back
        W[h * hs + 1, at], W[h * hs + 1, at + 1] = -sharp * s, sharp * c
        W[C + h * hs, at], W[C + h * hs + 1, at + 1] = 1.0, 1.0          # k: the position
        for v in range(V):
            W[2 * C + h * hs + v, v] = 1.0                               # v: the token
            out[8 * (h + 1) + v, h * hs + v] = 1.0
    layer.mlp.c_fc.weight[:, :at] = 2 * torch.randn(4 * C, at, generator=g, dtype=torch.float64)
    layer.mlp.c_proj.weight[:V] = 3 * torch.randn(V, 4 * C, generator=g, dtype=torch.float64) / math.sqrt(4 * C)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def continuation_probs(model, prompt, m, temperature):
    """Exact p_T(x_1..x_m | prompt) (V**m,) of every m-token continuation, float64."""
    V = model.config.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=m)))
    full = torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1)
    logp = F.log_softmax(model.double()(full)[0] / temperature, dim=-1)
    T0 = prompt.size(1)
    return logp[:, T0 - 1:-1].gather(-1, seqs.unsqueeze(-1)).squeeze(-1).sum(-1).exp()


def pearson(counts, probs):
    """Pearson's chi-square statistic of counts against probabilities (cells expected below 5
    pooled) and its degrees of freedom."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
    exp = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def critical(df, alpha=ALPHA):
    """The chi-square quantile 1 - alpha with df degrees of freedom (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts, probs, alpha=ALPHA):
    """The statistic and its critical value at `alpha`: a statistic above it fails at that level."""
    stat, df = pearson(counts, probs)
    return stat, critical(df, alpha)


def p_value(counts, probs):
    """The chi-square test's p-value (Wilson-Hilferty): how likely a statistic this large is when
    the counts do come from probs."""
    stat, df = pearson(counts, probs)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 1 - NormalDist().cdf(z)


def float32(module):
    """A float32 copy of a module (statistical checks decode at the precision decoding runs at)."""
    return copy.deepcopy(module).float() if isinstance(module, torch.nn.Module) else module


def sampled_continuations(model, drafter, temperature, n_rows, m=3, k=4, seed=0, decoder=generate):
    """m-token continuations of PROMPT8 by speculative sampling, n_rows at once: counts (V**m,) of
    each continuation, and the decoder's stats. Decoded in float32, as for real."""
    model, drafter = float32(model), float32(drafter)
    g = torch.Generator().manual_seed(seed)
    out, stats = decoder(model, PROMPT8.expand(n_rows, -1), m, drafter=drafter, k=k, temperature=temperature,
                         generator=g)
    V = model.config.vocab_size
    codes = (out[:, PROMPT8.size(1):] * torch.tensor([V ** (m - 1 - i) for i in range(m)])).sum(-1)
    return torch.bincount(codes, minlength=V ** m).double(), stats


def assert_lossless(model, drafter, temperature, n_rows=20000, m=3, k=4, seed=0, decoder=generate, what='', hint=''):
    """The m-token continuations decoded with `drafter` follow the target's exact distribution
    (chi-square at ALPHA), and the drafts were exercised: some accepted, some rejected (the
    drafters the checks use are near enough to the target to be accepted now and then, and far
    enough to be refused: a verifier that does neither is lossless only by never using a draft, or
    not lossless at all). hint: the failure's hint when the distribution is wrong ('': the check's own)."""
    counts, stats = sampled_continuations(model, drafter, temperature, n_rows, m, k, seed, decoder)
    stat, crit = chi_square(counts, continuation_probs(model, PROMPT8, m, temperature))
    if not stat < crit:
        raise Fail(f"{what}the output is not the target's distribution: chi-square {stat:.0f}, want below "
                   f"{crit:.0f} (p < {ALPHA:g}) over {n_rows} samples of {m} tokens at T={temperature}", hint)
    taus = torch.tensor(stats['accept_lengths'])
    if not (taus > 1).any():
        raise Fail(f"{what}your code accepted no draft: tau 1 at all {len(taus)} steps, want some steps above 1",
                   "the output is the target's only because every step emits nothing but its bonus: a draft d is "
                   "accepted with probability min(1, P(d) / Q(d)) (Q(d) = 1 for a point mass), and these drafts "
                   "are often likely under P, so some must pass")
    if not (taus < k).any():
        raise Fail(f"{what}your code accepted every draft: tau {k} at all {len(taus)} steps, want some below {k}",
                   "these drafts are often unlikely under the target, so a lossless verifier refuses some: d is "
                   "accepted with probability min(1, P(d) / Q(d)), Q being exactly what d was drawn from")


@lru_cache
def tiny_target(seed=0, vocab_size=32, block_size=96):
    """A small float64 GPT far from uniform: greedy decoding of it is not one repeated token."""
    torch.manual_seed(seed)
    return peaky(GPT(GPTConfig(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32)),
                 0.3, seed)


def first_difference(out, want, T0=0):
    """Where a decoding (B, T) first departs from the one it should equal, for a failure message:
    'row b, new token t: got x, want y' (0-based, t counted after the T0 prompt tokens)."""
    if out.shape != want.shape:
        return f"shape {tuple(out.shape)}, want {tuple(want.shape)}"
    diff = out != want
    if not diff.any():
        return 'no difference'
    t = int(diff.any(0).long().argmax())                   # the earliest position any row differs at
    b = int(diff[:, t].long().argmax())
    return f"row {b}, new token {t - T0}: got {int(out[b, t])}, want {int(want[b, t])}"


@torch.no_grad()
def plain_greedy(model, prompts, m):
    """The reference of references: full causal recompute of every prefix, argmax, append."""
    x = prompts
    for _ in range(m):
        x = torch.cat([x, model(x)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


class GreedyOracle(Drafter):
    """A drafter that knows the target's greedy continuation `ref` (B, T) and drafts it, wrong
    where `wrong(t, j)` says (t: the position of the last committed token, j: the draft's index),
    so steps end at every kind of place. It finds t from h alone (the hidden state of ref nearest
    to it), so it uses nothing but the drafter contract."""

    def __init__(self, model, ref, k, wrong):
        super().__init__()
        self.k, self.sample_drafts, self.wrong = k, False, wrong
        self.ref = torch.cat([ref, torch.zeros(ref.size(0), k + 1, dtype=torch.long)], 1)
        with torch.no_grad():
            self.H = model.hidden(ref)                                    # (B, T, C)

    @torch.no_grad()
    def draft(self, h, bonus, target, k, temperature=0.0, generator=None):
        t = ((self.H - h[:, None]) ** 2).sum(-1).argmin(-1)               # (B,) where h came from
        pos = t[:, None] + 2 + torch.arange(k - 1)                        # the drafts' positions
        drafts = self.ref.gather(1, pos)
        bad = torch.tensor([[self.wrong(int(ti), j) for j in range(k - 1)] for ti in t])
        return torch.where(bad, (drafts + 1) % target.config.vocab_size, drafts), None


# ----------------------------------------------------------------------------- host syncs

aten = torch.ops.aten
# ops that make the host wait for the device: reading a value (.item(), bool(), int()), an output
# whose shape depends on the data (the host must read the count before allocating), or a check of
# the input on the host (multinomial reads whether its weights are finite and non-negative, inside
# the op, where this watch does not see it). bincount is both, given minlength or not: on CUDA it
# reads its input's min back (none may be negative) and its max (the length is the larger of
# minlength and max + 1), inside the op, where a CPU's run dispatches nothing this watch sees
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.repeat_interleave.Tensor, aten._unique.default, aten._unique2.default,
            aten.unique_consecutive.default, aten.unique_dim.default, aten.unique_dim_consecutive.default,
            aten.bincount.default, aten.multinomial.default,
            aten.equal.default,     # torch.equal: a Python bool, read back from the device
            aten.allclose.default}  # torch.allclose: the same


class EagerMode(TorchDispatchMode):
    """A dispatch mode for eager code only: torch would otherwise wrap its __torch_dispatch__ so that
    torch.compile skips it, importing torch._dynamo at the first op (on the README's 2-core AMD EPYC
    1.0 s quiet, 1.7 s beside two busy processes: a part of every exercise's checks, for a compiler
    no check runs)."""

    @classmethod
    def _should_skip_dynamo(cls):
        return False


class HostSyncs(EagerMode):
    """Records every op inside the block that would stall the host on a GPU (.item(), nonzero,
    boolean indexing, .tolist(), ...). It works on the CPU too, so a check made here holds on CUDA:
    what stalls only a CPU is left out (F.one_hot given its num_classes checks its input's range on
    the host on a CPU, and not on a GPU, which leaves it to the device's own asserts)."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.cpu_only = 0          # inside a call whose host reads a GPU does not make
        self.reads = HostReads(self)

    def __enter__(self):
        self.reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self.reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None)
        # repeat_interleave told its output_size need not read the repeats back to learn it
        sized = func == aten.repeat_interleave.Tensor and kwargs.get('output_size') is not None
        # histc given no range (min == max, 0 and 0 unless told) reads its input's min and max back on
        # CUDA to make one; given a range it reads nothing
        if func == aten.histc.default:
            given = dict(zip(('bins', 'min', 'max'), args[1:]), **kwargs)
            if given.get('min', 0) == given.get('max', 0):
                self.seen.append(str(func))
        # inside a call that syncs only a CPU (HostReads): one_hot's range check reads a value, and
        # x[mask] = number writes through index_put_, which a GPU runs as masked_fill_
        if (func in SYNC_OPS or bool_index) and not sized and not (
                self.cpu_only and (func == aten._local_scalar_dense.default
                                   or (bool_index and func == aten.index_put_.default))):
            self.seen.append(str(func))
        return func(*args, **kwargs)


class HostReads(TorchFunctionMode):
    """HostSyncs' view of the calls themselves, above the ops: a CPU tensor's .tolist(), .numpy()
    or .cpu() reads it where it lies, with no op dispatched, where on a GPU each copies it to the
    host, which waits; so does printing or formatting one (print(x), f"{x}", a logging call that
    formats it), which on a GPU also stops a captured step (a copy to the host is not allowed in a
    CUDA graph); and the calls whose syncs only a CPU makes: F.one_hot with its num_classes (a range
    check), x[mask] = number (boolean indexing that a GPU runs as masked_fill_)."""
    READS = {'tolist': 'Tensor.tolist()', 'numpy': 'Tensor.numpy()', '__array__': 'Tensor.__array__()',
             'cpu': 'Tensor.cpu()', '__repr__': 'a tensor printed (its values read back: print its .shape)',
             '__format__': 'a tensor formatted (its values read back: print its .shape)'}

    def __init__(self, syncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, '__name__', '')
        if name in self.READS:   # not .to(device): on a GPU that device is the GPU
            self.syncs.seen.append(self.READS[name])
        cpu_only = name == 'one_hot' and (args[1] if len(args) > 1 else kwargs.get('num_classes', -1)) != -1
        if name == '__setitem__' and len(args) == 3 and isinstance(args[2], (bool, int, float)):
            # x[mask] = number, one bool mask beside basic indices only (ints, slices, None, ...): on
            # CUDA the number stays on the host, and index_put_ runs as masked_fill_ (ATen's
            # canDispatchToMaskedFill), with no nonzero and no sync. A tensor value, or an index tensor
            # or list beside the mask, goes through nonzero and still counts
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            tensors = [i for i in index if isinstance(i, torch.Tensor)]
            basic = all(isinstance(i, (torch.Tensor, slice, int, type(None), type(Ellipsis)))
                        and not isinstance(i, bool) for i in index)
            cpu_only = cpu_only or (basic and len(tensors) == 1 and tensors[0].dtype in (torch.bool, torch.uint8))
        self.syncs.cpu_only += cpu_only
        try:
            return func(*args, **kwargs)
        finally:
            self.syncs.cpu_only -= cpu_only


class OpCount(EagerMode):
    """The ops dispatched inside the block: `ops` their names, in order, and `n` how many."""

    def __init__(self):
        super().__init__()
        self.ops = []

    @property
    def n(self):
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class TieOrder(EagerMode):
    """Every sort and top-k inside the block that does not ask for stable=True breaks its ties as
    told: the first index first (last=False), or the last first (last=True). Their order is
    unspecified: a CPU's sort happens to keep equal values in order, a GPU's may not. Code that is
    right whatever the order passes both ways; code that leans on the CPU's order fails one."""

    def __init__(self, last):
        super().__init__()
        self.last = last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = lambda names, defaults: [dict(zip(names, args), **kwargs).get(n, d)   # noqa: E731
                                         for n, d in zip(names, defaults)]
        if func is aten.sort.default or (func is aten.sort.stable and not kwargs.get('stable')):
            return self.sort(*given(('self', 'dim', 'descending'), (None, -1, False)))
        if func is aten.topk.default:
            x, n, dim, largest = given(('self', 'k', 'dim', 'largest'), (None, None, -1, True))
            return tuple(t.narrow(dim, 0, n) for t in self.sort(x, dim, largest))
        return func(*args, **kwargs)

    def sort(self, x, dim, descending):
        if self.last:                                   # a stable sort of the reversed order
            x = x.flip(dim)
        values, indices = aten.sort.stable(x, stable=True, dim=dim, descending=descending)
        return values, (x.size(dim) - 1 - indices if self.last else indices)


def assert_no_python_loop(what, calls):
    """calls: (size, call) pairs, the same function on inputs of other sizes (more rows, more
    positions; each dimension above 1, so that no size takes a shortcut of its own). Vectorised
    code dispatches the same ops whatever the sizes; a Python loop over rows or positions runs its
    body once per row or position. Each call is counted the second time it runs (what a first
    call builds and keeps, a mask cached by size, is not counted). Fail if the counts differ."""
    counts = []
    for size, call in calls:
        call()
        with OpCount() as ops:
            call()
        counts.append((size, ops.n))
    if len({n for _, n in counts}) > 1:
        raise Fail(f"{what}: {', '.join(f'{n} ops at {size}' for size, n in counts)}; want as many ops whatever the "
                   f"sizes, as vectorised code dispatches",
                   "more rows or positions, more operations: a Python loop over them (a for over range(B) or "
                   "range(k), a list comprehension, torch.stack or torch.cat of per-row or per-position results). On "
                   "a GPU each op is a kernel launch: one per row or position costs that many launches a step")


def assert_inputs_unchanged(what, call, hint, **inputs):
    """call()'s result, the tensors `inputs` (name=tensor, what call reads) compared before and after
    it: Fail naming the first one it changed (in place: an op with an underscore, an indexed
    assignment, or one on a view or on .double() of a tensor already in float64, the same tensor)."""
    given = {name: t.clone() for name, t in inputs.items()}
    out = call()
    changed = [name for name, t in inputs.items() if not torch.equal(t, given[name])]
    if changed:
        raise Fail(f"{what} changed its input {changed[0]}, want it as it was", hint)
    return out


# ops whose kernel allocates a temporary the size of the tensor it writes, which none of its outputs
# shows: a count per slot for a 'mean' reduction (on a CPU as on CUDA), and on CUDA the prefix sum
# of masked_scatter's mask, expanded to the size of the tensor (aten/src/ATen/native/cuda)
TEMPORARY_OF_ITS_SIZE = {aten.scatter_reduce_.two: 'mean', aten.scatter_reduce.two: 'mean',
                         aten.index_reduce_.default: 'mean', aten.index_reduce.default: 'mean',
                         aten.masked_scatter_.default: None, aten.masked_scatter.default: None}


def tensors_in(tree):
    """The tensors among an op's arguments or outputs."""
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def storage_elements(t):
    """The elements of the storage t views (a view or an expand counts as what it views)."""
    return t.untyped_storage().nbytes() // t.element_size()


def allocated(args, kwargs, out):
    """The outputs of an op whose storage is none of its inputs' (a view, or an op that writes into
    an input, allocates nothing)."""
    inputs = {t.untyped_storage().data_ptr() for t in tensors_in((args, kwargs))}
    return [t for t in tensors_in(out) if t.untyped_storage().data_ptr() not in inputs]


class Allocations(EagerMode):
    """Records every tensor an op inside the block allocates: (op, elements) of each output whose
    storage is none of its inputs' (a view, or an op that writes into an input, allocates nothing),
    and the temporary of TEMPORARY_OF_ITS_SIZE's ops. Watching storage, not addresses: a buffer
    rebuilt elsewhere and copied back keeps its address, and is still a new tensor the size of the
    buffer at every call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen += [(str(func), storage_elements(t)) for t in allocated(args, kwargs, out)]
        if func in TEMPORARY_OF_ITS_SIZE and TEMPORARY_OF_ITS_SIZE[func] in (None, args[4] if len(args) > 4 else None):
            self.seen.append((f"{func} (a temporary inside it)", args[0].numel()))
        return out


class Largest(EagerMode):
    """The most elements of any tensor an op inside the block returns (its storage's: a view or an
    expand counts as what it views), and that op. Run on PyTorch's 'meta' device, where a tensor
    costs nothing to make, it sizes a call at the project's real sizes (a GPT-2 vocabulary, k = 64);
    Allocations cannot, since every 'meta' storage has the address 0."""

    def __init__(self):
        super().__init__()
        self.most = (0, '')

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            self.most = max(self.most, (storage_elements(t), str(func)), key=lambda most: most[0])
        return out


def not_about_meta(e):
    """Whether an error met on 'meta' goes through the watches there: a NotImplementedError that is
    not torch saying 'meta' lacks an op (torch's own say 'Meta'), such as code not written yet."""
    return isinstance(e, NotImplementedError) and 'meta' not in str(e).lower()


def largest_on_meta(call):
    """Largest.most of call(), its inputs on 'meta'. An op 'meta' cannot run says nothing about
    sizes (the device check judges it): the watch stops there. Not written yet passes through."""
    with Largest() as seen, autocast_off_on_meta():
        try:
            call()
        except Exception as e:
            if not_about_meta(e):
                raise
    return seen.most


class Made(EagerMode):
    """Every tensor an op inside the block returns, by weak reference (the op's name beside each),
    and the storages the block allocated (as Allocations sees them: a view, or an op that writes
    into an input, allocates nothing): to see which of those the code keeps alive after it,
    through the tensor an op made or any view of it (a .detach(), a slice)."""

    def __init__(self):
        super().__init__()
        self.refs, self.new = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [(str(func), weakref.ref(t)) for t in tensors_in(out)]
        self.new.update(t.untyped_storage().data_ptr() for t in allocated(args, kwargs, out))
        return out

    def alive(self):
        """(storages the block allocated that a live tensor still holds, their bytes, the op that
        made the first of those tensors)."""
        held = {}
        for op, ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() in self.new:
                held.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), op))
        return len(held), sum(n for n, _ in held.values()), next(iter(held.values()))[1] if held else ''


def kept_after(call, calls):
    """Made.alive() of the tensors call(i) for i in `calls` made. A reference cycle outlives its
    last use until the garbage collector runs, which costs a walk over every object of the process:
    run only where something is still alive."""
    with Made() as made:
        for i in calls:
            call(i)
    if made.alive()[0]:
        gc.collect()
    return made.alive()


KEPT_HINT = ("what fits: a list that every call adds to (or a tensor concatenated onto), on a module, the cache, the "
             "drafter or at module level, such as every result kept \"for statistics\": memory that grows with the "
             "tokens decoded (a loss or an a kept with its graph keeps the step's whole graph alive). A table made "
             "once and kept, keyed on everything it depends on (size, device, dtype), is fine: a second like call "
             "makes nothing new")


def assert_keeps_nothing(what, call, hint=KEPT_HINT, warmup=2, calls=5):
    """call(i) for i in range(warmup), then once more, then `calls` more, each with inputs of its
    own, shaped alike (the steps of one decode, where a table keyed on the shapes is made once):
    Fail if the tensors the `calls` calls made and left alive are more, or hold more bytes, than
    those one call made and left (the last result kept is one call's worth whatever the calls; a
    list of every result, or a tensor concatenated onto, grows with them). What a first call sets
    up once, a cache keyed right, is made in the warm-up. A step runs at every token decoded, a
    loss at every training step: what grows with the calls grows until the memory runs out."""
    for i in range(warmup):
        call(i)
    one = kept_after(call, [warmup])
    many = kept_after(call, range(warmup + 1, warmup + 1 + calls))
    if many[0] > one[0] or many[1] > one[1]:
        raise Fail(f"{what}: {calls} more calls left {many[0]} tensor(s) they made alive, {many[1]} bytes ({many[2]} "
                   f"made one), where one call left {one[0]}, {one[1]} bytes: want no more, whatever the number of "
                   f"calls", hint)


# ----------------------------------------------------------------------------- devices
# A tensor made without the inputs' device (torch.rand(shape), torch.arange(n)) lands on the CPU:
# right on a CPU, an error on a GPU the moment it meets the inputs. The checks see it on a CPU by
# running the code under test on inputs on PyTorch's 'meta' device (shapes without data), which
# refuses a mix with the CPU as CUDA does; a 0-dim CPU tensor (a scalar) is allowed by both.

# ops CUDA runs with a CPU tensor beside its own (indices on the host, a copy or .to() from it), as
# 'meta' does: CUDA first copies the tensor from the host, a copy that waits for the GPU to finish
# its work (a host sync) and that a CUDA graph's capture refuses. Refused here, as other mixes are.
ACROSS_DEVICES = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default,
                  aten.copy_.default, aten._to_copy.default}


class MadeOnCpu(EagerMode):
    """Under inputs on 'meta': where each CPU tensor of one dimension or more inside the block was
    made (the op and the line of student.py that made it, followed through views and ops on it),
    and `blamed`, where the first one that met a tensor of another device was made. strict: an op
    that 'meta' lets mix the devices but CUDA refuses (scatter_ with a CPU src) fails too. copies:
    so does a copy between the host and the device, each of which waits for the GPU on CUDA (a
    host sync) and is refused by a CUDA graph's capture: a CPU tensor that an op of ACROSS_DEVICES
    sends to the device (indices, .to()), Python data (a number too) made into a tensor
    on the device (torch.tensor(list, device=...), HostData), and a tensor copied to the CPU.
    `drew`: where a draw on the device took a generator of the CPU (torch.default_generator, a
    torch.Generator() made without device=), which a draw on CUDA refuses."""

    def __init__(self, strict=False, copies=True):
        super().__init__()
        self.made = {}          # id(tensor) -> (a weak reference to it, where it was made)
        self.blamed = None
        self.copied = None      # a copy between the host and the device that dispatches no CPU tensor to blame
        self.drew = None
        self.strict, self.copies = strict, copies
        self.data = HostData(self)

    def __enter__(self):
        if self.copies:
            self.data.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self.copies:
                self.data.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        on_cpu = [t for t in leaves if isinstance(t, torch.Tensor) and t.device.type == 'cpu' and t.dim() > 0]
        meets = any(isinstance(t, torch.Tensor) and t.device.type == 'meta' for t in leaves)
        on_the_device = meets or str(kwargs.get('device')) == 'meta'       # it reads or makes a tensor there
        cpu_generator = any(isinstance(g, torch.Generator) and g.device.type == 'cpu' for g in leaves)
        if cpu_generator and on_the_device:                                  # 'meta' draws with any generator
            self.drew = self.drew or f"{func}{student_line()} drew from a generator of the CPU"
        if self.copies and on_cpu and func in ACROSS_DEVICES and on_the_device:
            self.blamed = self.blamed or self.where(on_cpu[0])
            raise RuntimeError(f"{func}: a tensor on the cpu sent to the device (meta here): on CUDA a copy from the "
                               f"host that waits for the GPU, a host sync, and one a CUDA graph cannot hold")
        to_host = (func == aten._to_copy.default and args[0].device.type == 'meta'
                   and str(kwargs.get('device')) == 'cpu'
                   or func == aten.copy_.default and args[0].device.type == 'cpu' and args[1].device.type == 'meta')
        if self.copies and to_host:
            self.copied = self.copied or f"a tensor copied to the CPU (.cpu(), .to('cpu'){student_line()})"
            raise RuntimeError(f"{func}: a tensor on the device (meta here) copied to the cpu")
        if self.strict and on_cpu and meets:
            self.blamed = self.blamed or self.where(on_cpu[0])
            raise RuntimeError(f"{func}: expected all tensors on one device, found meta and cpu (as CUDA refuses)")
        # an op that writes into a CPU tensor from the device's: 'meta' runs it, CUDA refuses it, a 0-dim one
        # too (a CPU scalar may be an input beside CUDA tensors, never an output: a counter made at import,
        # `total += n.sum()`). copy_ is a copy between the devices, judged above
        into = [t for t in written_by(func, args, kwargs) if t.device.type == 'cpu']
        if into and meets and func is not aten.copy_.default:
            self.blamed = self.blamed or self.where(into[0])
            raise RuntimeError(f"{func}: writes into a tensor on the cpu from one on the device (meta here), which "
                               f"CUDA refuses (a CPU scalar may be an input beside CUDA tensors, not the output)")
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.blamed is None and on_cpu:
                self.blamed = self.where(on_cpu[0])
            raise
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == 'cpu':
                # made from a CPU tensor: where that one was made (0-dim ones too, which only an op that
                # writes into one refuses)
                self.made[id(t)] = (weakref.ref(t), self.where(on_cpu[0]) if on_cpu else f"{func}{student_line()}")
        return out

    def where(self, t):
        ref, where = self.made.get(id(t), (None, None))
        if ref is not None and ref() is t:
            return where
        return "a CPU tensor made before the call (at import, say, or one that .to() did not move?)"


def written_by(func, args, kwargs):
    """The tensors an op writes into: its arguments that its schema marks as written (self of an in-place
    op, out=)."""
    written = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            written += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


class HostData(TorchFunctionMode):
    """MadeOnCpu's view of the calls that dispatch no op it could see: torch.tensor (as_tensor,
    asarray, Tensor.new_tensor) of Python data made on the device, a number alone included, and a
    list (or range, or array) used as an index of a tensor on the device. On CUDA torch makes each
    on the host and copies it over, a copy that waits for the GPU (torch.full((), n, device=...)
    fills on the device instead). A 0-dim tensor left on the CPU is no copy: CUDA ops take it as a
    number, and MadeOnCpu lets it through."""
    MAKERS = ('tensor', 'as_tensor', 'asarray', 'new_tensor')

    def __init__(self, made):
        super().__init__()
        self.made = made

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = self.from_the_host(getattr(func, '__name__', ''), args, kwargs)
        if what:
            where = f"{what}{student_line()}, made on the host and copied to the device"
            self.made.copied = self.made.copied or where
            raise RuntimeError(f"{where} (meta here), from the cpu")
        return func(*args, **kwargs)

    def from_the_host(self, name, args, kwargs):
        """What in the call torch would make on the host and copy to the device, or None."""
        def host_data(x, kinds):   # Python data of these kinds, or an array of one dimension or more
            return isinstance(x, kinds) or (getattr(x, 'ndim', 0) > 0 and not isinstance(x, torch.Tensor))
        if name in ('__getitem__', '__setitem__') and args[0].device.type != 'cpu':
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return "an index given as Python data (a list)" if any(host_data(i, (list, range)) for i in index) else None
        if name not in self.MAKERS:
            return None
        data = args[0] if args else kwargs.get('data')
        device = kwargs.get('device', args[2] if name == 'as_tensor' and len(args) > 2 else None)
        if name == 'new_tensor':                            # x.new_tensor(data): on x's device
            data, device = args[1] if len(args) > 1 else kwargs.get('data'), kwargs.get('device', args[0].device)
        if device is not None and torch.device(device).type != 'cpu' and host_data(data, (list, tuple, int, float)):
            return f"{'Tensor' if name == 'new_tensor' else 'torch'}.{name} of Python data"
        return None


def student_line():
    """' at student.py line N' for the innermost frame of student.py on the stack, else ''."""
    line = student_lineno(traceback.extract_stack())
    return f' at student.py line {line}' if line else ''


@contextmanager
def autocast_off_on_meta():
    """torch has no autocast for 'meta', and the project asks about it (model.GPT.compute_dtype,
    dblast.conditionals): on 'meta' it reads as off, as on a CPU without autocast."""
    enabled, autocast = torch.is_autocast_enabled, torch.autocast
    torch.is_autocast_enabled = lambda *a: False if a and str(a[0]) == 'meta' else enabled(*a)
    torch.autocast = lambda device_type, *a, **kw: nullcontext() if device_type == 'meta' else \
        autocast(device_type, *a, **kw)
    try:
        yield
    finally:
        torch.is_autocast_enabled, torch.autocast = enabled, autocast


def on_meta(x):
    """x on the 'meta' device: a tensor moved, a module copied and moved."""
    return copy.deepcopy(x).to('meta') if isinstance(x, torch.nn.Module) else x.to('meta')


def assert_on_the_inputs_device(what, call, strict=False, copies=True):
    """call() runs the code under test on inputs on 'meta' (see above): Fail if it makes a tensor
    on the CPU that meets them, or returns one. An error of another kind (an op 'meta' cannot run,
    a read of a value, which the host-sync checks judge) says nothing about devices: no failure.
    strict: also where 'meta' lets an op mix the devices that CUDA does not; copies: also a copy
    between the host and the device (MadeOnCpu), which a step must not make (training code may).
    Copies are judged on a second call: a table copied once and kept (functools.lru_cache) is
    made before any step is captured, and costs nothing after. A call that draws is given
    generator=None (decode.generate's default, and every compiled step's): its draws must come
    from the global RNG of the inputs' device."""
    if copies:
        assert_on_the_inputs_device(what, call, strict, copies=False)
    with MadeOnCpu(strict, copies) as made, autocast_off_on_meta():
        try:
            out = call()
        except Exception as e:
            message = str(e)
            if not_about_meta(e):
                raise
            assert_draws_on_the_device(what, made)
            if not ('meta' in message and 'cpu' in message):
                return
            if made.copied:
                raise Fail(f"{what}: {made.copied}; want no copy between the host and the device (on CUDA each waits "
                           f"for the GPU, a host sync, and a CUDA graph cannot hold one)", DEVICE_HINT)
            where = made.blamed or f"an op{where_in_student(e)}"
            raise Fail(f"{what}: {where} made a tensor on the CPU, which met the inputs on another device "
                       f"({first_line(e)}); want every tensor on the inputs' device (run here on PyTorch's 'meta' "
                       f"device, which refuses a mix of devices as CUDA does)", DEVICE_HINT)
    assert_draws_on_the_device(what, made)
    off = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type != 'meta']
    if off:
        raise Fail(f"{what}: with its inputs on another device, it returned a tensor on the {off[0].device.type} "
                   f"({made.where(off[0])}); want its outputs on the inputs' device (run here on PyTorch's 'meta' "
                   f"device)", DEVICE_HINT)


def assert_draws_on_the_device(what, made):
    """Fail where the call, given generator=None and inputs on 'meta', drew from the CPU's generator."""
    if made.drew:
        raise Fail(f"{what}, given generator=None: {made.drew}; want every draw from the global RNG of the "
                   f"inputs' device (run here on PyTorch's 'meta' device)", GENERATOR_HINT)


GENERATOR_HINT = ("generator=None means the global RNG of the inputs' device: torch.rand(..., generator=None, "
                  "device=x.device), torch.rand_like(x) and model.sample(w, None) draw from it. "
                  "torch.default_generator is the CPU's, as is a torch.Generator() made without device=: a draw on "
                  "a GPU refuses it ('Expected a cuda device type for generator'), and decode.generate passes "
                  "generator=None to every compiled step (generate.py --compile). Pass None on as it is")

ONE_ROW_HINT = "with one row, squeeze() without a dimension drops the rows' one too: name the dimension to squeeze"

DEVICE_HINT = ("a tensor made without a device (torch.rand, torch.randn, torch.randint, torch.arange, torch.zeros, "
               "torch.full, torch.tensor, ...) is made on the CPU, and so is a tensor attribute of a module that is "
               "not a parameter or a buffer (.to() does not move it): right on a CPU, an error on a GPU, or, as "
               "indices or moved there by .to() (or torch.tensor(list, device=...)), a copy from the host that waits "
               "for the GPU at every call; so does a copy back to the host (.cpu(), .to('cpu'))")


# ----------------------------------------------------------------------------- trying it for real

class Tryout:
    """`python -m exercises try N`: the implementation under test through decode.generate, on the
    checkpoints `python train.py` wrote, one held-out prompt at a time, next to a reference that
    the code under test cannot reach: the shipped one (the project's own function, or the
    solution), plugged into the project's seams for its rows; in a handout, which has none, the
    target alone, by full recompute (no cache, no drafter, no verifier). Under greedy decoding every
    row says how many tokens equal plain greedy decoding by full recompute, whatever the handout's
    cache and verifiers do. An exercise's try_it(impl, tryout) picks the rows."""

    def __init__(self, checks, impl, reference, args, mine='yours'):
        self.checks, self.impl, self.reference, self.args = checks, impl, reference, args
        self.mine = mine                   # the rows of the code under test: 'yours', or what --solution / --control ran
        self.shown = set()                 # the rows of the target alone already made (a handout's pair)
        path = os.path.join(args.out_dir, 'ckpt.pt')
        if not os.path.isfile(path):
            raise BadInput(f"{path} not found: run `python train.py` first (about 5 minutes on a 2-core AMD EPYC, README; "
                           f"`python train.py --preset quick`: a smaller target, sooner), or give --out-dir")
        ckpt = load_checkpoint(path)
        config = ckpt.get('config') or {}       # load_checkpoint checked every field it holds
        self.model = target_from(ckpt, path, args.device)
        self.vocab = vocab_for(ckpt, path, self.model.config.vocab_size)
        ds = load_dataset(config.get('data'), os.path.join(args.out_dir, 'data'))
        self.train, self.val = ds.train, ds.val
        try:
            self.prompts = heldout_prompts(ds.val, args.prompts, PROMPT_LEN, newline_id(self.vocab)).to(args.device)
        except ValueError:    # more prompts than the held-out text has places to start
            raise BadInput(f"--prompts {args.prompts}: the held-out text ({len(ds.val)} tokens) has fewer places for "
                           f"a {PROMPT_LEN}-token prompt; give fewer")
        self.max_new = min(args.max_new, self.model.config.block_size - PROMPT_LEN - 8)
        if self.max_new < 1:
            raise BadInput(f"{path}: a context of {self.model.config.block_size} tokens leaves no room after a "
                           f"{PROMPT_LEN}-token prompt")
        if self.max_new < args.max_new:   # as generate.py says where it shortens a decode
            print(f"note: --max-new {args.max_new}: {self.max_new} new tokens a prompt, what the target's context "
                  f"of {self.model.config.block_size} leaves after a {PROMPT_LEN}-token prompt and a block",
                  file=sys.stderr)

    @lru_cache
    def drafter(self, name):
        """'heads.pt', 'dblast_K4.pt', 'dblast_K1.pt' of --out-dir, loaded once."""
        path = os.path.join(self.args.out_dir, name)
        if not os.path.isfile(path):
            if name.startswith('dblast') and self.reference is None:   # a handout: that stage runs on exercises 5, 6
                raise BadInput(f"{path} not found: train.py's dblast stage writes it, and in this copy it runs on "
                               f"your exercises 5 and 6; once they pass their checks, the same train.py command "
                               f"with --resume trains it")
            raise BadInput(f"{path} not found: run `python train.py` (all stages; `--preset quick` for a "
                           f"smaller target, sooner) first")
        return load_drafter(path, self.model)

    @lru_cache
    def truth(self):
        """Plain greedy decoding of every prompt by full recompute (B, T0 + max_new)."""
        with torch.no_grad():
            return plain_greedy(self.model, self.prompts, self.max_new)

    def target_samples(self, split):
        """The target's samples that train.py's dblast stage made and cached in --out-dir/data: its
        training samples ('train') or its held-out ones ('val'), found by what dblast_K1.pt records
        (how many, at what temperature, from what seed). Made again, with a note, only if that cache
        is gone."""
        path = os.path.join(self.args.out_dir, 'dblast_K1.pt')
        self.drafter('dblast_K1.pt')                              # there, and this target's
        config = load_checkpoint(path).get('config') or {}
        want = dict(dblast_samples=int, dblast_eval_samples=int, temperature=(int, float), seed=int)
        bad = [k for k, kind in want.items() if isinstance(config.get(k), bool) or not isinstance(config.get(k), kind)]
        if bad:
            raise BadInput(f"{path}: its config records no {bad[0]} as train.py does; re-train it")
        n = config['dblast_samples'] if split == 'train' else config['dblast_eval_samples']
        seed = config['seed'] + (1 if split == 'train' else 2)        # as train.py's dblast stage draws them
        cache = os.path.join(self.args.out_dir, 'data')
        before = set(os.listdir(cache)) if os.path.isdir(cache) else set()
        rt = types.SimpleNamespace(device=self.args.device, kind=torch.device(self.args.device).type, master=True)
        t0 = time.perf_counter()
        samples = train.dblast_data(rt, self.model, self.train if split == 'train' else self.val, n,
                                    config['temperature'], seed, f'target samples at T={config["temperature"]}', cache)
        if set(os.listdir(cache)) - before:
            print(f"note: train.py's {n} {'training' if split == 'train' else 'held-out'} samples were not in "
                  f"{cache}/: made them again ({time.perf_counter() - t0:.0f}s)")
        return samples, config['temperature']

    def decode(self, code, temperature=0.0, decoder=generate, **kw):
        """Every prompt, one at a time: outputs, tau of every step, calls, seconds. code: an
        implementation to plug into the project's seams for the run (the one under test, or the
        reference), or None for the project as it is. decoder: generate, or one with its signature."""
        g = torch.Generator(device=self.prompts.device).manual_seed(0)
        outs, taus, calls = [], [], 0
        with plugged(self.checks, code) if code is not None else nullcontext():
            t0 = time.perf_counter()
            for p in self.prompts:
                out, stats = decoder(self.model, p[None], self.max_new, temperature=temperature, generator=g, **kw)
                outs.append(out)
                taus += stats['accept_lengths']
                calls += stats['calls']
            seconds = time.perf_counter() - t0
        return torch.cat(outs), taus, calls, seconds

    def row(self, label, code, temperature=0.0, p_value=False, **kw):
        """One table row: tau, calls, speedup over plain decoding (each timed twice, interleaved with
        it, the faster run of each kept), under greedy decoding how many tokens equal plain greedy
        decoding by full recompute, and with p_value a chi-square p-value of the second token (see
        second_token_p)."""
        runs = [(self.decode(None, temperature), self.decode(code, temperature, **kw)) for _ in range(2)]
        (_, _, base_calls, _), (out, taus, calls, _) = runs[0]
        base_s = min(r[0][3] for r in runs)
        seconds = min(r[1][3] for r in runs)
        r = dict(label=label, T=temperature, tau=f"{sum(taus) / len(taus):.2f}", calls=f"{calls} ({base_calls})",
                 speedup=f"{base_s / seconds:.2f}x", same=self.same(out, temperature), out=out)
        if p_value:
            r['p'] = f"{self.second_token_p(code, temperature, **kw):.3f}"
        return r

    def same(self, out, temperature):
        """'n/m': tokens of a greedy decoding equal to plain greedy's by full recompute."""
        if temperature != 0:
            return ''
        T0 = self.prompts.size(1)
        return f"{int((out[:, T0:] == self.truth()[:, T0:]).sum())}/{out[:, T0:].numel()}"

    def plain_row(self, temperature=0.0, p_value=False):
        """The target alone by full recompute: plain greedy decoding (the `same` column's reference),
        or plain sampling."""
        P, m = len(self.prompts), self.max_new
        g = torch.Generator(device=self.prompts.device).manual_seed(0)
        out = self.truth() if temperature == 0 else self.sampled(self.prompts, m, temperature, g)
        r = dict(label='the target alone, by full recompute (no cache, no verifier)', T=temperature, tau='1.00',
                 calls=f"{P * m} full passes", speedup='', same=self.same(out, temperature), out=out)
        if p_value:
            r['p'] = f"{self.second_token_p('plain', temperature):.3f}"
        return r

    def pair(self, label, temperature=0.0, p_value=False, make=lambda code: {}, **kw):
        """[the reference's row, yours]: the reference plugged into the project's seams, or in a
        handout (no reference) the target alone by full recompute. make(code): more keywords for
        one code's run (its own drafter or decoder)."""
        yours = self.row(f"{self.mine}, {label}", self.impl, temperature, p_value, **kw, **make(self.impl))
        if self.reference is not None:
            return [self.row(f"reference, {label}", self.reference, temperature, p_value, **kw, **make(self.reference)),
                    yours]
        if (temperature, p_value) in self.shown:          # one row of the target alone per table is enough
            return [yours]
        self.shown.add((temperature, p_value))
        return [self.plain_row(temperature, p_value), yours]

    @torch.no_grad()
    def sampled(self, prompts, m, temperature, generator=None):
        """m tokens sampled after each prompt from the target by full recompute (B, T0 + m)."""
        x = prompts
        for _ in range(m):
            p = F.softmax(upcast(self.model(x)[0][:, -1]).double() / temperature, -1)
            x = torch.cat([x, torch.multinomial(p, 1, generator=generator)], 1)
        return x

    @torch.no_grad()
    def second_token_p(self, code, temperature, n=4000, decoder=generate, **kw):
        """The chi-square p-value of the second token of n decodes of one prompt against its exact
        marginal sum_x1 p(x1) p(x2 | x1): the first verified token, so a biased verifier shows.
        code: as for decode, or 'plain': the target alone by full recompute."""
        prompt, V = self.prompts[:1], self.model.config.vocab_size
        g = torch.Generator(device=prompt.device).manual_seed(1)
        if code == 'plain':
            out = self.sampled(prompt.expand(n, -1), 2, temperature, g)
        else:
            with plugged(self.checks, code) if code is not None else nullcontext():
                out, _ = decoder(self.model, prompt.expand(n, -1), 2, temperature=temperature, generator=g, **kw)
        p1 = F.softmax(self.model(prompt)[0][0, -1].double() / temperature, -1)
        seqs = torch.cat([prompt.expand(V, -1), torch.arange(V, device=prompt.device)[:, None]], 1)
        p2 = F.softmax(self.model(seqs)[0][:, -1].double() / temperature, -1)
        return p_value(torch.bincount(out[:, -1], minlength=V).double().cpu(), (p1 @ p2).cpu())

    def table(self, rows, extra=()):
        """Print rows as a markdown table (extra: more (header, key) columns)."""
        heads = ['', 'T', 'tau', 'calls (plain)', 'speedup', 'same as plain greedy'] + [h for h, _ in extra]
        print('| ' + ' | '.join(heads) + ' |\n|' + '---|' * len(heads))
        for r in rows:
            cells = [r['label'], r['T'], r['tau'], r['calls'], r['speedup'], r['same']]
            cells += [r.get(key, '') for _, key in extra]
            print('| ' + ' | '.join(str(c) for c in cells) + ' |')


def try_out(n, which, args):
    checks = checks_of(n)
    if not hasattr(checks, 'try_it'):
        raise BadInput(f"exercise {n} has no `try` (its checks are the whole story)")
    who = {'student': 'your student.py', 'solution': 'the reference'}.get(which, f"the control '{which}'")
    mine = {'student': 'yours', 'solution': 'reference (--solution)'}.get(which, f"control '{which}'")
    reference = implementation(n, 'solution') if solution_path(n) else None
    if getattr(checks, 'TRY_PAIRED', True):       # try_it sets each of its rows beside the reference's (Tryout.pair)
        against = ("the reference's rows (the shipped one, plugged in for them)" if reference is not None else
                   "the target alone, by full recompute (a handout has no reference)")
        print(f"exercise {n} ({exercises()[n]}): {who} through the decoder on {args.out_dir}/, "
              f"{args.prompts} held-out prompts one at a time, next to {against}; 'same as plain greedy' counts "
              f"the tokens equal to plain greedy decoding by full recompute.\n"
              f"{' '.join(checks.try_it.__doc__.split())}\n")
    else:                                          # its own rows: its docstring says what they are
        print(f"exercise {n} ({exercises()[n]}): {who} on {args.out_dir}/'s checkpoints, {args.prompts} held-out "
              f"prompts one at a time.\n{' '.join(checks.try_it.__doc__.split())}\n")
    try:
        impl = implementation(n, which)
    except NotLoaded as e:
        raise BadInput(str(e))
    try:
        checks.try_it(impl, Tryout(checks, impl, reference, args, mine))
    except NotImplementedError as e:
        raise BadInput(f"not written yet: {e} (python -m exercises check {n} says what is missing)")
