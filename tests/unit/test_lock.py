"""The lock files in requirements/ are current with pyproject.toml: compiled from the same dependency lists
(their recorded inputs hash), pinning every declared requirement at a version its specifier admits, one
version per package across locks, and no aiohttp anywhere. Fails until `python3 requirements/dev.py lock` is run."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_dev_script", ROOT / "requirements" / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEV = _dev()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _declared(extras: tuple[str, ...]) -> list[Requirement]:
    """The base dependencies and those of ``extras``, following the extras' references to sluice-llm[...]."""
    out = [Requirement(r) for r in PROJECT["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in PROJECT["optional-dependencies"][extra]:
            req = Requirement(text)
            if req.name == PROJECT["name"]:
                todo += sorted(req.extras)
            else:
                out.append(req)
    return out


@pytest.mark.parametrize("name", sorted(DEV.LOCKS))
def test_lock_is_current_with_pyproject(name: str) -> None:
    path = DEV.lock_path(name)
    header = re.search(r"inputs-sha256: ([0-9a-f]{64})", path.read_text())
    assert header is not None and header[1] == DEV.lock_inputs_digest(), "run `python3 requirements/dev.py lock`"
    pinned = DEV.locked_versions(path)
    for req in _declared(DEV.LOCKS[name]):
        key = DEV._normalize(req.name)
        assert key in pinned, f"{name}: {req.name} is declared but not locked"
        assert req.specifier.contains(pinned[key], prereleases=True), (name, str(req), pinned[key])
    assert "aiohttp" not in pinned


def test_every_lock_agrees_with_the_test_lock() -> None:
    test = DEV.locked_versions(DEV.lock_path("test"))
    for name in DEV.LOCKS:
        for pkg, version in DEV.locked_versions(DEV.lock_path(name)).items():
            if name != "image" or pkg in test:  # the image's may hold nothing the suite lacks, but agree
                assert test[pkg] == version, (name, pkg)
    # make demo after make test must install nothing: the test set holds the demo set
    assert set(DEV.locked_versions(DEV.lock_path("demo"))) <= set(test)


def test_every_pin_carries_hashes() -> None:
    for name in DEV.LOCKS:
        text = DEV.lock_path(name).read_text()
        pins = re.findall(r"^[A-Za-z0-9][^\s]*==[^\s]+", text, re.M)
        assert pins and len(re.findall(r"^\S+==\S+[^\n]*\\\n    --hash=sha256:", text, re.M)) == len(pins)


def test_the_stamp_says_which_lock_is_installed(tmp_path, monkeypatch) -> None:
    """`make demo` after `make test` installs nothing (the test lock holds the demo lock); `make test` after
    `make demo` installs the test lock; a changed lock or pyproject installs again."""
    import json

    monkeypatch.setattr(DEV, "STAMP", tmp_path / "stamp")

    def stamp(lock: str, **changes: str) -> None:
        doc = {"lock": lock, "sha256": DEV._digest(DEV.lock_path(lock))}
        doc["pyproject"] = DEV._digest(ROOT / "pyproject.toml")
        (tmp_path / "stamp").write_text(json.dumps({**doc, **changes}))

    stamp("test")
    assert DEV._current("test") and DEV._current("demo")
    stamp("demo")
    assert DEV._current("demo") and not DEV._current("test")
    stamp("test", sha256="0" * 64)
    assert not DEV._current("test") and not DEV._current("demo")
    stamp("test", pyproject="0" * 64)
    assert not DEV._current("test")
