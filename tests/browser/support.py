"""Headless Chromium (Debian's package) driven by Playwright, for the relay's browser-facing tests.

Skipped with a clear message when no Chromium (or no Playwright) is installed; ``.ci/run`` installs it.
Screenshots go to ``$SLUICE_ARTIFACTS`` (default ``<repo>/tmp/artifacts``), printed by each test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-sync",
]  # fmt: skip


def chromium() -> str:
    for candidate in (os.environ.get("SLUICE_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no Chromium found (install Debian's `chromium` package, or set SLUICE_CHROMIUM); .ci/run installs it")


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
    api = pytest.importorskip("playwright.async_api", reason="the `playwright` package is not installed")
    async with api.async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def wait_for(page: Any, expression: str, timeout_ms: int = 15_000) -> None:
    await page.wait_for_function(f"() => {expression}", timeout=timeout_ms)
