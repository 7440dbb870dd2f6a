"""requirements/dev.py keeps a venv to its lock: what the lock does not name is removed, and it says so,
naming each package (an extra installed by hand must not vanish silently at the next lock change)."""

from __future__ import annotations

import importlib.util
import subprocess
import venv
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dev() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sluice_dev_script_venv", ROOT / "requirements" / "dev.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hand_installed(site: Path, name: str) -> None:
    """A distribution as pip leaves one: its dist-info with METADATA and RECORD (so pip can uninstall it)."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "INSTALLER").write_text("pip\n")
    (site / f"{name}.py").write_text("")
    (info / "RECORD").write_text(
        f"{name}.py,,\n{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n{info.name}/RECORD,,\n"
    )


def test_packages_the_lock_does_not_name_are_removed_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(root)
    py = root / "bin" / "python"
    (site,) = (root / "lib").glob("python3*/site-packages")
    _hand_installed(site, "boto_by_hand")
    _hand_installed(site, "kept_by_lock")
    _dev()._remove_unlocked(py, {"kept-by-lock"})
    assert capsys.readouterr().out == (
        "removing 1 package(s) the lock does not name (installed by hand, or left by an older lock): boto_by_hand; "
        "`python3 requirements/dev.py test` installs every extra sluice has\n"
    )
    listed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True)
    names = {line.split("==")[0].lower().replace("_", "-") for line in listed.stdout.splitlines()}
    assert "kept-by-lock" in names and "boto-by-hand" not in names
