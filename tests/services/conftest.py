"""Fixtures of the service tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_harness import FakeBackend


@pytest.fixture(scope="module")
def backend(nats_server) -> Iterator[FakeBackend]:
    """The fake executor side of the gateway tests: a tokenizer, scheduler and executor in one."""
    fake = FakeBackend(nats_server.url).start()
    yield fake
    fake.stop()
