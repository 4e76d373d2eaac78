"""pytest over one exercise's checks, as an alternative to `python -m exercises check N`:

    python -m pytest exercises/02_spec_sampling/checks.py             # your student.py
    IMPL=solution python -m pytest exercises/02_spec_sampling/checks.py

The `impl` fixture is the code under test, plugged into the project's seams for the check."""
import os

import pytest

from exercises import harness


@pytest.fixture
def impl(request):
    n = int(os.path.basename(os.path.dirname(str(request.path)))[:2])
    which = os.environ.get('IMPL', 'student')
    code = harness.implementation(n, which)
    with harness.plugged(harness.checks_of(n), code):
        yield code
