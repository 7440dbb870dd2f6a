"""Where the archive goes: a local directory (the default, no extras) or an object store by URL.

Rule: a destination stores whole objects under fixed names and nothing else: ``put`` replaces an object
atomically (a reader sees the old bytes or the new, never part), ``get`` returns ``None`` for a missing
object, ``list`` names the objects under a prefix. A plain path is a ``LocalStore`` (write to a temporary
file, fsync, rename, fsync the directory). A URL (``s3://``, ``gs://``, ``az://``, ``file://``,
``memory://``) is an ``ObjectStore`` over obstore (the ``archive`` extra): one Rust library (the
``object_store`` crate) with every store's native API, its atomic whole-object PUT, and each store's
standard credential chain (environment, profile files, instance and workload identity), so no credential is
ever in sluice's configuration. Failures of either raise ``DestinationError`` (retried by the archiver) with
one line naming the cause: the store's own error code and message (``NoSuchBucket: ...``, ``HTTP 403``,
``Connection refused``), never only the error's class. An S3 endpoint over plain HTTP (``AWS_ENDPOINT_URL=
http://...``, MinIO or a local gateway) is refused by the S3 client unless ``AWS_ALLOW_HTTP=true``: with the
variable unset, opening the destination says so at once instead of failing every write.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Protocol

import anyio.to_thread

from sluice.worker.extras import install_hint

__all__ = ["Destination", "DestinationError", "LocalStore", "ObjectStore", "open_destination", "store_error_cause"]

# The S3 client's endpoint variables, the first set wins (AWS_ENDPOINT_URL_S3 takes precedence in object_store).
_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
_XML_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]{1,300})</Message>")
_STATUS = re.compile(r"\bstatus: (\d{3})\b")
_OS_MESSAGE = re.compile(r'\bmessage: "([^"]{1,200})"')
_TIMING = re.compile(r" in [0-9.]+(?:ns|µs|us|ms|s)\b")


class DestinationError(Exception):
    """The destination failed (unreachable, refused, full); the archiver retries and does not ack."""


class Destination(Protocol):
    url: str

    async def put(self, name: str, data: bytes) -> None: ...
    async def get(self, name: str) -> bytes | None: ...
    async def list(self, prefix: str) -> list[str]: ...


class LocalStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"not an object name: {name!r}")
        return self.root / name

    def _put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def _get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None

    def _list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")
        )

    async def put(self, name: str, data: bytes) -> None:
        try:
            await anyio.to_thread.run_sync(self._put, name, data)
        except OSError as exc:
            raise DestinationError(f"writing {name} under {self.url} failed ({exc.strerror or exc})") from exc

    async def get(self, name: str) -> bytes | None:
        try:
            return await anyio.to_thread.run_sync(self._get, name)
        except OSError as exc:
            raise DestinationError(f"reading {name} under {self.url} failed ({exc.strerror or exc})") from exc

    async def list(self, prefix: str) -> list[str]:
        try:
            return await anyio.to_thread.run_sync(self._list, prefix)
        except OSError as exc:
            raise DestinationError(f"listing {prefix} under {self.url} failed ({exc.strerror or exc})") from exc


class ObjectStore:
    """An object store by URL through obstore; the store's own environment variables (``AWS_ENDPOINT_URL``,
    ``AWS_ALLOW_HTTP``, ``AWS_PROFILE``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...) configure it."""

    def __init__(self, url: str) -> None:
        try:
            import obstore
            from obstore.store import from_url
        except ImportError:
            raise DestinationError(
                f"archiving to {url.split('://')[0]}:// needs the archive extra: {install_hint('archive')}"
            ) from None
        self.url = url
        if refusal := _plain_http_refusal(url):
            raise DestinationError(f"cannot open the archive destination {url}: {refusal}")
        self._obs = obstore
        try:
            self._store = from_url(url)
        except Exception as exc:  # obstore raises its own error types per store: one boundary, typed here
            raise DestinationError(f"cannot open the archive destination {url} ({store_error_cause(exc)})") from exc

    async def put(self, name: str, data: bytes) -> None:
        try:
            await self._obs.put_async(self._store, name, data)
        except Exception as exc:
            raise DestinationError(f"writing {name} to {self.url} failed: {store_error_cause(exc)}") from exc

    async def get(self, name: str) -> bytes | None:
        try:
            result = await self._obs.get_async(self._store, name)
            return bytes(await result.bytes_async())
        except Exception as exc:
            # A missing object is None; a missing bucket (also FileNotFoundError to obstore) is a failure.
            missing = isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError"
            if missing and "NoSuchBucket" not in str(exc):
                return None
            raise DestinationError(f"reading {name} from {self.url} failed: {store_error_cause(exc)}") from exc

    async def list(self, prefix: str) -> list[str]:
        try:
            out: list[str] = []
            async for batch in self._obs.list(self._store, prefix=prefix or None):
                out += [str(meta["path"]) for meta in batch]
            return sorted(out)
        except Exception as exc:
            raise DestinationError(f"listing {prefix} in {self.url} failed: {store_error_cause(exc)}") from exc


def store_error_cause(exc: BaseException) -> str:
    """One line naming why an object store call failed, from obstore's message (a first line, then a debug
    dump of the whole error chain): the S3 error code and message, else the HTTP status, else the socket's
    own message, else the first line; with the error's class. No credential is in any of them."""
    text = str(exc)
    kind = type(exc).__name__
    if "BadScheme" in text:
        return f"the S3 client refused a plain-HTTP endpoint: set AWS_ALLOW_HTTP=true to allow it ({kind})"
    if code := _XML_CODE.search(text):
        message = _XML_MESSAGE.search(text)
        return f"{code.group(1)}: {message.group(1)} ({kind})" if message else f"{code.group(1)} ({kind})"
    if status := _STATUS.search(text):
        return f"HTTP {status.group(1)} ({kind})"
    if os_message := _OS_MESSAGE.search(text):
        return f"{os_message.group(1)} ({kind})"
    first = (text.strip().splitlines() or [""])[0]
    return f"{_TIMING.sub('', first)[:300]} ({kind})" if first else kind


def _plain_http_refusal(url: str) -> str | None:
    """Why an s3:// destination cannot work as configured: its endpoint is plain HTTP and AWS_ALLOW_HTTP is
    unset (set to anything, the S3 client judges it)."""
    if not url.startswith(("s3://", "s3a://")) or os.environ.get("AWS_ALLOW_HTTP"):
        return None
    for name in _ENDPOINT_VARS:
        if endpoint := os.environ.get(name, ""):
            if endpoint.lower().startswith("http://"):
                host = endpoint[len("http://") :].rpartition("@")[2]  # never a userinfo part in a message
                return f"{name} is plain HTTP (http://{host}), which the S3 client refuses unless AWS_ALLOW_HTTP=true"
            return None
    return None


def open_destination(target: str) -> Destination:
    """A plain path is a local directory; ``scheme://...`` an object store."""
    if "://" in target:
        return ObjectStore(target)
    return LocalStore(target)
