"""The integration fixtures (a Redis client, the fake provider) for the browser tests too."""

from tests.integration.conftest import fake, redis_client

__all__ = ["fake", "redis_client"]
