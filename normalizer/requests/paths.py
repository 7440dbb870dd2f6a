"""A route's path template, filled in: ``{model}``, ``{project}`` and ``{location}``.

Rule: a value fills one path segment and can never leave it. A model name is letters, digits and
``._-@`` (Vertex names Claude versions ``claude-sonnet-4@20250514``), plus ``;=,:+`` for parameterised
names (the fake provider's scenarios), which are percent-encoded; ``/``, ``?``, ``#`` and spaces are
refused. The template itself is the operator's (checked at configuration time: a leading ``/``, only
known placeholders).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import quote

from sluice.normalizer.requests.base import require_model
from sluice.schemas.request import InvalidRequest

__all__ = ["PATH_FIELDS", "fill_path", "model_segment"]

PATH_FIELDS: tuple[str, ...] = ("model", "project", "location")

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._;=,:+@-]*")
_PLACEHOLDER = re.compile(r"{(model|project|location)}")


def model_segment(model: str, dialect: str) -> str:
    """``model`` as one percent-encoded path segment (a ``models/`` prefix dropped). Raises ``InvalidRequest``."""
    name = require_model(model).removeprefix("models/")
    if not _MODEL_NAME.fullmatch(name):
        raise InvalidRequest(f"{dialect}: a model name is letters, digits, '.', '_', '-' and '@'")
    return quote(name, safe="._-@")


def fill_path(template: str, dialect: str, *, model: str, values: Mapping[str, str]) -> str:
    """``template`` with its placeholders filled (``values``: ``project``, ``location``, checked at
    configuration time). Raises ``InvalidRequest`` for a model name that is not a plain name."""

    def one(m: re.Match[str]) -> str:
        field = m.group(1)
        return model_segment(model, dialect) if field == "model" else quote(values[field], safe="._-")

    return _PLACEHOLDER.sub(one, template)
