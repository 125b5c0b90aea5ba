"""Hypothesis profiles: `dev` (the default, and the quick tier) tries a fifth of the examples `ci`
(the full suite: `./scripts/test`, or HYPOTHESIS_PROFILE=ci) does. Tests state their `ci` count
through `examples(n)`, so one switch scales every property test together."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
settings.load_profile(PROFILE)


def examples(ci: int) -> int:
    """How many examples a property test tries: `ci` under the ci profile, a fifth (at least 10) else."""
    return ci if PROFILE == "ci" else max(10, ci // 5)
