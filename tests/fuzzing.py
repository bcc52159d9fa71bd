"""Settings of the fuzzing tests: names, key and value types and values, damaged files.

In CI each property runs a fixed number of derandomized examples (the same ones every run),
a few dozen where an example takes milliseconds and a handful where it takes seconds (the
damaged files on S3), plus its explicit ``@example``s. A fuzzing campaign sets
``ICESTATE_FUZZ_EXAMPLES`` to the number of examples per property and gets fresh random
examples every run::

    ICESTATE_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/statestore/test_fuzz_values.py \
        tests/catalog/test_fuzz_names.py tests/catalog/test_fuzz_damage.py
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

CAMPAIGN_ENV = "ICESTATE_FUZZ_EXAMPLES"
# "0": report a failing example as found, without shrinking it (each example does real I/O, so
# shrinking one can take minutes); for a first look during a campaign.
SHRINK_ENV = "ICESTATE_FUZZ_SHRINK"


def campaign_examples() -> int:
    """Examples per property asked for by ``ICESTATE_FUZZ_EXAMPLES`` (0: none, the CI default)."""
    return int(os.environ.get(CAMPAIGN_ENV) or 0)


def fuzz_settings(ci_examples: int) -> settings:
    """Hypothesis settings of one fuzzing property: ``ci_examples`` derandomized examples, or
    the campaign's number of random ones; no deadline (each example does real I/O)."""
    campaign = campaign_examples()
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    if os.environ.get(SHRINK_ENV, "1") != "0":
        phases.append(Phase.shrink)
    return settings(
        phases=phases,
        max_examples=campaign or ci_examples, deadline=None, derandomize=not campaign,
        database=None, print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                               HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
    )
