"""The coursework exercises (exercises/): every check passes on the reference, fails on the untouched
stub with the stub's NotImplementedError (not a crash of the checker), and catches every negative
control (a plausible wrong answer) by failing at least one check.

For the exercises whose reference is the project's own code (decode.verify_greedy, KVCache.write and
commit, dblast.posterior and conditionals, prefix_log_accept and al_surrogate), the reference run is
also a test of the project. Without exercises/solutions/ (an instructor's handout) only the stubs
are checked."""
import pytest

from exercises import harness

EXERCISES = list(harness.exercises())
HAVE_SOLUTIONS = all(harness.solution_path(n) for n in EXERCISES)
CONTROLS = [(n, c) for n in EXERCISES for c in (harness.controls(n) if HAVE_SOLUTIONS else [])]


def test_eight_exercises_in_course_order():
    assert [harness.exercises()[n][3:] for n in EXERCISES] == [
        'bpd_verify', 'spec_sampling', 'cache', 'typical', 'mixture', 'al_loss', 'drafter', 'tree']


@pytest.mark.parametrize('n', EXERCISES)
def test_every_check_fails_on_the_stub_as_not_written(n):
    results = harness.run(n, 'student')
    assert results, "no checks"
    for r in results:
        assert not r.passed and r.not_written, f"{r.title}: {r.reason or 'passed on the stub'}"


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout: exercises/solutions/ was removed")
@pytest.mark.parametrize('n', EXERCISES)
def test_every_check_passes_on_the_reference(n):
    for r in harness.run(n, 'solution'):
        assert r.passed, f"{r.title}: {r.reason}"


@pytest.mark.skipif(not HAVE_SOLUTIONS, reason="a handout: exercises/solutions/ was removed")
@pytest.mark.parametrize('n,control', CONTROLS, ids=[f"{n}-{c}" for n, c in CONTROLS])
def test_the_checks_catch_the_negative_control(n, control):
    failed = [r for r in harness.run(n, control, stop_at_first_failure=True) if not r.passed]
    assert failed, f"exercise {n}: the wrong answer '{control}' passes every check"
    assert not failed[0].not_written, failed[0].reason
