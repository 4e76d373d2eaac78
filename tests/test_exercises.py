"""The coursework exercises (exercises/): every check passes on the reference, fails on the untouched
stub with the stub's NotImplementedError (not a crash of the checker), and catches every negative
control (a plausible wrong answer) by failing at least one check.

For the exercises whose reference is the project's own code (verification.verify_greedy, KVCache.write and
commit, dblast.posterior and conditionals, prefix_log_accept and al_surrogate), the reference run is
also a test of the project. Without exercises/solutions/ (an instructor's handout) only the stubs
are checked."""
import os
import types

import pytest
import torch

import decode
import verification
from conftest import in_process
from exercises import harness
from exercises.__main__ import main as exercises_main

EXERCISES = list(harness.exercises())
HAVE_SOLUTIONS = all(harness.solution_path(n) for n in EXERCISES)
CONTROLS = [(n, c) for n in EXERCISES for c in (harness.controls(n) if HAVE_SOLUTIONS else [])]


def test_nine_exercises_in_course_order():
    assert [harness.exercises()[n][3:] for n in EXERCISES] == [
        'bpd_verify', 'spec_sampling', 'cache', 'typical', 'mixture', 'al_loss', 'drafter', 'tree',
        'tree_growth']


def test_what_a_student_may_use_from_verification_is_in_decode_too():
    """The verifiers moved from decode.py to verification.py: an answer written when its statement
    named decode.exact (or ACCEPT, whole_number, walk_down, ...) still loads, and reads the same
    objects (decode.ACCEPT is the table a new rule is added to)."""
    named = {entry.split('.', 1)[1] for n in EXERCISES for entry in getattr(harness.checks_of(n), 'MAY_USE', ())
             if entry.startswith('verification.')}
    assert {'ACCEPT', 'exact', 'whole_number', 'walk_down', 'verify_greedy'} <= named
    for name in sorted(named):
        assert getattr(decode, name, None) is getattr(verification, name), f"decode.{name}"


@pytest.mark.parametrize('n', EXERCISES)
def test_every_check_fails_on_the_stub_as_not_written(n):
    results = harness.run(n, 'student')
    assert results, "no checks"
    for r in results:
        assert not r.passed and r.not_written, f"{r.title}: {r.reason or 'passed on the stub'}"


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout: exercises/solutions/ was removed")
@pytest.mark.second_process   # on the other core (conftest.py)
@pytest.mark.parametrize('n', EXERCISES)
def test_every_check_passes_on_the_reference(n):
    for r in harness.run(n, 'solution'):
        assert r.passed, f"{r.title}: {r.reason}"


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout: exercises/solutions/ was removed")
@pytest.mark.parametrize('n,control', CONTROLS, ids=[f"{n}-{c}" for n, c in CONTROLS])
@pytest.mark.slow
@pytest.mark.second_process   # on the other core (conftest.py): about 30 s of checks
def test_the_checks_catch_the_negative_control(n, control):
    failed = [r for r in harness.run(n, control, stop_at_first_failure=True) if not r.passed]
    assert failed, f"exercise {n}: the wrong answer '{control}' passes every check"
    assert not failed[0].not_written, failed[0].reason


@pytest.mark.parametrize('argv,needle', [(['check'], 'give an exercise number'), (['check', '99'], 'exercise 99'),
                                         (['check', 'one'], 'not an exercise number'),
                                         (['check', '1', '--control', 'bogus'],
                                          '--control' if HAVE_SOLUTIONS else 'no exercises/solutions/'),
                                         (['handout'], 'give the folder'),
                                         (['try', '1', '--prompts', '0'], '--prompts'),
                                         (['try', '1', '--out-dir', '/nonexistent'], 'python train.py')])
def test_the_command_refuses_bad_input_in_one_line(argv, needle):
    code, out, err = in_process(lambda: exercises_main(argv))
    errors = [line for line in err.splitlines() if line.startswith('error:')]
    assert code == 2 and len(errors) == 1 and needle in errors[0] and 'Traceback' not in err, err


def test_check_says_pass_or_fail_per_check():
    code, out, _ = in_process(lambda: exercises_main(['check', '1']))
    assert code == 1 and out.count('FAIL') == 6 and 'not written yet' in out and '0 of 6 checks pass' in out
    if HAVE_SOLUTIONS:
        code, out, _ = in_process(lambda: exercises_main(['check', '1', '--solution']))
        assert code == 0 and out.count('PASS') == 6 and '6 of 6 checks pass' in out


