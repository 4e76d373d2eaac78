"""`python -m exercises handout DIR`, end to end. One handout is made per module, and copied where a
test writes into it: it holds no answer (every body each exercise lists, REFERENCE and STUBS, refuses
as not written when called, and no function anywhere in the copy has one of their bodies); every
check there fails as "not written yet"; plain decoding stops with one line until exercise 3 is
written, and then, with exercises 1 and 2, plain and one-path decoding give the project's tokens
while several paths per call refuse, naming exercise 8; and with every reference dropped into the
students' files every check of every exercise passes in the copy; `try` there sets a planted wrong
answer beside the target alone; and a helper of the main code that only listed bodies use must be
listed too.

Each step in the copy is a real process (sys.executable) run there, so the copy's own modules are
the ones imported."""
import ast
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, in_process
from exercises import handout as handout_module
from exercises import harness
from exercises.__main__ import main as exercises_main

pytestmark = [pytest.mark.slow, pytest.mark.second_process]   # handouts made and run: on the other core (conftest.py)

# A tiny float64 target whose weights are redrawn large, so greedy decoding of it is not one repeated
# token, and BPD heads redrawn the same way. The same text builds them in this process (the
# project's code) and in the copy.
TINY = """
import torch
from heads import BlockHeads
from model import GPT, GPTConfig

def redrawn(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return module

def tiny():
    return redrawn(GPT(GPTConfig(vocab_size=32, block_size=48, n_layer=1, n_head=1, n_embd=8)).double().eval(), 0)

def heads(k=4):
    return redrawn(BlockHeads(tiny().config, k).double().eval(), 1)

PROMPT = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
M = 24
"""

# What the copy decodes once exercises 1 to 3 are written: plain greedy and sampled, one-path greedy
# and sampled blocks of BPD heads, and several paths per call (exercise 8's: refused)
DECODES = """
import decode
def decodes():
    out = {}
    for name, kw in (('plain greedy', {}), ('plain sampled', dict(temperature=1.3)),
                     ('heads greedy', dict(drafter=heads(), k=4)),
                     ('heads sampled', dict(drafter=heads(), k=4, temperature=1.3))):
        g = torch.Generator().manual_seed(0)
        out[name] = decode.generate(tiny(), PROMPT, M, generator=g, **kw)[0].tolist()
    return out
"""

# every check of every exercise on the students' files, one JSON line per exercise
CHECKS = """
from exercises import harness
for n in harness.exercises():
    print(json.dumps([[r.title, r.passed, r.not_written, r.reason] for r in harness.run(n, 'student')]))
"""

# In a fresh copy: call every listed body, and say what it raised. A whole function is called with
# None for each of its parameters: its stub refuses before it reads them, a body that survived
# fails on them otherwise (or returns). An answer that is one branch of a function is reached by a
# call of its own (BRANCHES), with what comes before it in place; one more kind of branch needs one
# more entry there, a new function nothing.
PROBE = TINY + DECODES + """
import contextlib, inspect, io
import decode, model, verification
from cli import run_script
from exercises import handout, harness
from exercises.__main__ import main

class Faked:   # a target that returns zeros, so that merged_step reaches its several-paths branch
    def forward_cached(self, block, cache, tree):
        return torch.zeros(block.shape + (4,))
    def lm_head(self, h):
        return torch.zeros(h.shape[:-1] + (8,))

def tree_forward():
    m = model.GPT(model.GPTConfig(block_size=16, vocab_size=8, n_layer=1, n_head=1, n_embd=8))
    m.forward_cached(torch.zeros(1, 3, dtype=torch.long), m.new_cache(1, 16),
                     (torch.tensor([0, 1, 1]), torch.ones(3, 3, dtype=torch.bool)))

def several_paths():   # past the layout and the verifier, to the kept path's move
    layout, verifier = decode.tree_layout, decode.verify   # the names merged_step calls
    decode.tree_layout = lambda paths, n, device: None
    decode.verify = lambda *args: (torch.zeros(1, dtype=torch.long),) * 3
    try:
        decode.merged_step(Faked(), None, None, None, torch.zeros(1, 5, dtype=torch.long), None,
                           torch.ones(1, dtype=torch.bool), paths=2)
    finally:
        decode.tree_layout, decode.verify = layout, verifier

def tree_verify():
    verification.verify(torch.zeros(1, 5, 8), None, torch.zeros(1, 2, 2, dtype=torch.long), 0.0,
                        (verification.exact, None))

BRANCHES = {'model.GPT.forward_cached [else of tree is None]': tree_forward,
            'decode.merged_step [if paths > 1]': several_paths, 'verification.verify [if N > 1]': tree_verify}

def outcome(call):
    try:
        call()
        return 'returned'
    except NotImplementedError as e:
        return str(e)
    except Exception as e:
        return f'{type(e).__name__}: {e}'

def whole(dotted):
    fn = harness.resolve(dotted)
    n = sum(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            for p in inspect.signature(fn).parameters.values())
    return lambda: fn(*[None] * n)

def one_line(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run_script(lambda: main(argv))
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, err.getvalue()

entries = {entry: outcome(BRANCHES.get(entry) or whole(handout.parse_entry(entry)[0]))
           for _, _, entry, _, _ in handout.entries()}
print(json.dumps(dict(entries=entries, branches=sorted(BRANCHES),
                      plain=outcome(lambda: decode.generate(tiny(), PROMPT, M)),
                      solution=one_line(['check', '1', '--solution']), again=one_line(['handout', '../again']))))
""" + CHECKS


