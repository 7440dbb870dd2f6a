"""The fake provider's SigV4 check for Bedrock requests: the signature recomputed with botocore's signer.

Rule: a request signed ``AWS4-HMAC-SHA256`` is accepted only when its credential scope names the fake's
test access key, a region and the ``bedrock`` service, and the signature botocore computes over the
headers it lists (``SignedHeaders``), at its ``x-amz-date``, with the test secret key, equals the one
sent, byte for byte (compared in constant time). Nothing else is trusted: a changed body, path, query,
signed header or date breaks it. botocore is the ``aws`` extra; without it no signed request passes.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping

__all__ = ["FAKE_AWS_ACCESS_KEY_ID", "FAKE_AWS_SECRET_ACCESS_KEY", "verify_sigv4"]

# A test key pair (never a real one): the worker signs with it through the ordinary AWS chain (the
# AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment variables) and the fake recomputes.
FAKE_AWS_ACCESS_KEY_ID = "AKIASLUICEFAKE000001"
FAKE_AWS_SECRET_ACCESS_KEY = "sluice/fake/secret/key/for/tests/only/0001"

_AUTH = re.compile(
    r"AWS4-HMAC-SHA256 Credential=(?P<key>[^/]+)/(?P<date>\d{8})/(?P<region>[a-z0-9-]+)/(?P<service>[a-z0-9-]+)"
    r"/aws4_request, ?SignedHeaders=(?P<signed>[a-z0-9;-]+), ?Signature=(?P<signature>[0-9a-f]{64})"
)


def verify_sigv4(method: str, url: str, headers: Mapping[str, str], body: bytes) -> str | None:
    """None when the request's SigV4 signature is right; else why not (one line, safe to answer)."""
    m = _AUTH.fullmatch(headers.get("authorization", "").strip())
    if m is None:
        return "the authorization header is not a SigV4 signature"
    if m["key"] != FAKE_AWS_ACCESS_KEY_ID:
        return "The security token included in the request is invalid."
    if m["service"] != "bedrock":
        return f"credential scope names service {m['service']!r}, not 'bedrock'"
    amz_date = headers.get("x-amz-date", "")
    if amz_date[:8] != m["date"]:
        return "x-amz-date does not match the credential scope's date"
    signed = m["signed"].split(";")
    if "host" not in signed or any(name not in headers for name in signed):
        return "a signed header is missing from the request"
    try:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import Credentials
    except ImportError:
        from sluice.worker.extras import install_hint

        return f"the fake provider checks SigV4 with botocore: {install_hint('aws')}"
    request = AWSRequest(method=method, url=url, data=body, headers={name: headers[name] for name in signed})
    request.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(FAKE_AWS_ACCESS_KEY_ID, FAKE_AWS_SECRET_ACCESS_KEY), "bedrock", m["region"])
    if signer.signed_headers(signer.headers_to_sign(request)) != m["signed"]:
        return "SignedHeaders does not list the headers sent"
    expected = signer.signature(signer.string_to_sign(request, signer.canonical_request(request)), request)
    if not hmac.compare_digest(str(expected), m["signature"]):
        return "The request signature we calculated does not match the signature you provided."
    return None
