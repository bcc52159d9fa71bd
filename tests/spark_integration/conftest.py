"""Fixtures of the Spark-free tests of ``spark_integration`` (see ``si_helpers``)."""

from __future__ import annotations

import pytest

from tests.spark_integration.si_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
