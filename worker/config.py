"""Worker configuration: a TOML file, a few environment overrides, and the routes jobs may name.

Rule: a route holds everything about where a request goes (dialect, base URL, default model, the *name*
of the env var that holds the API key, extra non-secret headers, timeouts); jobs only name a route. The
key itself is read from the environment when a request is sent and never stored, logged or echoed.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Literal, get_args

import msgspec

from sluice.normalizer.adapters import DIALECTS
from sluice.normalizer.limits import Limits
from sluice.normalizer.pricing import PriceError, Prices, check_prices
from sluice.normalizer.requests import default_path, options_for
from sluice.normalizer.requests.auth import AUTH_KINDS
from sluice.normalizer.requests.base import SECRET_HEADERS  # credentials come only from api_key_env
from sluice.normalizer.requests.paths import PATH_FIELDS
from sluice.schemas.errors import ConfigError
from sluice.schemas.events import CheckPolicy
from sluice.schemas.jobs import DEFAULT_MAX_JOB_BYTES, JobTimeouts
from sluice.worker.capacity.fallback import check_fallbacks
from sluice.worker.credentials import auth_kind, unavailable
from sluice.worker.files import UnreadableFile, read_input
from sluice.worker.observability.telemetry import TelemetryConfig
from sluice.worker.redis.connect import env_flag

__all__ = [
    "BUDGET_WINDOWS",
    "HTTP_CLIENTS",
    "Budget",
    "BudgetWindow",
    "Config",
    "HttpClientName",
    "RetryPolicy",
    "Route",
    "Tenant",
    "TenantBudget",
    "Timeouts",
    "check_admin_port",
    "claude_on_vertex",
    "env_flag",
    "load_config",
    "request_options",
]

# The upstream HTTP clients (worker/http/); named here so loading a configuration imports no httpx.
HttpClientName = Literal["wire", "httpx"]
HTTP_CLIENTS: tuple[HttpClientName, ...] = get_args(HttpClientName)


class Timeouts(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Seconds. ``first_byte``: until the response headers and the first event; ``idle``: without a
    content event (pings and comments do not count); ``total``: the whole attempt."""

    connect: float = 10.0
    first_byte: float = 60.0
    idle: float = 60.0
    total: float = 600.0
    # Upper bounds a job's own overrides are clamped to.
    max_total: float = 3600.0

    def apply(self, job: JobTimeouts | None) -> Timeouts:
        if job is None:
            return self

        def pick(mine: float, theirs: float | None) -> float:
            return mine if theirs is None else min(theirs, self.max_total)  # above 0: decode_job refuses the rest

        return Timeouts(
            connect=pick(self.connect, job.connect),
            first_byte=pick(self.first_byte, job.first_byte),
            idle=pick(self.idle, job.idle),
            total=pick(self.total, job.total),
            max_total=self.max_total,
        )


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_attempts: int = 3
    base_delay: float = 0.5
    max_delay: float = 8.0
    max_total: float = 30.0  # seconds of back-off summed over one request
    max_retry_after: float = 20.0  # a provider's retry-after is honoured up to this


