"""The capacity keys' refusals (docs/design-capacity.md B.8): one test per refusal, the exact one-line message."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.schemas.errors import ConfigError, JobError
from sluice.schemas.jobs import decode_job
from sluice.worker.config import load_config

_R = '[routes.claude]\ndialect = "anthropic"\nbase_url = "http://h"\n'


def _load(tmp_path: Path, body: str) -> None:
    p = tmp_path / "sluice.toml"
    p.write_text(body)
    load_config(p, env={})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            _R + "max_concurrency = 0\n",
            "routes.claude.max_concurrency = 0: must be at least 1 (leave the key out for no limit)",
        ),
        (
            _R + "requests_per_minute = -5\n",
            "routes.claude.requests_per_minute = -5: must be at least 1 (leave the key out for no limit)",
        ),
        (
            _R + "tokens_per_minute = 0\nmax_tokens = 10\n",
            "routes.claude.tokens_per_minute = 0: must be at least 1 (leave the key out for no limit)",
        ),
        (
            _R + "max_tokens = 0\n",
            "routes.claude.max_tokens = 0: must be at least 1 (leave the key out for no limit)",
        ),
        (
            _R + "tokens_per_minute = 1000\n",
            "routes.claude.tokens_per_minute needs routes.claude.max_tokens (the output estimate for jobs that"
            " set none)",
        ),
        (
            '[routes."a b"]\ndialect = "anthropic"\nbase_url = "http://h"\nmax_concurrency = 2\n',
            "routes.a b: a route with limits must be named with letters, digits, '_', '.', '-'",
        ),
        (
            '[routes."a{b}"]\ndialect = "anthropic"\nbase_url = "http://h"\nrequests_per_minute = 2\n',
            "routes.a{b}: a route with limits must be named with letters, digits, '_', '.', '-'",
        ),
        (
            "[tenants.acme]\nmax_concurrency = 0\n",
            "tenants.acme.max_concurrency = 0: must be at least 1 (leave the key out for no limit)",
        ),
        ("[tenants.acme]\nweight = 0\n", "tenants.acme.weight = 0: must be 1..1000"),
        ('[tenants."*"]\nweight = 1001\n', "tenants.'*'.weight = 1001: must be 1..1000"),
        (_R + "cooldown_min_ms = 0\n", "routes.claude.cooldown_min_ms must be at least 1, not 0"),
        (
            _R + "cooldown_min_ms = 5000\ncooldown_max_ms = 4000\n",
            "routes.claude.cooldown_min_ms (5000) must not exceed cooldown_max_ms (4000)",
        ),
        (_R + "rate_window_margin_ms = -1\n", "routes.claude.rate_window_margin_ms must be at least 0, not -1"),
        ("intake_batch = 0\n", "intake_batch must be at least 1, not 0"),
    ],
)
def test_each_capacity_refusal_is_one_line_naming_the_key(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, body)
    assert info.value.message == message


def test_limits_and_tenants_load(tmp_path: Path) -> None:
    p = tmp_path / "sluice.toml"
    p.write_text(
        _R
        + "max_concurrency = 20\nrequests_per_minute = 600\ntokens_per_minute = 400000\nmax_tokens = 4096\n"
        + '[tenants."*"]\nweight = 1\n[tenants.acme]\nweight = 3\nmax_concurrency = 10\n'
    )
    config = load_config(p, env={})
    assert config.routes["claude"].limited and config.tenants["acme"].weight == 3


_JOB = '{"route":"a","request":{"messages":[{"role":"user","content":"hi"}]}'


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (',"priority":"urgent"', "invalid job: Invalid enum value 'urgent' - at `$.priority`"),
        (',"tenant":""', "invalid job: tenant must be 1-128 bytes, not 0"),
        (',"tenant":"' + "é" * 65 + '"', "invalid job: tenant must be 1-128 bytes, not 130"),
    ],
)
def test_a_job_with_a_bad_priority_or_tenant_is_refused(extra: str, message: str) -> None:
    with pytest.raises(JobError) as info:
        decode_job(_JOB + extra + "}")
    assert info.value.message == message


def test_jobs_without_the_fields_are_interactive_of_tenant_empty() -> None:
    job = decode_job(_JOB + "}")
    assert (job.priority, job.tenant_name) == ("interactive", "")
