"""The layering rule (STYLE.md §1) is checked by a tool that can fail: import-linter's contracts in
pyproject.toml, run by ``requirements/dev.py test|lint`` over the tree as installed. Each case gives the tree one
bad import in a copy and the check must name it; the real tree passes."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_dev_script", ROOT / "requirements" / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(view: Path) -> tuple[int, str]:
    dev = _dev()
    if not (dev.BIN / "lint-imports").exists():
        pytest.skip("import-linter is not installed (python3 requirements/dev.py setup)")
    out = view / "out.txt"
    with out.open("w") as f:
        code = subprocess.call(
            [dev.BIN / "lint-imports", "--no-logo", "--no-cache", ROOT / "pyproject.toml"],
            cwd=view,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={"PYTHONPATH": str(view), "PATH": "/usr/bin:/bin"},
        )
    return code, out.read_text()


def _view_with(tmp_path: Path, package: str, line: str) -> Path:
    """The installed view, with ``package`` (a folder: normalizer, schemas, worker/capacity) copied and one of
    its modules given ``line``."""
    view = tmp_path / "view"
    _dev().typecheck_tree(view)
    top, _, sub = package.partition("/")
    link = view / "sluice" / top
    real = link.resolve()
    link.unlink()
    shutil.copytree(real, link, ignore=shutil.ignore_patterns("__pycache__"))
    (link / sub / "_bad_import.py").write_text(f'"""Breaks the layering on purpose."""\n\n{line}\n')
    return view


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    view = tmp_path / "view"
    _dev().typecheck_tree(view)
    code, out = _check(view)
    assert code == 0, out
    assert "Contracts: 7 kept, 0 broken." in out


@pytest.mark.parametrize(
    ("package", "line", "contract"),
    [
        ("normalizer", "import time", "imports no IO library"),
        ("normalizer", "import asyncio", "imports no IO library"),
        ("normalizer", "import redis.asyncio", "imports no IO library"),
        ("schemas", "import socket", "imports no IO library"),
        ("schemas", "from httpx import AsyncClient", "imports no IO library"),
        ("normalizer", "from sluice.worker import config", "imports only itself and schemas"),
        ("normalizer", "from sluice import client", "imports only itself and schemas"),
        ("schemas", "from sluice.normalizer import stream", "schemas import nothing else of sluice"),
        ("worker/capacity", "from sluice.worker.pipeline import context", "never import the job pipeline"),
        ("worker/observability", "from sluice.worker.pipeline import claim", "never import the job pipeline"),
        ("worker/observability", "from sluice.worker.capacity import admission", "observability imports no capacity"),
        ("worker/pipeline", "from sluice.worker.capacity import scripts", "never its scripts or state"),
        ("worker/redis", "from sluice.worker.observability import logs", "lower layers import no subsystem"),
    ],
)
def test_a_bad_import_in_the_core_breaks_the_check(tmp_path: Path, package: str, line: str, contract: str) -> None:
    code, out = _check(_view_with(tmp_path, package, line))
    assert code == 1, out
    assert f"sluice.{package.replace('/', '.')}._bad_import" in out
    broken = [ln for ln in out.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), out


def test_mypy_pyright_and_the_checks_share_one_view() -> None:
    """Editors, mypy and import-linter resolve ``sluice.*`` through the view ``requirements/dev.py`` builds."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    view = _dev().VIEW.relative_to(ROOT).as_posix()
    assert tool["mypy"]["files"][0] == f"{view}/sluice" and tool["mypy"]["mypy_path"] == view
    assert tool["pyright"]["extraPaths"] == [view]
