"""Fixtures of the control-plane tests: a live server running the fake driver.

The specs these tests vary and the fake driver's path are tests/helpers/service_specs.py (a
module to import; this conftest is pytest's to load). The generic fixtures (fresh PostgreSQL
databases, ``make_live_service``) live in tests/conftest.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.service_specs import FAKE_DRIVER


@pytest.fixture
def service(make_live_service):
    """A live server whose local launcher runs the fake driver."""
    return make_live_service(local_entrypoint=FAKE_DRIVER)
