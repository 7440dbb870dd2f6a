"""Worker configuration: TOML, environment overrides, and routes that can never carry credentials."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.schemas.errors import ConfigError
from sluice.worker.config import load_config


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sluice.toml"
    p.write_text(text)
    return p


def test_routes_timeouts_and_env_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
redis_url = "redis://file:6379/0"
max_in_flight = 8
[timeouts]
idle = 5.0
[routes.local]
dialect = "openai-chat"
base_url = "http://127.0.0.1:11434"
model = "llama3"
api_key_env = "LOCAL_KEY"
request_options = { max_tokens_field = "max_tokens" }
""",
    )
    cfg = load_config(path, env={"REDIS_URL": "redis://env:6379/1", "SLUICE_CONCURRENCY": "3"})
    assert cfg.redis_url == "redis://env:6379/1" and cfg.max_in_flight == 3
    assert cfg.timeouts.idle == 5.0 and cfg.timeouts.total == 600.0
    route = cfg.routes["local"]
    assert (route.dialect, route.model, route.api_key_env) == ("openai-chat", "llama3", "LOCAL_KEY")
    assert route.request_options == {"max_tokens_field": "max_tokens"}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[routes.x]\ndialect = "klingon"\nbase_url = "http://h"\n', "unknown dialect 'klingon'"),
        ('[routes.x]\ndialect = "anthropic"\nbase_url = "ftp://h"\n', "base_url must be an http(s) URL"),
        (
            '[routes.x]\ndialect = "anthropic"\nbase_url = "http://h"\nheaders = { "X-Api-Key" = "sk" }\n',
            "carries credentials; use api_key_env",
        ),
        (
            '[routes.x]\ndialect = "gemini"\nbase_url = "http://h"\nrequest_options = { max_tokens_field = "x" }\n',
            "unknown request option(s) for gemini: max_tokens_field",
        ),
        ('[routes.x]\ndialect = "anthropic"\nbase_url = "http://h"\napi_key = "sk-in-the-file"\n', "api_key"),
        ("max_in_flight = 0\n", "max_in_flight must be at least 1"),
        ("this is = not toml [\n", "not valid TOML"),
    ],
)
def test_bad_configuration_is_one_clear_error(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(_write(tmp_path, body), env={})
    assert message in info.value.message
    assert "sk-in-the-file" not in info.value.message


_PORT_RANGE = "--admin-port must be a TCP port between 1 and 65535 (leave it unset for no admin endpoint)"
_ROUTE = '[routes.x]\ndialect = "anthropic"\nbase_url = "http://h"\n'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[timeouts]\nfirst_byte = -1\n", "timeouts.first_byte must be above 0, not -1.0"),
        ("[timeouts]\nidle = 0\n", "timeouts.idle must be above 0, not 0.0"),
        ("[timeouts]\nconnect = -0.5\n", "timeouts.connect must be above 0, not -0.5"),
        ("[timeouts]\ntotal = -600\n", "timeouts.total must be above 0, not -600.0"),
        (_ROUTE + "[routes.x.timeouts]\nidle = -2\n", "routes.x.timeouts.idle must be above 0, not -2.0"),
        ("[retry]\nmax_attempts = 0\n", "retry.max_attempts must be at least 1, not 0"),
        ("[retry]\nbase_delay = -1\n", "retry.base_delay must be at least 0, not -1.0"),
        ('key_prefix = ""\n', "key_prefix must not be empty"),
        ('key_prefix = "a{b}"\n', "key_prefix 'a{b}' must not contain braces"),
        ('group = ""\n', "group must not be empty"),
        ("retention_seconds = 0\n", "retention_seconds must be at least 1, not 0"),
        ("max_job_bytes = 0\n", "max_job_bytes must be at least 1, not 0"),
        ("stream_maxlen = -1\n", "stream_maxlen must be at least 0, not -1"),
        ("max_deliveries = 0\n", "max_deliveries must be at least 1, not 0"),
        ("heartbeat_ms = 0\n", "heartbeat_ms must be at least 1, not 0"),
        ("heartbeat_ms = 5000\nclaim_idle_ms = 5000\n", "claim_idle_ms (5000) must be above heartbeat_ms (5000)"),
        ("shutdown_grace = -1\n", "shutdown_grace must be at least 0, not -1.0"),
        ("redis_outage_limit = 0\n", "redis_outage_limit must be above 0, not 0.0"),
        ("redis_socket_timeout = 1\n", "redis_socket_timeout must be above 1, not 1.0"),
        ("[limits]\nmax_line_bytes = 0\n", "limits.max_line_bytes must be at least 1, not 0"),
        ("admin_port = 0\n", "admin_port must be a TCP port between 1 and 65535 (leave it unset for no admin"),
        ("admin_port = 65536\n", "admin_port must be a TCP port between 1 and 65535"),
        ("admin_port = -1\n", "admin_port must be a TCP port between 1 and 65535"),
        ('admin_host = ""\n', "admin_host must not be empty"),
    ],
)
def test_values_that_cannot_work_are_refused_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, body), env={})
    assert info.value.message.startswith(message) and "\n" not in info.value.message


def test_the_environment_prefix_is_checked_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"key_prefix 'x\}' must not contain braces"):
        load_config(None, env={"SLUICE_KEY_PREFIX": "x}"})
    assert load_config(None, env={}).key_prefix == "sluice"  # the defaults pass their own checks


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file: "):
        load_config(tmp_path / "nope.toml", env={})


def test_removed_and_malformed_settings_say_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'http_client = "aiohttp" was removed .* use "wire"'):
        load_config(_write(tmp_path, 'http_client = "aiohttp"\n'), env={})
    with pytest.raises(ConfigError, match="SLUICE_CONCURRENCY must be a whole number of streams, not 'abc'"):
        load_config(None, env={"SLUICE_CONCURRENCY": "abc"})
    assert load_config(_write(tmp_path, 'http_client = "httpx"\n'), env={}).http_client == "httpx"


@pytest.mark.parametrize("value", ['"9102"', "9102.5", "true", "[9102]"])
def test_an_admin_port_of_the_wrong_type_names_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, f"admin_port = {value}\n"), env={})
    assert info.value.message.endswith("at `$.admin_port`") and "\n" not in info.value.message


def test_the_admin_endpoint_is_off_by_default_and_loopback(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, ""), env={})
    assert (config.admin_port, config.admin_host) == (None, "127.0.0.1")
    config = load_config(_write(tmp_path, 'admin_port = 9102\nadmin_host = "0.0.0.0"\n'), env={})
    assert (config.admin_port, config.admin_host) == (9102, "0.0.0.0")


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (
            "0",
            f"argument --admin-port: {_PORT_RANGE}, not 0",
        ),
        (
            "70000",
            f"argument --admin-port: {_PORT_RANGE}, not 70000",
        ),
        ("http", "argument --admin-port: not a port number: 'http'"),
    ],
)
def test_a_bad_admin_port_option_is_one_line(arg: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.worker.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--admin-port", arg])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"python -m sluice.worker: error: {message}"