def run(code_or_args, cwd):
    args = ['-c', 'import json\n' + code_or_args] if isinstance(code_or_args, str) else code_or_args
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env.update(PYTHONDONTWRITEBYTECODE='1', OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def handout(tmp_path_factory):
    """A fresh handout, made once for the module: tests that write into it work on a copy."""
    dest = str(tmp_path_factory.mktemp('handouts') / 'course')
    code, out, err = in_process(lambda: exercises_main(['handout', dest]))
    assert code == 0, err
    assert 'python -m exercises check 3' in out, out
    return dest


def copy_of(handout, tmp_path):
    dest = str(tmp_path / 'course')
    shutil.copytree(handout, dest, symlinks=True)
    return dest


def function_sources(dotted):
    """The project's function `dotted`, dedented (a method as a plain function: `self` is its first
    parameter), and the names it reads."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(harness.resolve(dotted))))
    return source, {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}


def reference_student(n):
    """A student.py holding exercise n's answer: the project's own functions of its REFERENCE, with
    the whole functions of any exercise's STUBS they call (a handout has those only as stubs), after
    a star import of their modules for their free names (it also brings the copy's delegating
    versions, which the definitions then override); or, with no REFERENCE, the solutions file."""
    refs = [entry for m, _, entry, kind, _ in handout_module.entries() if m == n and kind == 'student']
    if not refs:
        return open(os.path.join(ROOT, 'exercises', 'solutions', harness.exercises()[n] + '.py')).read()
    stubs = {entry.rsplit('.', 1)[-1]: entry for _, _, entry, kind, _ in handout_module.entries()
             if kind == 'stub' and ' ' not in entry}
    chosen, todo = [], list(refs)
    while todo:
        dotted = todo.pop(0)
        if dotted not in chosen:
            chosen.append(dotted)
            todo += [stubs[name] for name in function_sources(dotted)[1] if name in stubs]
    modules = sorted({dotted.split('.')[0] for dotted in chosen})
    return ''.join(f"from {m} import *  # noqa\n" for m in modules) + '\n\n' + \
        '\n\n'.join(function_sources(dotted)[0] for dotted in chosen)


def drop_in(handout, n):
    with open(os.path.join(handout, 'exercises', harness.exercises()[n], 'student.py'), 'w') as f:
        f.write(reference_student(n))


def all_checks(stdout):
    """{exercise number: [(title, passed, not_written, reason)]} from CHECKS' lines."""
    lines = stdout.splitlines()[-len(harness.exercises()):]
    results = dict(zip(harness.exercises(), map(json.loads, lines)))
    assert all(results.values()), stdout
    return results


def bodies(tree):
    """ast.dump of every statement list that is a body in `tree`: function bodies (after a
    docstring), and the arms of every if."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            code = node.body[1:] if ast.get_docstring(node) is not None else node.body
            out.add(ast.dump(ast.Module(code, [])))
        elif isinstance(node, ast.If):
            out |= {ast.dump(ast.Module(node.body, [])), ast.dump(ast.Module(node.orelse, []))}
    return out


def listed_bodies():
    """{entry: ast.dump of the project's body it names}, for every entry of every exercise."""
    out = {}
    for _, _, entry, _, _ in handout_module.entries():
        dotted, arm, test = handout_module.parse_entry(entry)
        path = os.path.join(ROOT, dotted.split('.')[0] + '.py')
        fn = handout_module.find_function(ast.parse(open(path).read()), dotted, path)
        if arm is None:
            out[entry] = ast.dump(ast.Module(fn.body[1:] if ast.get_docstring(fn) is not None else fn.body, []))
        else:
            node = handout_module.branches(fn, test)[0]
            out[entry] = ast.dump(ast.Module(node.body if arm == 'if' else node.orelse, []))
    return out


def test_a_handout_holds_no_answer(handout):
    # 1. no solutions, and no listed body in any Python file of the copy, wherever it might be
    assert not os.path.exists(os.path.join(handout, 'exercises', 'solutions'))
    found = set()
    for top, _, names in os.walk(handout):
        for name in names:
            if name.endswith('.py'):
                found |= bodies(ast.parse(open(os.path.join(top, name), encoding='utf-8').read()))
    left = [entry for entry, body in listed_bodies().items() if body in found]
    assert not left, f"the handout still holds the bodies of {left}"

    # 2. by behaviour: every listed body, called, refuses as not written, naming its exercise; every
    # check of every exercise fails as "not written yet"; plain decoding refuses until exercise 3 is
    # written; check --solution and handout say in one line that this is a handout
    proc = run(PROBE, handout)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.splitlines()[0])
    for n, folder, entry, kind, what in handout_module.entries():
        got = probe['entries'][entry]
        want = handout_module.refusal(n, entry, what) if kind == 'stub' else f"exercise {n}: "
        assert got.startswith(want) and (kind == 'stub' or what in got), \
            f"{entry} (exercise {n}): called in the handout it gave {got!r}, want it to refuse as {want!r}..."
    branch_entries = {entry for _, _, entry, _, _ in handout_module.entries() if ' ' in entry}
    assert set(probe['branches']) == branch_entries, "each branch entry needs its probe (PROBE's BRANCHES)"
    assert probe['plain'].startswith('exercise 3: '), probe['plain']
    for key, start in (('solution', 'error: no exercises/solutions/'), ('again', 'error: this copy has no')):
        code, err = probe[key]
        assert code == 2 and err.strip().startswith(start) and len(err.strip().splitlines()) == 1, (key, code, err)
    for n, results in all_checks(proc.stdout).items():
        for title, passed, not_written, reason in results:
            assert not passed and not_written and reason.startswith('not written yet'), \
                f"exercise {n}, {title}: {reason or 'passed'}"


def test_plain_and_one_path_decoding_need_only_their_exercises(handout, tmp_path):
    """With exercise 3 written, plain decoding is the project's; with 1 and 2 too, one-path blocks,
    greedy and sampled, are the project's as well: they need nothing of exercise 8, whose several
    paths per call refuse in one line naming it."""
    course = copy_of(handout, tmp_path)
    for n in (1, 2, 3):
        drop_in(course, n)
    script = TINY + DECODES + """
from cli import run_script
print(json.dumps(decodes()))
run_script(lambda: decode.generate(tiny(), PROMPT, M, drafter=heads(), k=4, paths=2, temperature=1.0))
"""
    proc = run(script, course)
    world = {}
    exec(TINY + DECODES, world)
    want = world['decodes']()
    assert json.loads(proc.stdout) == want
    assert len(set(want['plain greedy'][0][5:])) > 3, "the tiny target repeats itself: a weak comparison"
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith('not written yet: exercise 8: '), \
        proc.stderr


def test_every_check_passes_with_the_references_dropped_in(handout, tmp_path):
    course = copy_of(handout, tmp_path)
    for n in harness.exercises():
        drop_in(course, n)
    proc = run(CHECKS, course)
    assert proc.returncode == 0, proc.stderr
    for n, results in all_checks(proc.stdout).items():
        for title, passed, not_written, reason in results:
            assert passed, f"exercise {n}, {title}: {reason}"


def test_the_list_in_a_handout_says_to_start_with_exercise_3(handout):
    """`python -m exercises` in a handout says exercise 3 comes first (every decode there runs on
    the student's cache); in the full project, where any order works, it says nothing of it."""
    said = 'Start with exercise 3: in this copy every decode runs on your cache'
    assert said in run(['-m', 'exercises'], handout).stdout
    code, out, err = in_process(lambda: exercises_main([]))
    assert code == 0 and said not in out and '08_tree' in out, out + err


def test_a_folder_in_use_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / 'notes.txt').write_text('mine')
    (tmp_path / 'a_file').write_text('mine')
    for where, needle in (('full', 'not empty'), ('a_file', 'a file is there'), ('a_file/course', 'is a file'),
                          (ROOT + '/exercises/course', 'inside the project')):
        code, _, err = in_process(lambda: exercises_main(['handout', str(tmp_path / where)]))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith('error: handout ') and needle in lines[0], err
    assert sorted(os.listdir(tmp_path)) == ['a_file', 'full'] and os.listdir(tmp_path / 'full') == ['notes.txt']
    assert not os.path.exists(os.path.join(ROOT, 'exercises', 'course'))


