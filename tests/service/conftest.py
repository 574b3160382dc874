"""Fixtures of the control-plane tests: a live server running the fake driver, and a database
with the settings a scheduler runs under (``db``).

The specs these tests vary and the fake driver's path are tests/helpers/service_specs.py (a
module to import; this conftest is pytest's to load). The generic fixtures (fresh PostgreSQL
databases, ``make_live_service``) live in tests/conftest.py.
"""

from __future__ import annotations

import pytest

from service.db import make_engine, make_sessionmaker
from service.settings import Settings
from tests.helpers.service_specs import FAKE_DRIVER


@pytest.fixture
def service(make_live_service):
    """A live server whose local launcher runs the fake driver."""
    return make_live_service(local_entrypoint=FAKE_DRIVER)


@pytest.fixture
def db(migrated_postgres_url, tmp_path):
    """A session factory on a fresh migrated PostgreSQL database, and local-launcher settings
    with a fast scheduler poll."""
    engine = make_engine(migrated_postgres_url)
    yield make_sessionmaker(engine), Settings(home=tmp_path, database_url=migrated_postgres_url,
                                              launcher="local", scheduler_poll_s=0.01)
    engine.dispose()
