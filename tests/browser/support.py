"""Headless Chromium (Debian's package) driven by Playwright, for the relay's browser-facing tests.

Without Chromium (or Playwright) ``conftest.py`` skips every browser test before it starts anything;
``.ci/run`` installs Debian's package.
Screenshots go to ``$SLUICE_ARTIFACTS`` (default ``<repo>/tmp/artifacts``), printed by each test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


NO_PLAYWRIGHT = "the `playwright` package is not installed"


def find_chromium() -> str | None:
    """``$SLUICE_CHROMIUM`` when set (and only it: an explicit choice never falls back), else Debian's
    ``/usr/bin/chromium``, else ``chromium`` on PATH."""
    if (chosen := os.environ.get("SLUICE_CHROMIUM")) is not None:
        candidates: tuple[str | None, ...] = (chosen,)
    else:
        candidates = ("/usr/bin/chromium", shutil.which("chromium"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def no_chromium_reason() -> str:
    if (chosen := os.environ.get("SLUICE_CHROMIUM")) is not None:
        return f"no Chromium: SLUICE_CHROMIUM={chosen!r} is not an executable file"
    return (
        "no Chromium at /usr/bin/chromium or on PATH (install Debian's `chromium` package, or set "
        "SLUICE_CHROMIUM); .ci/run installs it"
    )


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or ``None``: checked before anything is started."""
    if find_chromium() is None:
        return no_chromium_reason()
    if importlib.util.find_spec("playwright") is None:
        return NO_PLAYWRIGHT
    return None


def chromium() -> str:
    if (path := find_chromium()) is None:
        pytest.skip(no_chromium_reason())
    return path


def artifacts(name: str) -> Path:
    """A fresh folder for one test's screenshots; its path is printed (``pytest -s`` shows it)."""
    folder = Path(os.environ.get("SLUICE_ARTIFACTS", ROOT / "tmp" / "artifacts")) / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"\nscreenshots: {folder}")
    return folder


@contextlib.asynccontextmanager
async def browser() -> AsyncIterator[Any]:
    executable = chromium()
    api = pytest.importorskip("playwright.async_api", reason=NO_PLAYWRIGHT)
    async with api.async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def wait_for(page: Any, expression: str, timeout_ms: int = 15_000) -> None:
    await page.wait_for_function(f"() => {expression}", timeout=timeout_ms)
