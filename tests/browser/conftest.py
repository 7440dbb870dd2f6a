"""The browser tests' gate and the integration fixtures (a Redis client, the fake provider) they use.

Rule: without Chromium (or Playwright) every test here is skipped at set-up, before any fixture runs,
so a machine without a browser starts no socket, worker or relay for them and the README's test command
stays green; ``.ci/run`` installs Debian's package so CI runs them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser.support import missing_browser
from tests.integration.conftest import fake, redis_client

__all__ = ["fake", "redis_client"]

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if (reason := missing_browser()) is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(skip)
