"""The cost fields of a terminal status: which prices apply to a request, and what they make of its usage.

Rule: a route's own table (``[prices.<route>]``) wins; else the LiteLLM price file (``price_file``) by the
request's model (then ``<provider>/<model>``); else no price applies and no cost is written. The status
and the terminal entry carry ``usage_reported`` (``1``/``0``) always, and ``cost`` (a decimal string),
``currency`` and ``prices_version`` when a price applied and usage was reported, for completed, failed and
interrupted requests alike (``sluice.normalizer.pricing`` computes it); ``provider_cost`` when the provider
reported its own cost of the request (OpenRouter's ``usage.cost``), whether or not a price applies. The
price file is read once per path (``load_price_file``), at config load, so a bad file stops the worker at
start with one line.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import msgspec

from sluice.normalizer.pricing import PriceError, Prices, cost_of, format_cost, litellm_table, prices_version
from sluice.schemas.errors import ConfigError
from sluice.schemas.events import Usage
from sluice.worker.files import UnreadableFile, read_input

if TYPE_CHECKING:
    from sluice.worker.config import Config

__all__ = ["COST_FIELDS", "cost_fields", "load_price_file", "prices_for", "route_tables"]

COST_FIELDS = ("usage_reported", "cost", "currency", "prices_version")
_ENC = msgspec.json.Encoder(order="deterministic")


@lru_cache(maxsize=4)
def load_price_file(path: str) -> tuple[dict[str, Prices], str]:
    """The file's prices by model and its version (a hash of its bytes). Raises ``ConfigError``."""
    try:
        data = read_input(path, "price file")
        return litellm_table(msgspec.json.decode(data)), prices_version(data)
    except UnreadableFile as exc:
        raise ConfigError(f"price_file: {exc}") from None
    except (msgspec.DecodeError, PriceError) as exc:
        raise ConfigError(f"price_file {path}: not a LiteLLM price file ({exc})") from None


@lru_cache(maxsize=16)
def _table_version(encoded: bytes) -> str:
    return prices_version(encoded)


def route_tables(config: Config) -> dict[str, tuple[Prices, str]]:
    """Each route's own price table with the prices_version a status priced by it records (what an audit
    of the archive recomputes a cost with)."""
    if not config.prices:
        return {}
    version = config.prices_version or _table_version(_ENC.encode(config.prices))
    return {route: (p, version) for route, p in config.prices.items()}


def prices_for(config: Config, route: str, model: str, provider: str) -> tuple[Prices, str] | None:
    """The prices a request on ``route`` asking for ``model`` is priced by, with their version; None: none."""
    if (p := config.prices.get(route)) is not None:
        return p, config.prices_version or _table_version(_ENC.encode(config.prices))
    if config.price_file and model:
        table, version = load_price_file(config.price_file)
        p = table.get(model) or table.get(f"{provider}/{model}")
        if p is not None:
            return p, config.prices_version or version
    return None


def cost_fields(
    config: Config, route: str, dialect: str, provider: str, model: str, usage: Usage | None
) -> dict[str, str]:
    """The status fields of ``COST_FIELDS`` for a finished request (``{"usage_reported": "0"}`` at least)."""
    fields = {"usage_reported": "1" if usage is not None else "0"}
    if usage is not None and isinstance(usage.provider_cost, str):
        fields["provider_cost"] = usage.provider_cost  # the provider's own figure, beside the computed cost
    priced = prices_for(config, route, model, provider)
    if priced is None or usage is None:
        return fields
    prices, version = priced
    cost = cost_of(usage, prices, dialect)
    if cost is not None:
        fields |= {"cost": format_cost(cost), "currency": prices.currency, "prices_version": version}
    return fields
