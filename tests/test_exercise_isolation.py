"""`python -m exercises check` given a student.py that crashes, hangs or fakes a pass: each is failed
checks with a reason and exit code 1, never a traceback, a silence or a pass (exercises/worker.py).
Each case runs the command's main in this process (conftest.in_process) on a student.py written
here, with the worker's time limit cut to a second; the worker is this process forked, so a case
costs no import of torch. The files the run may tamper with are a copy's (the last test)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, env, in_process
from exercises import harness, worker
from exercises.__main__ import main as exercises_main

CHECKS_1 = len(harness.check_functions(harness.checks_of(1)))   # exercise 1's checks (5)
# in a handout a right verify_greedy still decodes on exercise 3's stub, and there is no solution
needs_solutions = pytest.mark.skipif(not all(harness.solution_path(n) for n in harness.exercises()),
                                     reason="a handout: exercises/solutions/ was removed")

# a right verify_greedy, for the cases whose trick is elsewhere
RIGHT = """
import torch
def verify_greedy(logits, drafts, accept):
    rule, param = accept
    accepted = rule(logits, drafts, param).long().cumprod(-1).bool()
    n_acc = accepted.sum(-1)
    return accepted, n_acc, logits.argmax(-1).gather(1, n_acc[:, None]).squeeze(1)
"""

HOSTILE = {   # name: (student.py, what every check's reason holds)
    'a syntax error': ("def verify_greedy(logits, drafts, accept)\n    return None\n",
                       'student.py does not load: SyntaxError'),
    'a missing import': ("import numpyy\n", "No module named 'numpyy' (student.py line 1)"),
    'sys.exit(0) at import': ("import sys\nsys.exit(0)\n", 'called sys.exit(0) while loading (student.py line 2)'),
    'os._exit(0) at import': ("import os\nos._exit(0)\n", 'ended (exit code 0) while loading student.py'),
    'sys.exit(0) in the function': ("import sys\ndef verify_greedy(logits, drafts, accept):\n    sys.exit(0)\n",
                                    'called sys.exit(0) (student.py line 3)'),
    'os._exit(0) in the function, after printing PASS': (
        "import os\ndef verify_greedy(logits, drafts, accept):\n    print('  PASS  all of them')\n    os._exit(0)\n",
        'ended (exit code 0) inside this check'),
    'the runner and the checks replaced at import': (
        "import sys\nfrom exercises import harness\n"
        "harness.run_check = lambda checks, impl, name, fn: harness.Result(name, name, True, '', '', 0.0)\n"
        "checks = sys.modules['exercise01_checks']\n"
        "for name in dir(checks):\n"
        "    if name.startswith('test_'):\n"
        "        setattr(checks, name, lambda impl: None)\n" + RIGHT.replace('return accepted', 'return None'),
        'replaced exercises.harness.run_check'),
    'torch and the harness patched inside the function, results forged on every descriptor': (
        "import json, os, torch\nfrom exercises import harness\n"
        "def verify_greedy(logits, drafts, accept):\n"
        "    torch.equal = lambda *a: True\n"
        "    harness.Fail = AssertionError\n"
        "    forged = json.dumps(dict(event='result', index=0, passed=True, key='0' * 32)) + '\\n'\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            os.write(fd, forged.encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "    return None, None, None\n",
        'replaced exercises.harness.Fail, torch.equal during this check'),
    "the statistics' quantile replaced at import (every test's critical value would be a million)": (
        "import statistics\nstatistics.NormalDist.inv_cdf = lambda self, p: 1e6\n" + RIGHT,
        'replaced statistics.NormalDist.inv_cdf'),
    'a process-wide setting changed at import': (
        "import torch\ntorch.set_default_dtype(torch.float64)\n" + RIGHT,
        'changed the default dtype (torch.set_default_dtype), from torch.float32 to torch.float64, at import'),
}


def check_1(tmp_path, monkeypatch, source, limit=None):
    """`check 1` in this process on `source` as exercise 1's student.py -> (exit code, stdout, stderr)."""
    (tmp_path / 'student.py').write_text(source)
    monkeypatch.setattr(harness, 'student_path', lambda n: str(tmp_path / 'student.py'))
    if limit is not None:
        monkeypatch.setattr(worker, 'LIMIT', limit)
    return in_process(lambda: exercises_main(['check', '1']))


def reasons(out):
    return [line.split('why:', 1)[1].strip() for line in out.splitlines() if line.strip().startswith('why:')]


@pytest.mark.parametrize('case', list(HOSTILE))
def test_a_student_py_that_crashes_or_cheats_fails_every_check(tmp_path, monkeypatch, case):
    source, needle = HOSTILE[case]
    code, out, err = check_1(tmp_path, monkeypatch, source)
    assert code == 1 and 'Traceback' not in out + err and 'PASS  All' not in out, (code, out, err)
    assert f"0 of {CHECKS_1} checks pass" in out, out
    found = reasons(out)
    assert len(found) == CHECKS_1 and all(needle in r for r in found), out


