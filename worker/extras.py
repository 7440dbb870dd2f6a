"""The one wording of "install the X extra": a command that works in this installation.

Rule: the distribution ``sluice-llm`` is not on PyPI, so the hint names where this installation came from,
as pip recorded it (``direct_url.json``, PEP 610): a checkout (``pip install -e '/path/to/checkout[aws]'``),
a local wheel or archive (``pip install '/path/to/sluice_llm-….whl[aws]'``); only an installation from an
index gets ``pip install 'sluice-llm[aws]'``. In a checkout whose venv ``requirements/dev.py`` manages, the
hint says that the lock decides: ``make test``'s venv has every extra, and a package added by hand is
removed at the next lock change.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

__all__ = ["DISTRIBUTION", "install_hint"]

DISTRIBUTION = "sluice-llm"
_MANAGED = ".sluice-installed"  # the stamp requirements/dev.py leaves in the venv it manages


def _origin() -> tuple[str, bool] | None:
    """(local path, editable) of a file:// installation, else None."""
    try:
        raw = metadata.distribution(DISTRIBUTION).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    try:
        doc = json.loads(raw or "null")
    except ValueError:
        return None
    if not isinstance(doc, dict) or not str(doc.get("url", "")).startswith("file://"):
        return None
    editable = bool((doc.get("dir_info") or {}).get("editable"))
    return unquote(urlparse(doc["url"]).path), editable


def install_hint(extra: str, *, venv: Path | None = None) -> str:
    """``pip install …`` that brings ``extra`` into this installation (``venv``: the running one)."""
    origin = _origin()
    if origin is None:
        return f"pip install '{DISTRIBUTION}[{extra}]'"
    path, editable = origin
    command = f"pip install {'-e ' if editable else ''}'{path}[{extra}]'"
    here = venv if venv is not None else Path(sys.prefix)
    if (here / _MANAGED).exists():
        command += (
            " (this venv follows requirements/*.txt: `python3 requirements/dev.py test` sets up one with every "
            "extra, and a package installed by hand is removed at the next lock change)"
        )
    return command