def test_try_in_a_handout_sets_a_planted_wrong_answer_beside_the_target_alone(handout, tmp_path):
    """A handout has no reference: `try 1` there sets the student's rows beside the target alone by
    full recompute, which no student code reaches (not even the handout's cache, exercise 3's), so a
    planted wrong verify_greedy shows other figures than the reference row."""
    from test_exercises_cli import table, write_out_dir, wrong_verify_greedy
    course = copy_of(handout, tmp_path)
    drop_in(course, 3)
    with open(os.path.join(course, 'exercises', harness.exercises()[1], 'student.py'), 'w') as f:
        f.write(wrong_verify_greedy())
    out_dir = write_out_dir(str(tmp_path / 'out'))
    proc = run(['-m', 'exercises', 'try', '1', '--out-dir', out_dir, '--prompts', '2', '--max-new', '16'], course)
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    plain, yours = rows['the target alone, by full recompute (no cache, no verifier)'], rows['yours, BPD heads, k = 8']
    assert plain[5] == '32/32' and yours[5] != plain[5], proc.stdout


def only_answers_use(sources):
    """The functions and methods of the main modules ({module: source}) that something reads, and
    only listed bodies (a REFERENCE's or a STUBS entry's): 'module.name', sorted. A reference is the
    name read anywhere (called, passed, as an attribute), its own body left out."""
    trees = {m: ast.parse(source) for m, source in sources.items()}
    taken = []                                                  # (module, first, last) of listed bodies
    for _, _, entry, _, _ in handout_module.entries():
        dotted, arm, test = handout_module.parse_entry(entry)
        module = dotted.split('.')[0]
        fn = handout_module.find_function(trees[module], dotted, module)
        for body in ([fn.body] if arm is None else
                     [node.body if arm == 'if' else node.orelse for node in handout_module.branches(fn, test)]):
            taken.append((module, body[0].lineno, body[-1].end_lineno))
    read = {}                                                   # name -> [(module, line)]
    for m, tree in trees.items():
        for x in ast.walk(tree):
            if isinstance(x, (ast.Name, ast.Attribute)):
                read.setdefault(x.id if isinstance(x, ast.Name) else x.attr, []).append((m, x.lineno))
    listed = {handout_module.parse_entry(e)[0] for _, _, e, _, _ in handout_module.entries()}
    found = []
    for module, tree in trees.items():
        for node in tree.body:
            for fn, dotted in [(node, f"{module}.{node.name}")] if isinstance(node, ast.FunctionDef) else \
                    [(f, f"{module}.{node.name}.{f.name}") for f in node.body if isinstance(f, ast.FunctionDef)] \
                    if isinstance(node, ast.ClassDef) else []:
                where = [(m, line) for m, line in read.get(fn.name, [])
                         if not (m == module and fn.lineno <= line <= fn.end_lineno)]
                inside = [(m, line) for m, line in where if any(m == tm and a <= line <= b for tm, a, b in taken)]
                if where and len(inside) == len(where) and dotted not in listed:
                    found.append(dotted)
    return sorted(found)


