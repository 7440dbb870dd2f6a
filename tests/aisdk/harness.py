"""The suite's Node consumers: the AI SDK's own parser and assembler as the judge of ``?format=ai-sdk``,
ajv as a JavaScript consumer's validator of the published JSON Schema (``schema.mjs``), node-redis as a
consumer of the Redis streams (``consume.mjs``, the consumer guide's recipe).

Rule: the exact ``ai``, ``zod``, ``ajv`` and ``redis`` versions pinned by ``package-lock.json`` here are
installed with ``npm ci`` into ``.venv/node`` by the test session itself (again only when the lock
changes); without ``node`` and ``npm`` the tests that need them are skipped with a message saying so. ``check.mjs``
validates a body (or a URL) with ``parseJsonEventStream`` + ``uiMessageChunkSchema``, assembles it with
``readUIMessageStream`` and runs ``useChat``'s code path (``AbstractChat``); ``continue.mjs`` cuts a
stream mid-event and resumes it through that same code path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NODE_DIR = ROOT / ".venv" / "node"
_STAMP = NODE_DIR / ".sluice-lock"


def _node_major(node: str) -> int:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    return int(out.lstrip("v").split(".")[0])


@pytest.fixture(scope="session")
def ai_sdk() -> Path:
    """The folder holding ``node_modules/ai`` (installed on first use)."""
    return _installed("to check ?format=ai-sdk with the `ai` package")


@pytest.fixture(scope="session")
def node_harness() -> Path:
    """The same folder, for the Node consumers (ajv, node-redis)."""
    return _installed("for the Node.js consumer checks (ajv, node-redis)")


def _installed(purpose: str) -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip(f"node and npm are needed {purpose} (Node.js 18+)")
    if _node_major(node) < 18:
        pytest.skip(f"Node.js 18 or newer is needed {purpose}")
    manifest = (HERE / "package.json").read_bytes()
    lock = (HERE / "package-lock.json").read_bytes()
    digest = hashlib.sha256(manifest + b"\0" + lock).hexdigest()
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    # One installer at a time: the suite's parallel workers (xdist) share the folder.
    with (NODE_DIR.parent / "node.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        installed = (NODE_DIR / "node_modules" / "ai" / "package.json").is_file()
        if not (installed and _STAMP.is_file() and _STAMP.read_text() == digest):
            (NODE_DIR / "package.json").write_bytes(manifest)
            (NODE_DIR / "package-lock.json").write_bytes(lock)
            done = subprocess.run(
                [npm, "ci", "--prefix", str(NODE_DIR), "--no-audit", "--no-fund", "--ignore-scripts"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            if done.returncode != 0:
                pytest.fail(f"npm ci of the Node test harness (tests/aisdk) failed:\n{done.stderr[-2000:]}")
            _STAMP.write_text(digest)
    return NODE_DIR


def run_node(ai_dir: Path, script: str, *args: str, stdin: bytes | None = None, timeout: float = 60) -> tuple[int, Any]:
    """Run one of the harness scripts; (exit code, its JSON output)."""
    node = shutil.which("node")
    assert node is not None
    done = subprocess.run(
        [node, str(HERE / script), "--ai-dir", str(ai_dir), *args],
        input=stdin,
        capture_output=True,
        timeout=timeout,
    )
    if done.returncode == 2 or not done.stdout:
        raise AssertionError(f"{script} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    return done.returncode, json.loads(done.stdout)


def check_body(ai_dir: Path, body: bytes, *flags: str) -> tuple[int, Any]:
    return run_node(ai_dir, "check.mjs", "--no-chunks", *flags, "-", stdin=body)


def check_url(ai_dir: Path, url: str, *flags: str) -> tuple[int, Any]:
    return run_node(ai_dir, "check.mjs", "--url", url, *flags)


def parts_of(message: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A UI message's parts without the step boundaries (one per attempt), in a comparable shape."""
    out = []
    for p in (message or {}).get("parts", []):
        if p["type"] == "step-start":
            continue
        if p["type"] in ("text", "reasoning"):
            out.append({"type": p["type"], "text": p["text"], "state": p.get("state")})
        elif p["type"].startswith("tool-"):
            shape = {"type": p["type"], "toolCallId": p["toolCallId"], "state": p["state"], "input": p.get("input")}
            if p["state"] == "output-error":
                shape["errorText"] = p.get("errorText")
            out.append(shape)
        else:
            out.append({"type": p["type"]})
    return out


_IMPORTS = re.compile(
    rb"""(?:^|[;\n}])\s*(?:import|export)\s[^'"]*?from\s*['"]([^'"]+)['"]|(?:^|[;\n])\s*import\s*['"]([^'"]+)['"]"""
)
_CONDITIONS = ("browser", "import", "default")


def _export_target(entry: Any) -> str | None:
    """The file a package.json ``exports`` entry gives a browser's ES module import."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        for condition in _CONDITIONS:
            if condition in entry and (target := _export_target(entry[condition])) is not None:
                return target
    return None


def _resolve_bare(node_modules: Path, spec: str) -> Path:
    parts = spec.split("/")
    name = "/".join(parts[:2]) if spec.startswith("@") else parts[0]
    sub = "." + spec[len(name) :]
    pkg = json.loads((node_modules / name / "package.json").read_text())
    exports = pkg.get("exports")
    if isinstance(exports, dict) and not any(k.startswith(".") for k in exports):
        exports = {".": exports}
    target = _export_target(exports.get(sub)) if isinstance(exports, dict) else None
    if target is None and sub == ".":
        target = pkg.get("module") or pkg.get("main") or "index.js"
    if target is None:
        raise LookupError(f"{spec}: no browser/import export")
    return (node_modules / name / target).resolve()


# ``@vercel/oidc`` ships CommonJS only (a bundler converts it); ``ai`` imports it for its server-side gateway,
# which a page never calls. An ES module with the same names stands in, as its own browser build does.
_STUBS = {
    "@vercel/oidc": "data:text/javascript,"
    + quote(
        "export class AccessTokenMissingError extends Error {} export class RefreshAccessTokenFailedError extends "
        "Error {} export const getContext = () => ({}); export const getVercelOidcToken = async () => ''; "
        "export const getVercelOidcTokenSync = () => ''; export const getVercelToken = async () => '';"
    ),
}


def import_map(node_modules: Path, entry: str = "ai", prefix: str = "/node_modules") -> dict[str, str]:
    """An import map for a browser to load ``entry`` and everything it imports straight from
    ``node_modules`` (no bundler): every bare specifier reached, resolved with the browser conditions."""
    mapping: dict[str, str] = dict(_STUBS)
    seen: set[Path] = set()
    todo = [(entry, _resolve_bare(node_modules, entry))]
    root = node_modules.resolve()
    while todo:
        spec, path = todo.pop()
        if spec:
            mapping[spec] = f"{prefix}/{path.relative_to(root).as_posix()}"
        if path in seen:
            continue
        seen.add(path)
        for m in _IMPORTS.finditer(path.read_bytes()):
            target = (m.group(1) or m.group(2)).decode()
            if target.startswith("."):
                todo.append(("", (path.parent / target).resolve()))
            elif target not in mapping and target not in _STUBS:
                todo.append((target, _resolve_bare(node_modules, target)))
    return mapping