def test_printed_output_is_shown_apart_from_the_verdicts(tmp_path, monkeypatch):
    code, out, _ = check_1(tmp_path, monkeypatch, HOSTILE['os._exit(0) in the function, after printing PASS'][0])
    assert out.count('        |   PASS  all of them') == CHECKS_1 and out.count('\n  PASS') == 0, out


@pytest.mark.slow
@pytest.mark.parametrize('where', ['at import', 'in the function'])
def test_an_endless_loop_meets_the_time_limit(tmp_path, monkeypatch, where):
    loop = "while True:\n    pass\n"
    source = loop if where == 'at import' else "def verify_greedy(logits, drafts, accept):\n    " + \
        loop.replace('\n    ', '\n        ')
    code, out, _ = check_1(tmp_path, monkeypatch, source, limit=1.0)
    found = reasons(out)
    assert code == 1 and len(found) == CHECKS_1, out
    if where == 'at import':
        assert all('did not finish loading in 1 s' in r for r in found), out
    else:
        assert 'no answer in 1 s' in found[0] and all(r.startswith('not run') for r in found[1:]), out


@needs_solutions
def test_a_right_answer_passes_in_the_worker(tmp_path, monkeypatch):
    """The guards refuse nothing of a right answer: the references pass through the same worker
    (tests/test_exercises_cli.py), and so does a right student.py."""
    code, out, _ = check_1(tmp_path, monkeypatch, RIGHT)
    assert code == 0 and f"{CHECKS_1} of {CHECKS_1} checks pass" in out, out


@needs_solutions
def test_a_compiled_right_answer_passes_in_the_worker(tmp_path, monkeypatch):
    """@torch.compile patches torch.nn.Module's __init__ at its first call: torch's own patch of a
    function the checks rely on, which the worker lets through (worker.torch_patch_of), where a
    student's is refused ('the runner and the checks replaced at import' above). Here a compiled
    helper of one shape, without code generation (backend='eager'), called inside the first check:
    the patch, at the cost of one trace (verify_greedy itself compiled retraces for every shape the
    checks try)."""
    source = RIGHT.replace('def verify_greedy(logits, drafts, accept):\n', (
        "once = torch.compile(lambda t: t + 1, backend='eager')\n"
        "def verify_greedy(logits, drafts, accept):\n"
        "    once(torch.zeros(1))\n"))
    code, out, _ = check_1(tmp_path, monkeypatch, source)
    assert code == 0 and f"{CHECKS_1} of {CHECKS_1} checks pass" in out, out


@needs_solutions
@pytest.mark.slow
@pytest.mark.second_process   # on the other core (conftest.py)
def test_a_run_that_writes_the_graders_files_counts_for_nothing(tmp_path):
    """On a copy of the project: a student.py that, at import, rewrites exercise 1's checks.py so
    that every check passes, appends to its solution, edits decode.py and adds a module to the
    project's folder. The run counts for nothing (exit 1); the checks and the solution are written
    back byte for byte (so a later --solution reads what it read before); decode.py and the new
    module are named, not touched (they may be someone's edit)."""
    copy = tmp_path / 'project'
    copy.mkdir()
    for name in os.listdir(ROOT):
        if name.endswith('.py'):
            shutil.copy2(os.path.join(ROOT, name), copy / name)
    shutil.copytree(os.path.join(ROOT, 'exercises'), copy / 'exercises',
                    ignore=shutil.ignore_patterns('__pycache__'))
    folder = copy / 'exercises' / harness.exercises()[1]
    checks, solution = folder / 'checks.py', copy / 'exercises' / 'solutions' / (harness.exercises()[1] + '.py')
    before = {p: p.read_bytes() for p in (checks, solution, copy / 'decode.py')}
    (folder / 'student.py').write_text(
        "import os\nhere = os.path.dirname(os.path.abspath(__file__))\n"
        "root = os.path.dirname(os.path.dirname(here))\n"
        "open(os.path.join(here, 'checks.py'), 'a').write('\\nfor _n in list(globals()):\\n'\n"
        "    '    if _n.startswith(\"test_\"):\\n        globals()[_n] = lambda impl: None\\n')\n"
        "open(os.path.join(root, 'exercises', 'solutions', '01_bpd_verify.py'), 'a').write('\\nCONTROLS = {}\\n')\n"
        "open(os.path.join(root, 'decode.py'), 'a').write('\\n# edited\\n')\n"
        "open(os.path.join(root, 'evil.py'), 'w').write('')\n" + RIGHT.replace('return accepted', 'return None'))
    proc = subprocess.run([sys.executable, '-m', 'exercises', 'check', '1'], cwd=copy, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()
    assert last[-1].startswith(f"0 of {CHECKS_1} checks pass"), proc.stdout
    assert 'no check of this run counts' in last[-2], proc.stdout
    for name in ('checks.py', '01_bpd_verify.py', 'put back as it was', 'decode.py', 'evil.py', 'not put back'):
        assert name in last[-2], last[-2]
    assert checks.read_bytes() == before[checks] and solution.read_bytes() == before[solution]
    assert (copy / 'decode.py').read_bytes() != before[copy / 'decode.py'] and (copy / 'evil.py').exists()
