"""`python -m exercises handout DIR`, end to end: the student's copy has no solutions and none of the
project's answers, every check there fails as "not written yet", plain decoding there stops with one
line until exercise 3 is written and then decodes exactly what the project does, and with every
reference dropped into the students' files every exercise passes in the copy.

Each step is a real process (sys.executable) run in the copy, so the copy's own modules are the
ones imported; about 40 s on 2 busy cores."""
import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap

import decode
from conftest import ROOT, in_process
from exercises import harness
from exercises.__main__ import main as exercises_main

# A tiny float64 target whose weights are redrawn large, so greedy decoding of it is not one repeated
# token. The same text builds it in this process (the project's code) and in the copy.
TINY = """
import torch
from model import GPT, GPTConfig

def tiny():
    model = GPT(GPTConfig(vocab_size=32, block_size=48, n_layer=1, n_head=1, n_embd=8)).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return model

PROMPT = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
M = 24
"""

# plain decoding (no drafter) in the copy, as a script runs it: under data.run_script
PLAIN = TINY + """
import decode
from data import run_script
run_script(lambda: print(json.dumps(decode.generate(tiny(), PROMPT, M)[0].tolist())))
"""

# every check of every exercise on the students' files, one JSON line per exercise
CHECKS = """
from exercises import harness
for n in harness.exercises():
    print(json.dumps([[r.title, r.passed, r.not_written, r.reason] for r in harness.run(n, 'student')]))
"""


def run(code_or_args, cwd):
    args = ['-c', 'import json\n' + code_or_args] if isinstance(code_or_args, str) else code_or_args
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    env.update(PYTHONDONTWRITEBYTECODE='1', OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)


def references():
    """[(exercise number, the student's name, 'module.attr')] of every REFERENCE."""
    return [(n, name, dotted) for n in harness.exercises()
            for name, dotted in getattr(harness.checks_of(n), 'REFERENCE', {}).items()]


def body_and_docstring(dotted):
    """The project's function `dotted`: the source of its body after the docstring, and of the docstring."""
    fn = inspect.unwrap(harness.resolve(dotted))
    lines, _ = inspect.getsourcelines(fn)
    node = ast.parse(textwrap.dedent(''.join(lines))).body[0]
    doc, code = node.body[0], node.body[1:]
    assert isinstance(doc, ast.Expr) and code, f"{dotted}: a reference with a docstring and a body"
    return ''.join(lines[doc.end_lineno:node.end_lineno]), ''.join(lines[doc.lineno - 1:doc.end_lineno])


def reference_student(n):
    """A student.py holding exercise n's answer: the project's own functions (a method as a plain
    function, `self` being its first parameter), after a star import of their module for their
    free names (it also brings the copy's delegating versions, which the definitions then override);
    or, with no REFERENCE, the solutions file."""
    refs = [dotted for m, _, dotted in references() if m == n]
    if not refs:
        return open(os.path.join(ROOT, 'exercises', 'solutions', harness.exercises()[n] + '.py')).read()
    modules = sorted({dotted.split('.')[0] for dotted in refs})
    sources = [textwrap.dedent(inspect.getsource(inspect.unwrap(harness.resolve(d)))) for d in refs]
    return ''.join(f"from {m} import *  # noqa\n" for m in modules) + '\n\n' + '\n\n'.join(sources)


def drop_in(handout, n):
    with open(os.path.join(handout, 'exercises', harness.exercises()[n], 'student.py'), 'w') as f:
        f.write(reference_student(n))


def all_checks(handout):
    """{exercise number: [(title, passed, not_written, reason)]} of every check in the copy."""
    proc = run(CHECKS, handout)
    assert proc.returncode == 0, proc.stderr
    results = dict(zip(harness.exercises(), map(json.loads, proc.stdout.splitlines())))
    assert len(results) == len(harness.exercises()) and all(results.values()), proc.stdout
    return results


def assert_one_line(proc, code, start):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith(start), \
        f"exit {proc.returncode}, want {code} and one line starting {start!r}:\n{proc.stderr}"


def test_handout_runs_on_the_students_code(tmp_path):
    # DIR must be new or empty: anything else is one line, and nothing is written
    (tmp_path / 'full').mkdir()
    (tmp_path / 'full' / 'notes.txt').write_text('mine')
    (tmp_path / 'a_file').write_text('mine')
    for where, needle in (('full', 'not empty'), ('a_file', 'a file is there')):
        code, _, err = in_process(lambda: exercises_main(['handout', str(tmp_path / where)]))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith('error: handout ') and needle in lines[0], err
    assert sorted(os.listdir(tmp_path)) == ['a_file', 'full'] and os.listdir(tmp_path / 'full') == ['notes.txt']

    handout = str(tmp_path / 'handout')
    made = run(['-m', 'exercises', 'handout', handout], ROOT)
    assert made.returncode == 0, made.stderr
    assert 'python -m exercises check 3' in made.stdout, made.stdout

    # 1. no solutions, and no answer left in the main code: only its signature and docstring
    assert not os.path.exists(os.path.join(handout, 'exercises', 'solutions'))
    for n, name, dotted in references():
        with open(os.path.join(handout, dotted.split('.')[0] + '.py')) as f:
            text = f.read()
        body, doc = body_and_docstring(dotted)
        assert body not in text, f"{dotted}: the handout still holds its body"
        assert doc in text, f"{dotted}: the handout lost its docstring"
        assert f".{name}(" in text and harness.exercises()[n] in text, f"{dotted}: not handed to exercise {n}"

    # 2. every check of every exercise fails as "not written yet" (an untouched stub, or the cache
    # of exercise 3 under a decode); without solutions, --solution is one line
    for n, results in all_checks(handout).items():
        for title, passed, not_written, reason in results:
            assert not passed and not_written and reason.startswith('not written yet'), \
                f"exercise {n}, {title}: {reason or 'passed'}"
    assert_one_line(run(['-m', 'exercises', 'check', '1', '--solution'], handout), 2, 'error: no exercises/solutions/')
    assert_one_line(run(['-m', 'exercises', 'handout', str(tmp_path / 'again')], handout), 2, 'error: this copy has no')

    # 3. plain decoding: one line until exercise 3 is written, then the project's tokens exactly
    assert_one_line(run(PLAIN, handout), 2, 'not written yet: exercise 3: ')
    drop_in(handout, 3)
    decoded = run(PLAIN, handout)
    assert decoded.returncode == 0, decoded.stderr
    world = {}
    exec(TINY, world)
    want = decode.generate(world['tiny'](), world['PROMPT'], world['M'])[0]
    assert json.loads(decoded.stdout) == want.tolist()
    assert len(set(want[0, 5:].tolist())) > 3, "the tiny target repeats itself: a weak comparison"

    # 4. every answer dropped in: every check of every exercise passes in the copy, and it decodes
    for n in harness.exercises():
        drop_in(handout, n)
    for n, results in all_checks(handout).items():
        for title, passed, not_written, reason in results:
            assert passed, f"exercise {n}, {title}: {reason}"
    decoded = run(PLAIN, handout)
    assert decoded.returncode == 0 and json.loads(decoded.stdout) == want.tolist(), decoded.stderr
