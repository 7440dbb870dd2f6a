"""Set-up and entry point for the README's two commands, using only the standard library.

Rule: on a fresh machine with only Python 3.11+, ``python3 ops/dev.py test`` and ``python3 ops/dev.py demo``
create ``.venv``, install sluice with its test extras into it (again only when pyproject.toml changed),
and run the test suite or the demo inside it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".sluice-installed"


def _ensure_venv() -> Path:
    if sys.version_info < (3, 11):  # noqa: UP036 - this script may be run by any python3
        sys.exit(f"sluice needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return BIN / "python"
    if not (BIN / "python").exists():
        print("creating .venv ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = BIN / "python"
    print("installing sluice and its test dependencies into .venv ...", flush=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"], check=True)
    STAMP.write_text(digest)
    return py


# The installed package's names for the repository's folders (pyproject.toml's package-dir).
PACKAGE_DIRS = {"worker": "worker", "normalizer": "normalizer", "schemas": "schemas"}


def typecheck_tree() -> Path:
    """A tree of links named as the installed package (``sluice`` = ops/, ``sluice.worker`` = worker/, ...):
    mypy resolves modules by folder names and cannot follow setuptools' editable finder."""
    tree = VENV / "typecheck" / "sluice"
    if tree.exists():
        for entry in tree.iterdir():
            entry.unlink()
    tree.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "ops").iterdir():
        if entry.name != "__pycache__" and entry.name not in PACKAGE_DIRS:
            (tree / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (tree / name).symlink_to(ROOT / folder)
    return tree


def _typecheck(py: Path) -> int:
    typecheck_tree()
    return subprocess.call([py, "-m", "mypy"], cwd=ROOT)  # [tool.mypy] in pyproject.toml points at the tree


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"test", "demo", "lint", "setup"}:
        print("usage: python3 ops/dev.py {test|demo|lint|setup} [args...]", file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    py = _ensure_venv()
    if cmd == "setup":
        return 0
    if cmd == "lint":
        return subprocess.call([py, "-m", "ruff", "check", str(ROOT), *rest]) or _typecheck(py)
    if cmd == "test":
        lint = subprocess.call([py, "-m", "ruff", "check", str(ROOT)])
        types = _typecheck(py)
        tests = subprocess.call([py, "-m", "pytest", "-q", *rest], cwd=ROOT)
        return tests or lint or types
    return subprocess.call([BIN / "sluice", "demo", *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
