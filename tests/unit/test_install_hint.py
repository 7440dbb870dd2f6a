"""The install hint names a command that works where sluice was installed from (sluice-llm is not on PyPI):
read from pip's own record of the installation (``direct_url.json``, PEP 610)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from sluice.worker import extras


class _Dist:
    def __init__(self, direct_url: Any) -> None:
        self.direct_url = direct_url

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.direct_url is None else json.dumps(self.direct_url)


def _installed(monkeypatch: pytest.MonkeyPatch, direct_url: Any) -> None:
    monkeypatch.setattr(extras.metadata, "distribution", lambda name: _Dist(direct_url))


@pytest.mark.parametrize(
    ("direct_url", "hint"),
    [
        ({"url": "file:///src/sluice", "dir_info": {"editable": True}}, "pip install -e '/src/sluice[aws]'"),
        ({"url": "file:///src/sluice", "dir_info": {}}, "pip install '/src/sluice[aws]'"),
        (
            {"url": "file:///w/sluice_llm-0.1.0-py3-none-any.whl", "archive_info": {}},
            "pip install '/w/sluice_llm-0.1.0-py3-none-any.whl[aws]'",
        ),
        ({"url": "file:///my%20dir/sluice", "dir_info": {}}, "pip install '/my dir/sluice[aws]'"),
        ({"url": "https://example.invalid/sluice_llm.whl", "archive_info": {}}, "pip install 'sluice-llm[aws]'"),
        (None, "pip install 'sluice-llm[aws]'"),  # from an index: no direct_url.json
        ("not an object", "pip install 'sluice-llm[aws]'"),
    ],
)
def test_the_hint_names_where_this_installation_came_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, direct_url: Any, hint: str
) -> None:
    _installed(monkeypatch, direct_url)
    assert extras.install_hint("aws", venv=tmp_path) == hint


def test_a_venv_requirements_dev_manages_says_the_lock_decides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _installed(monkeypatch, {"url": "file:///src/sluice", "dir_info": {"editable": True}})
    (tmp_path / ".sluice-installed").write_text("{}")
    assert extras.install_hint("google", venv=tmp_path) == (
        "pip install -e '/src/sluice[google]' (this venv follows requirements/*.txt: `python3 requirements/dev.py "
        "test` sets up one with every extra, and a package installed by hand is removed at the next lock change)"
    )


def test_not_installed_at_all_names_the_distribution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name: str) -> Any:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(extras.metadata, "distribution", missing)
    assert extras.install_hint("demo", venv=tmp_path) == "pip install 'sluice-llm[demo]'"
