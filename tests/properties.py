"""Hypothesis settings every property test of this suite builds on.

`PROPERTIES` is the parent of each test's own settings:

- No example database. Hypothesis replays the failures it saved under .hypothesis/ before
  anything else, so a checkout that once drew a falsifying case fails on it at every run while a
  fresh clone (CI) passes, or fails on it one run in N: the same commit is red in one place and
  green in the other. Each falsifying case found is kept in its test as an explicit `@example`
  instead, which every checkout runs first.
- The failure blob printed: a failure in CI prints the `@reproduce_failure` line that replays
  it on any machine.
- No deadline and no `too_slow` health check: the suite shares two cores with Redis servers
  and gateway processes, so a time limit on one example (or on drawing the first ones) fails
  by the machine's load, not by the code.

The same settings are the suite's default profile (loaded by tests/conftest.py), so a
`@given` written without them still runs without a database and without time limits.

`examples(n)` is a test's own number of examples, or KVGATE_PROPERTY_EXAMPLES when that is set:
how a property is searched with many more examples than CI runs, under several seeds, e.g.

    KVGATE_PROPERTY_EXAMPLES=10000 .venv/bin/python -m pytest tests/test_scheduler_peak.py \\
        --hypothesis-seed=3
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

EXAMPLES_ENV = "KVGATE_PROPERTY_EXAMPLES"

PROPERTIES = settings(database=None, print_blob=True, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow])
PROFILE = "kvgate"
settings.register_profile(PROFILE, PROPERTIES)


def examples(n: int) -> int:
    """`n`, or the number KVGATE_PROPERTY_EXAMPLES asks for."""
    wanted = os.environ.get(EXAMPLES_ENV, "").strip()
    return int(wanted) if wanted else n
