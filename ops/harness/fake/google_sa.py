"""A throwaway Google service-account file whose ``token_uri`` is the fake provider's token endpoint.

Rule: the key is generated fresh (RSA 2048, via ``cryptography``, which google-auth signs with) and
is good for nothing but the fake: tests and ``sluice demo`` refresh real google-auth credentials against
a local endpoint, with no network. ``available()`` says whether this installation can (the google extra
and ``cryptography``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

__all__ = ["available", "write_service_account"]


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("google", "cryptography")) and (
        importlib.util.find_spec("google.auth") is not None
    )


def write_service_account(path: Path, token_uri: str, project: str = "sluice-demo") -> Path:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )
    doc = {
        "type": "service_account",
        "project_id": project,
        "private_key_id": "fake-1",
        "private_key": pem,
        "client_email": f"sluice@{project}.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": token_uri,
    }
    path.write_text(json.dumps(doc))
    path.chmod(0o600)
    return path
