"""``sluice relay``'s argument handling: minting tokens and refusing to run without secrets."""

from __future__ import annotations

import argparse
import time

import pytest

from sluice.relay.auth import RelayAuth
from sluice.relay.cli import SECRETS_ENV, configure_parser, run_from_args

SECRET = "cli-test-secret-0123456789"


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return run_from_args(p.parse_args(argv))


def test_mint_prints_a_token_for_the_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(SECRETS_ENV, f"{SECRET}, older-secret-abcdefghijk")
    assert _run(["--mint", "req_9", "--ttl", "60", "--allow-internal"]) == 0
    token = capsys.readouterr().out.strip()
    grant = RelayAuth([SECRET]).check(token, "req_9", time.time())
    assert grant.allow_internal and grant.request_id == "req_9"
    assert SECRET not in token


def test_secrets_file(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    f = tmp_path / "secrets"
    f.write_text(f"\n{SECRET}\n")
    assert _run(["--secrets-file", str(f), "--mint", "r"]) == 0
    assert RelayAuth([SECRET]).check(capsys.readouterr().out.strip(), "r", time.time()).allow_internal is False


def test_refuses_to_run_without_usable_secrets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SECRETS_ENV, raising=False)
    assert _run([]) == 2
    assert SECRETS_ENV in capsys.readouterr().err
    monkeypatch.setenv(SECRETS_ENV, "short")
    assert _run(["--mint", "r"]) == 2
    assert _run(["--secrets-file", "/nonexistent/secrets"]) == 2
    monkeypatch.setenv(SECRETS_ENV, SECRET)
    assert _run(["--mint", "r", "--ttl", "0"]) == 2
    assert _run(["--buffer", "0"]) == 2
    assert _run(["--max-clients", "0"]) == 2
    assert _run(["--write-timeout", "0"]) == 2
    assert _run(["--allowed-origin", "app.example"]) == 2
    err = capsys.readouterr().err
    assert "short" not in err and "--allowed-origin: not an origin (scheme://host[:port]): 'app.example'" in err
