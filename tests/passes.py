"""Which tests touch a server, and what a session ran: the ground the test command's two passes stand on.

Rule: a test touches a server when it uses a fixture that gives one (``SERVER_FIXTURES``, or any fixture
built on them) or carries ``@pytest.mark.server`` (a test that starts its own server); the collection marks
the first kind itself, so ``-m server``, the Valkey pass, selects both without anyone keeping a list.
Every server a test starts, in the test's process or in a child of it, runs through a wrapper that records
the test and the fixture being set up (``REDIS_SERVER_BIN``, which ``sluice.harness.embedded_redis`` and the
cluster harness obey); a test that started one without the marker fails, and so does one whose shared
(module or session) fixture started one without being listed here. So a test that touches a server cannot
be left out of the Valkey pass unnoticed. Every session prints what it ran (touching a server or not, by
outcome); with ``SLUICE_TEST_RAN=<file>`` it also writes it, one JSON object a line, for
``requirements/dev.py`` to check that the Valkey pass ran exactly the first pass's server set.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
from collections import Counter
from collections.abc import Generator
from pathlib import Path

import pytest

from sluice.harness.embedded_redis import RedisUnavailable, redis_server_binary

__all__ = ["MARKER", "RAN_ENV", "SERVER_FIXTURES"]

MARKER = "server"
# Every fixture shared beyond one test that starts or gives a server (acl_redis: tests/integration/test_deploy_acl.py).
SERVER_FIXTURES = frozenset({"redis_url", "private_redis_url", "cluster", "acl_redis"})
RAN_ENV = "SLUICE_TEST_RAN"
_STARTS_ENV = "SLUICE_TEST_SERVER_STARTS"  # the wrapper's log: "<PYTEST_CURRENT_TEST>\t<fixture>:<scope>" a line
_FIXTURE_ENV = "SLUICE_TEST_FIXTURE"  # the fixture being set up, "<name>:<scope>", for the wrapper's log
_NO_TEST = "outside any test"

_outcomes: dict[str, str] = {}
_marked: dict[str, bool] = {}
_ran_path: list[str] = []  # the controller's SLUICE_TEST_RAN, taken out of the environment children inherit
_wrapper_dir: list[Path] = []  # the wrapper and its log, removed when the session that made them ends


def _controller(config: pytest.Config) -> bool:
    """The process that reports: the only one without xdist, the controller with it."""
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _controller(config):
        return
    if path := os.environ.pop(RAN_ENV, None):  # a pytest a test runs must not write over this session's list
        _ran_path.append(path)
    if _STARTS_ENV in os.environ:
        return  # a pytest a test runs (tests/unit/test_browser_gate.py) shares its session's wrapper
    try:
        real = redis_server_binary()  # honours SLUICE_REDIS_ENGINE and a REDIS_SERVER_BIN of the caller's
    except RedisUnavailable:
        return  # nothing to start: the tests that need a server say so themselves
    folder = Path(tempfile.mkdtemp(prefix="sluice-test-servers-"))
    _wrapper_dir.append(folder)
    log, wrapper = folder / "starts.log", folder / "redis-server"
    log.touch()
    # PYTEST_CURRENT_TEST ("<node id> (setup|call|teardown)") is set by pytest in the test's process and
    # inherited by its children. `--version` is a question about the binary, not a server.
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$1" in --version|-v) ;; *) '
        f'printf "%s\\t%s\\n" "${{PYTEST_CURRENT_TEST:-{_NO_TEST}}}" "${{{_FIXTURE_ENV}:-}}"'
        f" >> {shlex.quote(str(log))} ;; esac\n"
        f'exec {shlex.quote(real)} "$@"\n'
    )
    wrapper.chmod(0o755)
    os.environ["REDIS_SERVER_BIN"] = str(wrapper)
    os.environ[_STARTS_ENV] = str(log)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there when it looks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(MARKER)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[object]) -> Generator[None, object, object]:
    before = os.environ.get(_FIXTURE_ENV)
    os.environ[_FIXTURE_ENV] = f"{fixturedef.argname}:{fixturedef.scope}"
    try:
        return (yield)
    finally:
        if before is None:
            del os.environ[_FIXTURE_ENV]
        else:
            os.environ[_FIXTURE_ENV] = before


def _starts() -> list[tuple[str, str, str]]:
    """(node id, fixture, scope) of every server started so far; fixture "" when the test itself did."""
    path = os.environ.get(_STARTS_ENV)
    if not path:
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        current, _, fixture = line.partition("\t")
        name, _, scope = fixture.partition(":")
        out.append((current.rsplit(" (", 1)[0], name, scope))
    return out


def _unclassified(item: pytest.Item) -> str | None:
    """Why ``item`` started a server the Valkey pass would not know of, or None."""
    for nodeid, fixture, scope in _starts():
        if nodeid != item.nodeid or fixture in SERVER_FIXTURES:
            continue
        if scope not in ("", "function"):
            return (
                f"the {scope}-scoped fixture {fixture!r} starts a server: list it in SERVER_FIXTURES "
                "(tests/passes.py), so every test using it is marked and the Valkey pass runs it"
            )
        if item.get_closest_marker(MARKER) is None:
            how = f"through the fixture {fixture!r}" if fixture else "itself"
            return (
                f"this test starts a server {how} but is not marked: add @pytest.mark.{MARKER} (or use a server "
                "fixture), so the Valkey pass runs it"
            )
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    report = yield
    if call.when == "teardown" and isinstance(report, pytest.TestReport) and (why := _unclassified(item)):
        report.outcome = "failed"
        report.longrepr = why
    return report


def _test_id(report: pytest.TestReport) -> str:
    """The node id without the ``@<group>`` xdist's loadgroup appends, so passes compare whatever their flags."""
    head, at, _ = report.nodeid.rpartition("@")
    return head if at and "xdist_group" in report.keywords else report.nodeid


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    test = _test_id(report)
    if report.when == "setup":
        _marked[test] = MARKER in report.keywords
    if _outcomes.get(test) == "failed":
        return
    if report.failed:
        _outcomes[test] = "failed"
    elif report.skipped:
        _outcomes[test] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call":
        _outcomes[test] = "xpassed" if hasattr(report, "wasxfail") else "passed"


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _controller(session.config):
        return
    if any(nodeid == _NO_TEST for nodeid, _, _ in _starts()):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # said in the summary
    if _ran_path:
        with open(_ran_path[0], "w") as f:
            for nodeid, outcome in _outcomes.items():
                f.write(json.dumps({"test": nodeid, MARKER: _marked.get(nodeid, False), "outcome": outcome}) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _controller(config):
        return

    def counts(server: bool) -> str:
        c = Counter(o for n, o in _outcomes.items() if _marked.get(n, False) == server)
        return f"{c.total()} ({', '.join(f'{v} {k}' for k, v in sorted(c.items())) or 'none'})"

    terminalreporter.write_sep("-", "what this session ran")
    terminalreporter.write_line(f"tests that touch a server: {counts(True)}")
    terminalreporter.write_line(f"tests that do not: {counts(False)}")
    if any(nodeid == _NO_TEST for nodeid, _, _ in _starts()):
        terminalreporter.write_line("a server was started outside any test: no pass can account for it", red=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _wrapper_dir:
        shutil.rmtree(folder, ignore_errors=True)