def test_try_2_in_a_handout_before_the_dblast_stage_shows_the_heads_and_says_why_not_dblast(handout, tmp_path):
    """In a handout train.py's dblast stage stops until exercises 5 and 6 are written, so out/ has
    no DBlast drafter when a student reaches exercise 2: `try 2` decodes with the heads it has and
    says that the DBlast rows need exercises 5 and 6, then train.py with --resume."""
    from test_exercises_cli import table, write_out_dir
    course = copy_of(handout, tmp_path)
    for n in (3, 2):
        drop_in(course, n)
    out_dir = write_out_dir(str(tmp_path / 'out'))              # ckpt.pt and heads.pt, no dblast_K4.pt
    proc = run(['-m', 'exercises', 'try', '2', '--out-dir', out_dir, '--prompts', '2', '--max-new', '16'], course)
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    assert 'yours, heads.pt' in rows and not any('dblast' in r for r in rows), proc.stdout
    assert "dblast_K4.pt not found: train.py's dblast stage writes it, and in this copy it runs on your exercises 5 " \
           "and 6" in proc.stdout and '--resume' in proc.stdout, proc.stdout


def test_a_helper_only_an_answer_uses_is_listed():
    """A function of the main code that nothing but the listed bodies uses is the answer's
    substance too, and must be an entry (as verification.tree_nodes is, which only the tree verifier
    calls). Shown here on a copy of verification.py given one more such helper."""
    modules = ['model', 'data', 'heads', 'dblast', 'verification', 'decode', 'generate', 'trainer', 'train', 'measure',
               'bench', 'gpu_check']
    sources = {m: open(os.path.join(ROOT, m + '.py'), encoding='utf-8').read() for m in modules}
    assert only_answers_use(sources) == []
    start = '    B, N, n = drafts.shape\n    p = F.softmax'
    assert sources['verification'].count(start) == 1            # verify_tree_sampled's first lines
    tampered = dict(sources, verification=sources['verification'].replace(start, '    tree_helper(drafts)\n' + start)
                    + '\n\ndef tree_helper(drafts):\n    return drafts\n')
    assert only_answers_use(tampered) == ['verification.tree_helper']
