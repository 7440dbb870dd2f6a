"""The wire contract and key layout every sluice consumer needs (pure: no IO, no clocks)."""

from sluice.schemas.events import CONTRACT_VERSION

__all__ = ["CONTRACT_VERSION"]