class Route(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    dialect: str
    # The provider named in stream.start (e.g. "groq" on the openai-chat dialect); default: the dialect's.
    provider: str | None = None
    base_url: str
    model: str | None = None
    api_key_env: str | None = None
    headers: dict[str, str] = {}
    timeouts: Timeouts | None = None
    # Dialect request-builder settings, e.g. openai-chat max_tokens_field = "max_tokens" for servers
    # (Ollama, LM Studio) that ignore max_completion_tokens.
    request_options: dict[str, str] = {}
    # Send the request id upstream as ``x-sluice-request-id`` (off: producer-chosen ids stay with sluice).
    send_request_id: bool = False
    # Where the request goes under base_url, query included; {model}, {project} and {location} are filled
    # in (e.g. Azure's "/openai/deployments/{model}/chat/completions?api-version=2024-10-21"). Default: the
    # dialect's own path.
    path: str | None = None
    # How the credential is sent (sluice.normalizer.requests.auth.AUTH_KINDS); default: the dialect's header.
    auth: str | None = None
    # Vertex AI: the project and location ("us-east5", or "global") {project} and {location} stand for.
    project: str | None = None
    location: str | None = None
    # auth = "google": the env var naming a service-account JSON file (unset: application-default credentials).
    credentials_file_env: str | None = None
    # auth = "aws-sigv4": the AWS region the request is signed for (and bedrock's endpoint is in).
    region: str | None = None
    # Claude on Vertex AI (anthropic routes): Vertex's body (no model, anthropic_version) to its
    # :streamRawPredict path. Left out: what the route already says (``claude_on_vertex``).
    vertex: bool | None = None
    # Routes tried in order when an attempt here fails before anything was visible with an availability
    # category (sluice.worker.capacity.fallback); checked at start.
    fallbacks: list[str] = []
    # Capacity, enforced for the whole fleet in the route's Redis store (docs/design-capacity.md): left out,
    # no limit. A route with any of the three is "limited": its jobs wait instead of being sent past them.
    max_concurrency: int | None = None  # streams in flight at this provider, all workers together
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # estimated at admission, settled from the reported usage
    max_tokens: int | None = None  # the output estimate for jobs that set none (needed with tokens_per_minute)
    # Cooldown after a 429 / 529 / overloaded: the provider's hint clamped to [min, max], else base * 2^streak.
    cooldown_min_ms: int = 250
    cooldown_max_ms: int = 30_000
    cooldown_base_ms: int = 1_000
    # Added to the 60 s RPM / TPM window: admission at Redis and arrival at the provider differ in time.
    rate_window_margin_ms: int = 1_000
    # What a tool call or structured answer that fails its checks does on this route (a job may override it):
    # "record" (the stream completes, the verdict says what is wrong) or "fail" (the attempt ends failed with
    # invalid_output, never retried). docs/contract.md#output-checks.
    invalid_output: CheckPolicy = "record"

    @property
    def limited(self) -> bool:
        return (
            self.max_concurrency is not None
            or self.requests_per_minute is not None
            or (self.tokens_per_minute is not None)
        )


class Tenant(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's share of each limited route: ``weight`` turns per DRR round, ``max_concurrency`` permits
    at once (per route). ``[tenants."*"]`` is the default of every tenant not named."""

    weight: int = 1
    max_concurrency: int | None = None


BudgetWindow = Literal["day", "month", "none"]
BUDGET_WINDOWS: tuple[BudgetWindow, ...] = get_args(BudgetWindow)


class Budget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Money a job's spend may reach (sluice.worker.capacity.budgets): ``amount`` (a decimal, as prices are)
    in ``currency`` over ``window``, a calendar day or month in ``time_zone`` (``"none"``: never resets)."""

    amount: str | float | int | None = None
    currency: str = ""
    window: BudgetWindow = "none"
    time_zone: str = "UTC"
    # A job whose worst case its settled spend leaves no room for: "refuse" (failed, budget_exceeded) or
    # "wait" (for the window to turn or spend to be released, up to the attempt's timeouts.total, then refused).
    when_full: Literal["refuse", "wait"] = "refuse"


class TenantBudget(Budget, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's budget (``[budgets."*"]``: each tenant not named gets one of its own) over ``routes``
    (None: every route), and the budgets of the finer keys its jobs carry in ``budget_key`` nested in it
    (``keys."*"``: each key not named gets one of its own; without it an unnamed key has only the tenant's)."""

    routes: list[str] | None = None
    keys: dict[str, Budget] = {}


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "sluice"
    group: str = "sluice-workers"
    consumer: str = ""
    max_in_flight: int = 64
    retention_seconds: int = 24 * 3600
    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES
    # MAXLEN cap for per-request streams (0: none). Stated in the status record when used.
    stream_maxlen: int = 0
    max_deliveries: int = 5
    claim_idle_ms: int = 30_000
    heartbeat_ms: int = 5_000
    shutdown_grace: float = 30.0
    redis_outage_limit: float = 30.0
    # A reply slower than this counts as a connection failure (and is retried): a frozen Redis or a
    # partition is noticed instead of waited on forever. Must exceed the 1 s XREADGROUP block.
    redis_socket_timeout: float = 10.0
    # The upstream HTTP client of this process, for every route: "wire" (worker/http/wire.py) reads
    # cheapest with a bounded buffer; "httpx" honours the proxy environment (worker/http/httpx_client.py).
    http_client: HttpClientName = "wire"
    # Redis Cluster: redis_url names one seed node (env SLUICE_REDIS_CLUSTER=1). The shared streams then use
    # shard-tagged names (sluice.schemas.keys); job_shards spreads jobs over that many streams (and masters).
    redis_cluster: bool = False
    job_shards: int = 1
    # Accepted for old configurations only: appends always go on the routed pipes (worker/redis/route.py);
    # "redis-py" is ignored with a warning at start.
    cluster_appends: Literal["pipe", "redis-py"] = "pipe"
    # "replica": before a request's terminal status is published and its job acked, WAIT (bounded by
    # durability_timeout_ms) until durability_replicas replicas hold its log; the status says how it went.
    durability: Literal["primary", "replica"] = "primary"
    durability_replicas: int = 1
    durability_timeout_ms: int = 1000
    timeouts: Timeouts = Timeouts()
    retry: RetryPolicy = RetryPolicy()
    limits: Limits = Limits()
    routes: dict[str, Route] = {}
    tenants: dict[str, Tenant] = {}
    # Money per tenant and per budget_key, held for the whole fleet (docs/capacity.md#budgets).
    budgets: dict[str, TenantBudget] = {}
    # Jobs read at once when this worker serves a limited route: parking them is not gated by run slots.
    intake_batch: int = 100
    # Seconds between this worker's trims of the jobs streams (the entries every group has settled; TRIM_JOBS in
    # sluice.worker.redis.scripts); 0: sluice never trims them (something else must).
    jobs_trim_interval: float = 60.0
    telemetry: TelemetryConfig = TelemetryConfig()
    # -- cost and the archive (issue 25; sluice.worker.cost, sluice.worker.observability.archive_watch) ----------------
    prices: dict[str, Prices] = {}  # route name -> prices per million tokens
    price_file: str = ""  # a LiteLLM model_prices_and_context_window.json: prices by the request's model
    prices_version: str = ""  # names the prices in every status; default: a hash of them
    archive_group: str = ""  # the archivers' consumer group: warn when its lag nears retention_seconds
    archive_lag_warn: float = 0.5  # ... past this fraction of retention_seconds
    # The admin endpoint (/healthz, /readyz, /metrics; sluice.worker.observability.admin): off unless a port is given;
    # loopback unless told otherwise (a pod sets "0.0.0.0" so the kubelet and Prometheus reach it).
    admin_port: int | None = None
    admin_host: str = "127.0.0.1"

    @property
    def consumer_name(self) -> str:
        return self.consumer or f"{socket.gethostname()}-{os.getpid()}"

    def route_timeouts(self, route: Route) -> Timeouts:
        return route.timeouts or self.timeouts


def _at_least(key: str, value: float, low: float, *, above: bool = False) -> None:
    if value < low or (above and value == low):
        bound = f"above {low:g}" if above else f"at least {low:g}"
        raise ConfigError(f"{key} must be {bound}, not {value!r}")


def check_admin_port(key: str, port: int) -> None:
    """Raises ``ConfigError`` naming ``key`` unless ``port`` is a TCP port (1-65535; unset is off, not 0)."""
    if isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(
            f"{key} must be a TCP port between 1 and 65535 (leave it unset for no admin endpoint), not {port!r}"
        )


def _check_timeouts(key: str, t: Timeouts) -> None:
    # A zero or negative timeout fires at once: every attempt would end `timeout` before a byte arrived.
    for field in ("connect", "first_byte", "idle", "total", "max_total"):
        _at_least(f"{key}.{field}", getattr(t, field), 0, above=True)


def _check_numbers(config: Config) -> None:
    """Values of the right type that cannot work: refused with one line naming the key."""
    if not config.key_prefix:
        raise ConfigError("key_prefix must not be empty (every key is named {key_prefix}:...)")
    if "{" in config.key_prefix or "}" in config.key_prefix:
        raise ConfigError(f"key_prefix {config.key_prefix!r} must not contain braces (they pick a Cluster hash slot)")
    if not config.group:
        raise ConfigError("group must not be empty (it names the consumer group)")
    _at_least("max_in_flight", config.max_in_flight, 1)
    _at_least("retention_seconds", config.retention_seconds, 1)  # EXPIRE 0 would delete the logs at once
    _at_least("max_job_bytes", config.max_job_bytes, 1)
    _at_least("stream_maxlen", config.stream_maxlen, 0)
    _at_least("max_deliveries", config.max_deliveries, 1)
    _at_least("heartbeat_ms", config.heartbeat_ms, 1)
    if config.claim_idle_ms <= config.heartbeat_ms:  # live workers' jobs would be taken over between heartbeats
        raise ConfigError(f"claim_idle_ms ({config.claim_idle_ms}) must be above heartbeat_ms ({config.heartbeat_ms})")
    _at_least("shutdown_grace", config.shutdown_grace, 0)
    _at_least("jobs_trim_interval", config.jobs_trim_interval, 0)
    _at_least("redis_outage_limit", config.redis_outage_limit, 0, above=True)
    _at_least("redis_socket_timeout", config.redis_socket_timeout, 1, above=True)  # the 1 s blocking reads
    if config.admin_port is not None:
        check_admin_port("admin_port", config.admin_port)
    if not config.admin_host:
        raise ConfigError('admin_host must not be empty (loopback: "127.0.0.1"; every interface: "0.0.0.0")')
    _check_timeouts("timeouts", config.timeouts)
    r = config.retry
    _at_least("retry.max_attempts", r.max_attempts, 1)
    for field in ("base_delay", "max_delay", "max_total", "max_retry_after"):
        _at_least(f"retry.{field}", getattr(r, field), 0)
    for field in ("max_line_bytes", "max_event_bytes", "max_total_bytes", "max_raw_events", "max_tool_argument_bytes"):
        _at_least(f"limits.{field}", getattr(config.limits, field), 1)


_PLACEHOLDER = re.compile(r"{([^{}]*)}")
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a project id or a location: one plain path segment


_VERTEX_METHODS = (":streamRawPredict", ":rawPredict")


def _path_says_vertex(route: Route) -> bool | None:
    """Whether the route's own path is Vertex's (a ``:streamRawPredict`` method); None without a path."""
    return None if route.path is None else any(m in route.path.split("?")[0] for m in _VERTEX_METHODS)


def _stated_vertex(key: str, route: Route) -> bool | None:
    """The route's explicit switch: the typed ``vertex`` key, or the older ``request_options.vertex`` string
    (still read: a configuration written for it keeps working); refused when the two disagree."""
    legacy = route.request_options.get("vertex")
    old = {"true": True, "false": False}.get(legacy) if legacy is not None else None
    if legacy is not None and old is None:
        raise ConfigError(f'{key}.request_options.vertex must be "true" or "false", not {legacy!r}')
    if route.vertex is not None and old is not None and route.vertex != old:
        raise ConfigError(f"{key}.vertex = {str(route.vertex).lower()} contradicts request_options.vertex = {legacy!r}")
    return route.vertex if route.vertex is not None else old


def claude_on_vertex(route: Route, key: str = "route") -> bool:
    """Whether an anthropic route sends Claude's Vertex form: its switch when set, else what the route already
    says: a Vertex path, or (with no path) ``auth = "google"``, ``project`` or ``location``. Raises
    ``ConfigError`` when the switch contradicts the path."""
    if route.dialect != "anthropic":
        return False
    stated, by_path = _stated_vertex(key, route), _path_says_vertex(route)
    if stated is not None and by_path is not None and stated != by_path:
        raise ConfigError(f"{key}.vertex = {str(stated).lower()} contradicts {key}.path {route.path!r}")
    if stated is not None:
        return stated
    if by_path is not None:
        return by_path
    return route.auth == "google" or route.project is not None or route.location is not None


def request_options(route: Route) -> dict[str, str]:
    """The options the route's request builder is given: its ``request_options``, and for anthropic the
    Vertex form as ``claude_on_vertex`` decides it."""
    options = dict(route.request_options)
    if route.dialect == "anthropic":
        options["vertex"] = "true" if claude_on_vertex(route) else "false"
    return options


def _check_where(name: str, route: Route) -> None:
    """The route's path template and auth kind: refused with one line naming the key."""
    key = f"routes.{name}"
    if route.auth is not None and route.auth not in AUTH_KINDS:
        raise ConfigError(f"{key}.auth: unknown kind {route.auth!r}; known: {', '.join(AUTH_KINDS)}")
    kind = auth_kind(route)
    if (reason := unavailable(kind)) is not None:
        raise ConfigError(f"{key}.auth: {reason}")
    if kind == "aws-sigv4" and not route.region:
        raise ConfigError(f'{key}.region is required with auth = "aws-sigv4" (the region requests are signed for)')
    if route.credentials_file_env is not None and kind != "google":
        raise ConfigError(f'{key}.credentials_file_env is only for auth = "google"')
    for field in ("project", "location"):
        value = getattr(route, field)
        if value is not None and not _SEGMENT.fullmatch(value):
            raise ConfigError(f"{key}.{field}: {value!r} is not a plain name (letters, digits, '.', '_', '-')")
    if route.vertex is not None and route.dialect != "anthropic":
        raise ConfigError(f"{key}.vertex is only for anthropic routes (a gemini route is on Vertex by its path)")
    claude_on_vertex(route, key)  # a switch that contradicts the path is refused here
    template = default_path(route.dialect, request_options(route)) if route.path is None else route.path
    if template is None:
        return
    if not template.startswith("/"):
        raise ConfigError(f"{key}.path must start with '/' (it follows base_url), not {template!r}")
    for placeholder in _PLACEHOLDER.findall(template):
        if placeholder not in PATH_FIELDS:
            raise ConfigError(
                f"{key}.path: unknown placeholder {{{placeholder}}}; known: {{model}}, {{project}}, {{location}}"
            )
        if placeholder != "model" and getattr(route, placeholder) is None:
            raise ConfigError(f"{key}.path uses {{{placeholder}}}: set {key}.{placeholder}")


_CAP_ROUTE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def _positive_limit(key: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"{key} = {value}: must be at least 1 (leave the key out for no limit)")


def _check_capacity(config: Config) -> None:
    """docs/design-capacity.md B.8: the limits of routes and tenants, one line naming the key."""
    for name, route in config.routes.items():
        key = f"routes.{name}"
        for field in ("max_concurrency", "requests_per_minute", "tokens_per_minute", "max_tokens"):
            _positive_limit(f"{key}.{field}", getattr(route, field))
        if route.tokens_per_minute is not None and route.max_tokens is None:
            raise ConfigError(
                f"{key}.tokens_per_minute needs {key}.max_tokens (the output estimate for jobs that set none)"
            )
        if route.limited and not _CAP_ROUTE_NAME.fullmatch(name):
            raise ConfigError(f"{key}: a route with limits must be named with letters, digits, '_', '.', '-'")
        for field in ("cooldown_min_ms", "cooldown_max_ms", "cooldown_base_ms"):
            _at_least(f"{key}.{field}", getattr(route, field), 1)
        if route.cooldown_min_ms > route.cooldown_max_ms:
            raise ConfigError(
                f"{key}.cooldown_min_ms ({route.cooldown_min_ms}) must not exceed "
                f"cooldown_max_ms ({route.cooldown_max_ms})"
            )
        _at_least(f"{key}.rate_window_margin_ms", route.rate_window_margin_ms, 0)
    for tenant, t in config.tenants.items():
        key = f"tenants.{tenant}" if _CAP_ROUTE_NAME.fullmatch(tenant) else f"tenants.{tenant!r}"
        _positive_limit(f"{key}.max_concurrency", t.max_concurrency)
        if not 1 <= t.weight <= 1000:
            raise ConfigError(f"{key}.weight = {t.weight}: must be 1..1000")
        if tenant != "*" and not 0 < len(tenant.encode()) <= 128:
            raise ConfigError(f"{key}: a tenant name is 1-128 bytes")
    _at_least("intake_batch", config.intake_batch, 1)


def _check(config: Config) -> Config:
    _check_numbers(config)
    _check_capacity(config)
    for name, route in config.routes.items():
        if route.timeouts is not None:
            _check_timeouts(f"routes.{name}.timeouts", route.timeouts)
        if route.dialect not in DIALECTS:
            raise ConfigError(f"route {name!r}: unknown dialect {route.dialect!r}; known: {', '.join(DIALECTS)}")
        if not route.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"route {name!r}: base_url must be an http(s) URL")
        unknown = sorted(set(route.request_options) - options_for(route.dialect))
        if unknown:
            raise ConfigError(f"route {name!r}: unknown request option(s) for {route.dialect}: {', '.join(unknown)}")
        bad = sorted(h for h in route.headers if h.lower() in SECRET_HEADERS)
        if bad:
            raise ConfigError(f"route {name!r}: header {bad[0]!r} carries credentials; use api_key_env")
        _check_where(name, route)
    check_fallbacks(config.routes)
    if not 1 <= config.job_shards <= 16384:
        raise ConfigError("job_shards must be between 1 and 16384")
    if config.durability_replicas < 1 or config.durability_timeout_ms < 1:
        raise ConfigError("durability_replicas and durability_timeout_ms must be at least 1")
    if config.durability_timeout_ms >= config.redis_socket_timeout * 1000:
        # a reply later than the socket timeout counts as a broken connection
        raise ConfigError("durability_timeout_ms must be below redis_socket_timeout")
    config.telemetry.check()
    _check_cost(config)
    _check_budgets(config)
    return config


def _budget_key(*names: str) -> str:
    return ".".join(n if _CAP_ROUTE_NAME.fullmatch(n) else repr(n) for n in names)


def _check_one_budget(key: str, budget: Budget) -> None:
    """Amount, currency, window and time zone of one budget table: one line naming the key."""
    from sluice.worker.capacity.budgets import amount_of, zone

    if budget.amount is None:
        raise ConfigError(f'{key}.amount is required (the money the budget holds, e.g. "100.00")')
    if not budget.currency:
        raise ConfigError(f'{key}.currency is required (a budget is an amount in one currency, e.g. "USD")')
    try:
        amount_of(budget)
    except PriceError as exc:
        raise ConfigError(f"{key}.amount {exc}") from None
    try:
        zone(budget.time_zone)
    except ValueError as exc:
        raise ConfigError(f"{key}.time_zone: {exc}") from None


def _route_currency(config: Config, route: str) -> tuple[str, str] | None:
    """The currency a route is priced in and where that is said; None when no price applies to it."""
    if (p := config.prices.get(route)) is not None:
        return p.currency, f"prices.{route}.currency"
    if config.price_file:
        return "USD", "price_file"  # LiteLLM's prices are in US dollars
    return None


def _budget_routes(config: Config, budget: TenantBudget) -> list[str]:
    """The routes whose jobs fall under ``budget``, with their configured fallbacks (an attempt there is
    charged to it at that route's prices)."""
    seen: list[str] = []
    for name in config.routes if budget.routes is None else budget.routes:
        for r in (name, *config.routes[name].fallbacks):
            if r not in seen:
                seen.append(r)
    return seen


def _check_budgets(config: Config) -> None:
    """docs/capacity.md#budgets: refused at load, one line naming the key."""
    for tenant, b in config.budgets.items():
        key = _budget_key("budgets", tenant)
        if tenant != "*" and not 0 < len(tenant.encode()) <= 128:
            raise ConfigError(f"{key}: a tenant name is 1-128 bytes")
        _check_one_budget(key, b)
        for route in b.routes or ():
            if route not in config.routes:
                raise ConfigError(f"{key}.routes: unknown route {route!r}")
        for name, kb in b.keys.items():
            kkey = _budget_key("budgets", tenant, "keys", name)
            if name != "*" and not 0 < len(name.encode()) <= 128:
                raise ConfigError(f"{kkey}: a budget key is 1-128 bytes")
            _check_one_budget(kkey, kb)
            if kb.currency != b.currency:
                raise ConfigError(
                    f"{kkey}.currency = {kb.currency}: the tenant's budget is in {b.currency}; "
                    "budgets that nest hold one currency"
                )
        for route in _budget_routes(config, b):
            priced = _route_currency(config, route)
            if priced is None:
                raise ConfigError(
                    f"{key}: route {route!r} has no prices (set [prices.{route}] or price_file); "
                    "a budget holds a job's worst case at its route's prices"
                )
            if priced[0] != b.currency:
                raise ConfigError(
                    f"{key}.currency = {b.currency}: route {route!r} is priced in {priced[0]} ({priced[1]}); "
                    "one budget holds one currency"
                )


def _check_cost(config: Config) -> None:
    from sluice.worker.cost import load_price_file

    for name, prices in config.prices.items():
        if name not in config.routes:
            raise ConfigError(f"prices.{name}: no route {name!r} (prices are keyed by route name)")
        try:
            check_prices(f"prices.{name}", prices)
        except PriceError as exc:
            raise ConfigError(str(exc)) from None
    if config.price_file:
        load_price_file(config.price_file)
    if not 0 < config.archive_lag_warn <= 1:
        raise ConfigError(f"archive_lag_warn must be above 0 and at most 1, not {config.archive_lag_warn!r}")


def load_config(path: str | os.PathLike[str] | None = None, *, env: dict[str, str] | None = None) -> Config:
    """Read the TOML file (``path``, else ``SLUICE_CONFIG``, else defaults), then apply the environment
    overrides ``REDIS_URL``, ``SLUICE_KEY_PREFIX``, ``SLUICE_CONCURRENCY``, ``SLUICE_REDIS_CLUSTER`` (1 / true /
    yes: on; 0 / false / no: off) and ``SLUICE_JOB_SHARDS``. Raises ``ConfigError``."""
    env = dict(os.environ) if env is None else env
    path = path or env.get("SLUICE_CONFIG")
    data: dict[str, object] = {}
    if path:
        p = Path(path)
        try:
            data = msgspec.toml.decode(read_input(p, "config file"))
        except UnreadableFile as exc:
            raise ConfigError(str(exc)) from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML ({exc})") from None
    if data.get("http_client") == "aiohttp":
        raise ConfigError(
            f'{path}: http_client = "aiohttp" was removed (it buffered bodies without bound); '
            'use "wire" (the default) or "httpx" (for an egress proxy)'
        )
    if url := env.get("REDIS_URL"):
        data["redis_url"] = url
    if prefix := env.get("SLUICE_KEY_PREFIX"):
        data["key_prefix"] = prefix
    if n := env.get("SLUICE_CONCURRENCY"):
        if not n.strip().isdigit():
            raise ConfigError(f"SLUICE_CONCURRENCY must be a whole number of streams, not {n!r}")
        data["max_in_flight"] = int(n)
    if flag := env.get("SLUICE_REDIS_CLUSTER"):
        data["redis_cluster"] = env_flag("SLUICE_REDIS_CLUSTER", flag)
    if shards := env.get("SLUICE_JOB_SHARDS"):
        if not shards.isdigit():
            raise ConfigError(f"SLUICE_JOB_SHARDS must be a number, not {shards!r}")
        data["job_shards"] = int(shards)
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None
    return _check(config)
