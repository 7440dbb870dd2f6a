"""Where the archive goes: a local directory (the default, no extras) or an object store by URL.

Rule: a destination stores whole objects under fixed names and nothing else: ``put`` replaces an object
atomically (a reader sees the old bytes or the new, never part), ``get`` returns ``None`` for a missing
object, ``list`` names the objects under a prefix. A plain path is a ``LocalStore`` (write to a temporary
file, fsync, rename, fsync the directory). A URL (``s3://``, ``gs://``, ``az://``, ``file://``,
``memory://``) is an ``ObjectStore`` over obstore (the ``archive`` extra): one Rust library (the
``object_store`` crate) with every store's native API, its atomic whole-object PUT, and each store's
standard credential chain (environment, profile files, instance and workload identity), so no credential is
ever in sluice's configuration. Failures of either raise ``DestinationError`` (retried by the archiver).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Protocol

import anyio.to_thread

from sluice.worker.extras import install_hint

__all__ = ["Destination", "DestinationError", "LocalStore", "ObjectStore", "open_destination"]


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
        self._obs = obstore
        try:
            self._store = from_url(url)
        except Exception as exc:  # obstore raises its own error types per store: one boundary, typed here
            first = (str(exc).strip().splitlines() or [""])[0]  # obstore's messages run on with debug detail
            raise DestinationError(f"cannot open the archive destination {url} ({first})") from exc

    async def put(self, name: str, data: bytes) -> None:
        try:
            await self._obs.put_async(self._store, name, data)
        except Exception as exc:
            raise DestinationError(f"writing {name} to {self.url} failed ({type(exc).__name__})") from exc

    async def get(self, name: str) -> bytes | None:
        try:
            result = await self._obs.get_async(self._store, name)
            return bytes(await result.bytes_async())
        except FileNotFoundError:
            return None
        except Exception as exc:
            if type(exc).__name__ == "NotFoundError":
                return None
            raise DestinationError(f"reading {name} from {self.url} failed ({type(exc).__name__})") from exc

    async def list(self, prefix: str) -> list[str]:
        try:
            out: list[str] = []
            async for batch in self._obs.list(self._store, prefix=prefix or None):
                out += [str(meta["path"]) for meta in batch]
            return sorted(out)
        except Exception as exc:
            raise DestinationError(f"listing {prefix} in {self.url} failed ({type(exc).__name__})") from exc


def open_destination(target: str) -> Destination:
    """A plain path is a local directory; ``scheme://...`` an object store."""
    if "://" in target:
        return ObjectStore(target)
    return LocalStore(target)
