"""Relay tokens: deployment secrets and signed per-request tokens (HMAC-SHA256)."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from sluice.relay.auth import AuthError, Grant, RelayAuth, sign_token

SECRET = "deployment-secret-0123456789"
OLD = "previous-secret-abcdefghijkl"
NOW = 1_700_000_000


def _status(auth: RelayAuth, token: str | None, rid: str = "req_1", now: float = NOW) -> int:
    try:
        auth.check(token, rid, now)
    except AuthError as exc:
        return exc.status
    return 200


def test_deployment_secret_reads_everything_including_internal() -> None:
    auth = RelayAuth([SECRET])
    assert auth.check(SECRET, "any", NOW) == Grant(request_id=None, allow_internal=True, expires_at=None)


def test_signed_token_grants_one_request_until_expiry() -> None:
    auth = RelayAuth([SECRET])
    token = auth.sign("req_1", NOW + 60)
    assert auth.check(token, "req_1", NOW) == Grant(request_id="req_1", allow_internal=False, expires_at=NOW + 60)
    assert auth.check(auth.sign("req_1", NOW + 60, allow_internal=True), "req_1", NOW).allow_internal
    assert _status(auth, token, now=NOW + 59.9) == 200
    assert _status(auth, token, now=NOW + 60) == 403  # expired at exp
    assert _status(auth, token, rid="req_2") == 403


def test_token_layout_is_hmac_sha256_over_prefix_and_payload() -> None:
    token = sign_token(SECRET, "req_1", NOW + 60, allow_internal=True)
    prefix, payload, sig = token.split(".")
    assert prefix == "sl1"
    assert base64.urlsafe_b64decode(payload + "==") == b'{"rid":"req_1","exp":1700000060,"internal":true}'
    expected = hmac.new(SECRET.encode(), f"sl1.{payload}".encode(), hashlib.sha256).digest()
    assert base64.urlsafe_b64decode(sig + "=") == expected


def test_missing_is_401_anything_invalid_is_403() -> None:
    auth = RelayAuth([SECRET])
    good = auth.sign("req_1", NOW + 60)
    prefix, payload, sig = good.split(".")
    forged_payload = base64.urlsafe_b64encode(b'{"rid":"req_1","exp":1700000060,"internal":true}').rstrip(b"=")
    assert _status(auth, None) == 401
    assert _status(auth, "") == 401
    for bad in [
        SECRET + "x",
        SECRET[:-1],
        "sl1",
        "sl1..",
        f"sl2.{payload}.{sig}",
        f"{prefix}.{payload}.{sig[:-1]}",
        f"{prefix}.{forged_payload.decode()}.{sig}",
        sign_token("another-secret-0000000000", "req_1", NOW + 60),
        f"{prefix}.!!!.{sig}",
        good + ".x",
    ]:
        assert _status(auth, bad) == 403, bad


def test_signature_over_garbage_payload_is_403_not_a_crash() -> None:
    auth = RelayAuth([SECRET])
    for payload in ("e30", "bm90IGpzb24", "eyJyaWQiOjF9"):  # {}, "not json", {"rid":1}
        signed = f"sl1.{payload}"
        sig = base64.urlsafe_b64encode(hmac.new(SECRET.encode(), signed.encode(), hashlib.sha256).digest())
        assert _status(auth, f"{signed}.{sig.rstrip(b'=').decode()}") == 403


def test_rotation_first_secret_signs_every_secret_verifies() -> None:
    old_token = RelayAuth([OLD]).sign("req_1", NOW + 60)
    rotated = RelayAuth([SECRET, OLD])
    assert _status(rotated, old_token) == 200
    assert _status(rotated, OLD) == 200
    assert rotated.sign("req_1", NOW + 60) == sign_token(SECRET, "req_1", NOW + 60)
    assert _status(RelayAuth([SECRET]), old_token) == 403


def test_secrets_must_be_long_enough() -> None:
    for secrets in ([], ["short"], [SECRET, "short"]):
        with pytest.raises(ValueError, match="16 characters"):
            RelayAuth(secrets)
