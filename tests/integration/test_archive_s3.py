"""``sluice archive`` against an S3-compatible server over plain HTTP (moto's, as MinIO or a local gateway would
be; issue 36, item 5): with ``AWS_ENDPOINT_URL=http://...`` and ``AWS_ALLOW_HTTP`` unset the destination is
refused at once, in one line naming the setting; every failure of a running archiver is one line naming its
cause (the refused plain-HTTP endpoint, a missing bucket, an endpoint that refuses connections), never an
opaque error class; ``--once`` exits 2 after ``ONCE_TRIES`` tries of the failing step, with nothing acked."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from sluice.archive.archiver import ONCE_TRIES
from sluice.harness.embedded_redis import free_port

# ruff: noqa: F811
from tests.integration.test_archive import s3_bucket  # noqa: F401 - fixture
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures


def _pending(service: Service) -> int:
    return int(service.r.xpending(service.keys.terminal, "sluice-archive")["pending"])


def test_a_plain_http_endpoint_without_allow_http_is_refused_at_once_naming_the_setting(
    service: Service, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.wait_state(service.enqueue("anthropic", "synthetic;deltas=3", "http-1"))
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    code, out, err = service.cli("archive", "--to", s3_bucket, "--once")
    assert (code, out) == (2, "")
    assert err == (
        f"sluice archive: cannot open the archive destination {s3_bucket}: AWS_ENDPOINT_URL is plain HTTP "
        f"({endpoint}), which the S3 client refuses unless AWS_ALLOW_HTTP=true\n"
    )
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")  # the documented setting: the same command archives
    code, out, err = service.cli("archive", "--to", s3_bucket, "--once")
    assert (code, err) == (0, ""), out
    assert "archived 1 request(s)" in out and _pending(service) == 0


@pytest.mark.parametrize("case", ["http-refused", "no-bucket", "unreachable"])
def test_each_failure_is_one_line_naming_its_cause_and_once_gives_up(
    service: Service, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    service.wait_state(service.enqueue("gemini", "synthetic;deltas=3", f"fail-{case}"))
    to = s3_bucket
    if case == "http-refused":  # set, but not to true: the S3 client judges it and refuses
        monkeypatch.setenv("AWS_ALLOW_HTTP", "false")
        cause = "the S3 client refused a plain-HTTP endpoint: set AWS_ALLOW_HTTP=true to allow it (GenericError)"
    elif case == "no-bucket":
        to = "s3://no-such-bucket/sluice"
        cause = "NoSuchBucket: The specified bucket does not exist (FileNotFoundError)"
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        cause = "Connection refused (GenericError)"
    with caplog.at_level(logging.WARNING, logger="sluice.archive"):
        code, out, err = service.cli("archive", "--to", to, "--once")
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith("sluice archive: reading "), err
    assert err.endswith(f" failed: {cause}; gave up after {ONCE_TRIES} tries\n"), err
    warnings = [r.getMessage() for r in caplog.records if r.name == "sluice.archive"]
    assert len(warnings) == ONCE_TRIES - 1, warnings  # one line per failed try but the last, which exits
    assert all(w.endswith(f" failed: {cause}; retrying in {w.rsplit(' ', 1)[1]}") for w in warnings), warnings
    assert all("\n" not in w for w in warnings)
    assert _pending(service) == 1  # read, never acked: the next run archives it


def test_a_missing_bucket_is_a_failure_of_verify_too(service: Service, s3_bucket: str) -> Any:
    """A missing bucket reads as a failure, not as an archive where nothing was written."""
    service.wait_state(service.enqueue("anthropic", "synthetic;deltas=2", "verify-1"))
    code, out, err = service.cli("archive", "--to", "s3://no-such-bucket/sluice", "--verify")
    assert (code, out) == (2, "")
    assert err.startswith("sluice archive: reading ") and err.endswith(
        " failed: NoSuchBucket: The specified bucket does not exist (FileNotFoundError)\n"
    ), err
