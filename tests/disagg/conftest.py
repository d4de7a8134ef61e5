"""Fixtures of the disaggregation tests."""

import pytest

from tests.disagg.nodes import make_broker


@pytest.fixture
def broker():
    """A Redis broker in a namespace of the test's own, emptied after it."""
    broker = make_broker()
    yield broker
    broker.flush_all()
    broker.close()
