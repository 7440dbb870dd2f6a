"""The suite never sends a destructive command to a Redis it did not start (a developer's own Redis may
answer on the default port): every test module that flushes, reconfigures, debugs or shuts a Redis down
does it on ``private_redis_url`` or a server it starts itself."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DESTRUCTIVE = re.compile(
    r"\.(script_flush|flushall|flushdb|config_set|debug_\w+)\(|\"(SCRIPT\", \"FLUSH|FLUSHALL|FLUSHDB|"
    r"CONFIG\", \"SET|DEBUG|SHUTDOWN)\"",
)
# A module may also start its own server (embedded_redis, the cluster harness) and send them there.
OWN_SERVER = re.compile(r"private_redis_url|embedded_redis\(|start_cluster\(|acl_redis")


def test_destructive_commands_only_reach_a_redis_the_tests_started() -> None:
    offenders = []
    for path in TESTS.rglob("*.py"):
        if path == Path(__file__):
            continue
        text = path.read_text()
        if DESTRUCTIVE.search(text) and not OWN_SERVER.search(text):
            offenders.append(str(path.relative_to(TESTS)))
    assert offenders == []