def test_a_failure_chooses_its_own_hint():
    """A check that raises harness.Fail(reason, hint) shows that hint; a plain assertion shows the
    docstring's."""
    def with_its_own(impl):
        """Title. Hint: the docstring's."""
        raise harness.Fail("why it failed", "the failure's own")

    def plain(impl):
        """Title. Hint: the docstring's."""
        assert False, "why it failed"
    for fn, hint in ((with_its_own, "the failure's own"), (plain, "the docstring's.")):
        r = harness.run_check(types.SimpleNamespace(), None, fn.__name__, fn)
        assert not r.passed and r.reason == "why it failed" and r.hint == hint, r


def test_a_view_of_a_slice_says_why_it_failed():
    """An answer that .view()s an input the project passes as a slice (the drafts, block[:, 1:])
    crashes with torch's 'view size is not compatible'; the hint says what that means, not the
    check's docstring's guess about a wrong answer."""
    drafts = torch.zeros(3, 5, dtype=torch.long)[:, 1:]

    def views_the_drafts(impl):
        """Title. Hint: the docstring's."""
        drafts.view(-1)
    r = harness.run_check(types.SimpleNamespace(), None, 'views_the_drafts', views_the_drafts)
    assert not r.passed and 'view size is not compatible' in r.reason and r.hint == harness.VIEW_HINT, r


def test_what_grows_with_the_calls_is_refused_and_the_last_result_kept_is_not():
    """harness.assert_keeps_nothing: a list of every call's tensor, a tensor concatenated onto at
    every call, and a list of detached views of what each call made fail; a table made once, and
    the last result kept (one call's worth whatever the number of calls), pass."""
    kept = {'all': [], 'cat': torch.zeros(0), 'table': {}}

    def appends(i):
        kept['all'].append(torch.arange(4) * i)

    def concatenates(i):
        kept['cat'] = torch.cat([kept['cat'], torch.arange(4.0)])

    def detaches(i):
        kept['all'].append((torch.arange(4.0) * i).detach()[1:])

    def table_once(i):
        return kept['table'].setdefault('mask', torch.ones(4, 4).tril()) * i

    def keeps_the_last(i):
        kept['last'] = torch.arange(4) * i
    for grows in (appends, concatenates, detaches):
        with pytest.raises(harness.Fail, match='want no more'):
            harness.assert_keeps_nothing(grows.__name__, grows)
    for right in (table_once, keeps_the_last):
        harness.assert_keeps_nothing(right.__name__, right)


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout: its decodes run on the students' cache (exercise 3)")
def test_exercise_1_takes_int32_as_well_as_long():
    """The statement allows n_acc and bonus in int32 as well as long: int32 ones pass every check
    (they work everywhere decode.generate takes them)."""
    def int32(logits, drafts, accept):
        rule, param = accept
        accepted, n_acc, bonus = verification.accept_prefix(rule(logits, drafts, param), logits.argmax(-1))
        return accepted, n_acc.int(), bonus.int()
    checks = harness.checks_of(1)
    impl = types.SimpleNamespace(verify_greedy=int32, which='int32')
    for name, fn in harness.check_functions(checks):
        r = harness.run_check(checks, impl, name, fn)
        assert r.passed, f"{r.title}: {r.reason}"


def test_each_statement_names_what_its_student_writes_and_may_use():
    """What checks.py lists (REFERENCE and STUBS: in a handout, the student's or gone; MAY_USE: what
    the student may call) is what the statement says: each is named in its README.md, what may be
    used is in the project and is no exercise's stub."""
    from exercises import handout
    stubbed = {handout.parse_entry(entry)[0] for _, _, entry, kind, _ in handout.entries() if kind == 'stub'
               and handout.parse_entry(entry)[1] is None}
    for n, folder in harness.exercises().items():
        checks = harness.checks_of(n)
        readme = open(os.path.join(harness.HERE, folder, 'README.md')).read()
        assert '**What you may use:**' in readme, f"exercise {n}: its statement has no 'What you may use'"
        listed = list(getattr(checks, 'REFERENCE', {}).values()) + list(getattr(checks, 'STUBS', {})) + \
            list(checks.MAY_USE)
        for entry in listed:
            dotted = handout.parse_entry(entry)[0]
            assert any(name in readme for name in (dotted, dotted.split('.', 1)[1])), \
                f"exercise {n}: {entry} is not named in its README.md"
        for dotted in checks.MAY_USE:
            assert harness.resolve(dotted) is not None and dotted not in stubbed, \
                f"exercise {n} may use {dotted}, which a handout leaves out"
