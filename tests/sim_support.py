"""The in-process simulator behind aiohttp's test client (plain HTTP), as fixtures for
the resource tests; registered in conftest so modules ask for them by name."""

from __future__ import annotations

import pytest

from mvproxy.devcluster.catalog import load_catalog
from mvproxy.devcluster.simserver import build_app
from mvproxy.devcluster.store import Store


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store.db"


@pytest.fixture
async def client(aiohttp_client, store_path):
    with Store(store_path, event_retention=50) as store:
        app = build_app(catalog=load_catalog("1.36"), store=store, server_id="sim-a",
                        bookmark_interval=0.1)
        yield await aiohttp_client(app)
