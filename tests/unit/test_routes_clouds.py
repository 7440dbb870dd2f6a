"""Per-route paths and auth kinds (issue 23): the templates filled in, Claude's Vertex form, the header
each auth style sends, and the configurations refused with one line naming the key."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sluice.normalizer.requests import build_request
from sluice.normalizer.requests.auth import AUTH_KINDS, HEADER_STYLES, auth_header
from sluice.normalizer.requests.paths import fill_path
from sluice.schemas.errors import ConfigError
from sluice.schemas.request import GenerateRequest, InvalidRequest
from sluice.worker import credentials
from sluice.worker.config import claude_on_vertex, load_config, request_options
from tests.helpers import checkout_hint

REQ = msgspec.convert({"messages": [{"role": "user", "content": "hi"}]}, GenerateRequest)
VERTEX = "/v1/projects/{project}/locations/{location}/publishers/google/models/{model}:streamGenerateContent?alt=sse"


def test_default_paths_are_the_dialects_own() -> None:
    paths = {d: build_request(d, REQ, model="m-1", api_key="k").path for d in ("openai-chat", "anthropic", "gemini")}
    assert paths == {
        "openai-chat": "/v1/chat/completions",
        "anthropic": "/v1/messages",
        "gemini": "/v1beta/models/m-1:streamGenerateContent?alt=sse",
    }


def test_a_route_path_is_filled_with_model_project_and_location() -> None:
    azure = "/openai/deployments/{model}/chat/completions?api-version=2024-10-21"
    got = build_request("openai-chat", REQ, model="gpt-4o-prod", api_key=None, path=azure)
    assert got.path == "/openai/deployments/gpt-4o-prod/chat/completions?api-version=2024-10-21"
    got = build_request("gemini", REQ, model="gemini-2.5-pro", api_key=None, path=VERTEX,
                        path_values={"project": "my-proj", "location": "global"})  # fmt: skip
    assert got.path == (
        "/v1/projects/my-proj/locations/global/publishers/google/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
    )
    assert fill_path("/m/{model}", "anthropic", model="claude-sonnet-4@20250514", values={}) == (
        "/m/claude-sonnet-4@20250514"  # Vertex's version suffix stays as it is
    )
    assert fill_path("/m/{model}", "gemini", model="synthetic;text=a:b", values={}) == "/m/synthetic%3Btext%3Da%3Ab"


@pytest.mark.parametrize("model", ["../x", "a/b", "a?b", "a b", "#a", ""])
def test_a_model_name_cannot_leave_its_segment(model: str) -> None:
    with pytest.raises(InvalidRequest):
        build_request("openai-chat", REQ, model=model or "", api_key=None, path="/d/{model}/chat")


def test_claude_on_vertex_moves_the_model_into_the_path() -> None:
    plain = msgspec.json.decode(build_request("anthropic", REQ, model="claude-x", api_key="k").body)
    got = build_request(
        "anthropic", REQ, model="claude-sonnet-4@20250514", api_key=None, vertex="true",
        path_values={"project": "p1", "location": "us-east5"},
    )  # fmt: skip
    body = msgspec.json.decode(got.body)
    assert (
        got.path
        == "/v1/projects/p1/locations/us-east5/publishers/anthropic/models/claude-sonnet-4@20250514:streamRawPredict"
    )
    assert body == {"anthropic_version": "vertex-2023-10-16", **{k: v for k, v in plain.items() if k != "model"}}
    assert "anthropic-version" not in got.headers and "x-api-key" not in got.headers
    with pytest.raises(ConfigError, match="vertex must be"):
        build_request("anthropic", REQ, model="c", api_key=None, vertex="yes")


def test_each_header_style_sends_the_secret_in_its_header() -> None:
    assert {s: auth_header(s, "K" * 24) for s in HEADER_STYLES} == {
        "bearer": {"authorization": "Bearer " + "K" * 24},
        "x-api-key": {"x-api-key": "K" * 24},
        "api-key": {"api-key": "K" * 24},
        "x-goog-api-key": {"x-goog-api-key": "K" * 24},
        "none": {},
    }
    assert auth_header("bearer", "") == {} and set(HEADER_STYLES) < set(AUTH_KINDS)


def _load(tmp_path: Path, route: str, env: dict[str, str] | None = None) -> Any:
    p = tmp_path / "sluice.toml"
    p.write_text("[routes.r]\n" + route)
    return load_config(p, env=env or {})


AZ = 'dialect = "openai-chat"\nbase_url = "https://res.openai.azure.com"\n'
VX = 'dialect = "gemini"\nbase_url = "https://aiplatform.googleapis.com"\n'


@pytest.mark.parametrize(
    ("route", "message"),
    [
        (AZ + 'auth = "basic"\n', "routes.r.auth: unknown kind 'basic'; known: bearer, x-api-key, api-key"),
        (AZ + 'path = "openai/v1/chat/completions"\n', "routes.r.path must start with '/'"),
        (VX + f'path = "{VERTEX}"\nlocation = "global"\n', "routes.r.path uses {project}: set routes.r.project"),
        (VX + f'path = "{VERTEX}"\nproject = "p"\n', "routes.r.path uses {location}: set routes.r.location"),
        (AZ + 'path = "/openai/{deployment}/x"\n', "routes.r.path: unknown placeholder {deployment}"),
        (VX + 'project = "a/b"\n', "routes.r.project: 'a/b' is not a plain name"),
        (AZ + 'credentials_file_env = "F"\n', 'routes.r.credentials_file_env is only for auth = "google"'),
        (
            'dialect = "anthropic"\nbase_url = "https://x"\nrequest_options = {vertex = "true"}\n',
            "routes.r.path uses {project}: set routes.r.project",
        ),
    ],
)
def test_a_route_that_cannot_work_is_refused_naming_the_key(tmp_path: Path, route: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + __import__("re").escape(message)):
        _load(tmp_path, route)


def test_a_kind_whose_extra_is_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = credentials.importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == "google.auth" else real(name, *a)

    monkeypatch.setattr(credentials.importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, VX + 'auth = "google"\n')
    assert str(info.value) == f'routes.r.auth: auth = "google" needs the google extra: {checkout_hint("google")}'


def test_the_clouds_configure(tmp_path: Path) -> None:
    cfg = _load(tmp_path, VX + f'auth = "google"\npath = "{VERTEX}"\nproject = "p"\nlocation = "us-central1"\n')
    assert cfg.routes["r"].auth == "google" and credentials.auth_kind(cfg.routes["r"]) == "google"
    cfg = _load(tmp_path, AZ + 'auth = "api-key"\napi_key_env = "AZURE_OPENAI_API_KEY"\n')
    assert credentials.auth_kind(cfg.routes["r"]) == "api-key"
    assert credentials.auth_kind(_load(tmp_path, AZ).routes["r"]) == "bearer"  # the dialect's, as before


def test_a_placeholder_key_is_named_at_start(caplog: pytest.LogCaptureFixture) -> None:
    from sluice.worker.config import Config, Route
    from sluice.worker.main import log_banner

    route = Route(dialect="openai-chat", base_url="http://127.0.0.1:8000", api_key_env="LOCAL_KEY")
    real = Route(dialect="anthropic", base_url="https://api.anthropic.com", api_key_env="REAL_KEY")
    vertex = Route(dialect="gemini", base_url="https://aiplatform.googleapis.com", auth="google",
                   credentials_file_env="SA_FILE")  # fmt: skip
    routes = {"local": route, "real": real, "vertex": vertex}
    with caplog.at_level("WARNING"):
        log_banner(Config(routes=routes), env={"LOCAL_KEY": "EMPTY", "REAL_KEY": "k" * 40})
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "route local: the key in LOCAL_KEY is shorter than 20 characters: taken as a placeholder "
        "(a keyless local server's dummy key) and not redacted",
        "route vertex: the service-account variable SA_FILE is not set; its jobs will fail (authentication)",
    ]


CLAUDE = 'dialect = "anthropic"\nbase_url = "https://us-east5-aiplatform.googleapis.com"\nmodel = "claude-4@2025"\n'
CLAUDE_VX = CLAUDE + 'auth = "google"\nproject = "my-project"\nlocation = "us-east5"\n'
RAW_PREDICT = "/v1/projects/{project}/locations/{location}/publishers/anthropic/models/{model}:streamRawPredict"


@pytest.mark.parametrize(
    ("route", "vertex"),
    [
        (CLAUDE_VX, True),  # the docs' example: the route says Vertex twice, no flag needed
        (CLAUDE + 'project = "p"\nlocation = "l"\n', True),
        (CLAUDE + f'path = "{RAW_PREDICT}"\nproject = "p"\nlocation = "l"\n', True),
        (CLAUDE_VX + "vertex = true\n", True),
        (CLAUDE_VX + 'request_options = { vertex = "true" }\n', True),  # the older string switch still reads
        (CLAUDE, False),
        (CLAUDE_VX + 'path = "/v1/messages"\n', False),  # a gateway in front of Vertex that takes the plain form
        (CLAUDE_VX + "vertex = false\n" + 'path = "/v1/messages"\n', False),
        (CLAUDE_VX + "vertex = false\n", False),  # the switch wins over auth, project and location
    ],
)
def test_claude_on_vertex_is_what_the_route_says(tmp_path: Path, route: str, vertex: bool) -> None:
    config = _load(tmp_path, route, env={"GOOGLE_APPLICATION_CREDENTIALS": "x"})
    r = config.routes["r"]
    assert claude_on_vertex(r) is vertex
    where = {k: v for k in ("project", "location") if (v := getattr(r, k)) is not None}
    req = build_request("anthropic", REQ, model="m", api_key=None, path=r.path, path_values=where, **request_options(r))
    body = json.loads(req.body)
    assert ("anthropic_version" in body, "model" in body) == (vertex, not vertex)


@pytest.mark.parametrize(
    ("route", "message"),
    [
        (CLAUDE_VX + f'vertex = false\npath = "{RAW_PREDICT}"\n', "routes.r.vertex = false contradicts routes.r.path"),
        (CLAUDE_VX + 'vertex = true\npath = "/v1/messages"\n', "routes.r.vertex = true contradicts routes.r.path"),
        (
            CLAUDE_VX + 'vertex = true\nrequest_options = { vertex = "false" }\n',
            "routes.r.vertex = true contradicts request_options.vertex = 'false'",
        ),
        (
            CLAUDE + 'request_options = { vertex = "yes" }\n',
            'routes.r.request_options.vertex must be "true" or "false"',
        ),
        (VX + "vertex = true\n", "routes.r.vertex is only for anthropic routes"),
    ],
)
def test_a_vertex_switch_that_contradicts_the_route_is_refused(tmp_path: Path, route: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        _load(tmp_path, route, env={"GOOGLE_APPLICATION_CREDENTIALS": "x"})
