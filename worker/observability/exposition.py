"""The admin endpoint's ``/metrics`` body: prometheus-client's own text, rendered with each series' name and
labels kept from one scrape to the next.

Rule: the bytes are prometheus-client's, exactly: ``generate_latest`` of the Prometheus text format 0.0.4
and of OpenMetrics 1.0.0, with the underscore escaping (what a Prometheus server negotiates). Anything else
(another escaping or version, a ``name[]`` filter, a method other than GET, a sample with an exemplar or a
native histogram) is prometheus-client's app answering. Why: a scrape renders about 230 samples, and
prometheus-client validates and escapes every label name and value of each, every time: about 60 % of a
scrape's CPU, spent on strings that do not change between scrapes (a series' labels are bounded, see
``sluice.worker.observability.telemetry``). The ``sample.name`` and labels to text step is cached; values are formatted
by prometheus-client's ``floatToGoString`` each time.

The worker's own instruments (``sluice.worker.observability.histograms``, most of the samples) skip the collection too:
their text is the exporter's translation of an instrument, made again only when the instrument gains a
series (the exporter gives every series of an instrument the union of their label names), and each scrape
writes their ``rows`` after it. The translation's values are checked against the rows when it is made: a
layout other than the one read (another exporter version) makes prometheus-client render the scrape.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import parse_qs

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric as Family

    from sluice.worker.observability.histograms import OwnCollector, OwnInstrument

__all__ = ["MetricsApp"]

Format = Literal["text", "openmetrics"]
# Enough for every series a worker makes (bounded attributes); past it the cache starts again.
_CACHE_LIMIT = 20_000
# What makes two requests the same for MetricsApp's reuse of an answer, and how many it keeps.
_REQUEST_KEYS = ("REQUEST_METHOD", "HTTP_ACCEPT", "HTTP_ACCEPT_ENCODING", "QUERY_STRING")
_ANSWERS_LIMIT = 16
# prometheus-client's sample names that go into a gauge family of their own in the 0.0.4 text.
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")


class MetricsApp:
    """A WSGI app for ``/metrics`` over ``registry``, answering as ``prometheus_client.make_wsgi_app``;
    ``own``: the worker's own instruments' collector in ``registry``, rendered from their rows. Scrapes run
    on the event loop, one at a time. ``reuse_s``: an answer is given again, unchanged, to the same request
    (method, ``Accept``, ``Accept-Encoding``, query) within that many seconds (``clock``'s), so a client
    asking in a loop costs the loop one rendering per ``reuse_s``, not one per request."""

    def __init__(
        self,
        registry: CollectorRegistry,
        own: OwnCollector | None = None,
        *,
        reuse_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from prometheus_client import make_wsgi_app

        self._registry = registry
        self._own = own
        self._reuse_s, self._clock = reuse_s, clock
        # request -> (when, status, headers, body); a few entries (what Prometheus and a person ask for).
        self._answers: dict[tuple[str, ...], tuple[float, str, list[tuple[str, str]], bytes]] = {}
        self._fallback = make_wsgi_app(registry)
        self._series: dict[Format, dict[tuple[Any, ...], str]] = {"text": {}, "openmetrics": {}}
        self._headers: dict[Format, dict[tuple[str, str, str, str], str]] = {"text": {}, "openmetrics": {}}
        self._layouts: dict[str, _Layout] = {}  # own instrument name -> its text, for its number of series

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if self._reuse_s <= 0:
            return self._answer(environ, start_response)
        key = tuple(str(environ.get(k, "")) for k in _REQUEST_KEYS)
        now = self._clock()
        if (last := self._answers.get(key)) is not None and now - last[0] < self._reuse_s:
            start_response(last[1], last[2])
            return [last[3]]
        got: list[Any] = []

        def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], object]:
            got[:] = [status, headers]
            return start_response(status, headers) if exc_info is None else start_response(status, headers, exc_info)

        body = b"".join(self._answer(environ, keep))
        if len(self._answers) >= _ANSWERS_LIMIT:
            self._answers.clear()
        self._answers[key] = (now, got[0], got[1], body)
        return [body]

    def _answer(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        from prometheus_client.exposition import choose_encoder, gzip_accepted

        encoder, content_type = choose_encoder(environ.get("HTTP_ACCEPT", ""))
        fmt = _format_of(encoder)
        body = None
        if fmt is not None and environ.get("REQUEST_METHOD") == "GET" and "name[]" not in _query(environ):
            body = self.render(fmt)
        if body is None:
            return self._fallback(environ, start_response)  # type: ignore[no-any-return]
        headers = [("Content-Type", content_type)]
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING", "")):
            # Level 1, not prometheus-client's 9: a sixth of the time (0.06 ms for 30 KB) for 2.5 KB, not 2.1.
            body = gzip.compress(body, compresslevel=1)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    def render(self, fmt: Format) -> bytes | None:
        """The registry as ``fmt``; None when a sample needs prometheus-client's own renderer."""
        if len(self._series[fmt]) > _CACHE_LIMIT:
            self._series[fmt] = {}
        out: list[str] = []
        text = fmt == "text"
        own = self._own
        with own.apart() if own is not None else nullcontext():
            if not self._families(fmt, out):
                return None
        if own is not None and not self._own_rows(own, text, out):
            return None
        if not text:
            out.append("# EOF\n")
        return "".join(out).encode()

    def _families(self, fmt: Format, out: list[str]) -> bool:
        """The registry's collection rendered into ``out``; False when prometheus-client must render."""
        return self._render(self._registry.collect(), fmt == "text", out)

    def _render(self, families: Iterable[Family], text: bool, out: list[str]) -> bool:
        """``families`` rendered into ``out``; False when prometheus-client must render."""
        from prometheus_client.utils import floatToGoString

        fmt: Format = "text" if text else "openmetrics"
        series, headers = self._series[fmt], self._headers[fmt]
        for metric in families:
            key = (metric.name, metric.type, metric.documentation, metric.unit)
            if (head := headers.get(key)) is None:
                head = headers[key] = _text_header(*key) if text else _om_header(*key)
            out.append(head)
            later: dict[str, list[str]] = {}
            for s in metric.samples:
                if s.native_histogram is not None or (s.exemplar is not None and not text):
                    return False
                labels = s.labels
                skey = (s.name, *labels.items())
                if (prefix := series.get(skey)) is None:
                    prefix = series[skey] = _prefix(s.name, labels, text)
                if s.timestamp is None:
                    stamp = ""
                elif text:
                    stamp = f" {int(float(s.timestamp) * 1000):d}"
                else:
                    stamp = f" {s.timestamp}"
                if s.value is not None:
                    value = floatToGoString(s.value)  # type: ignore[no-untyped-call]
                elif text:
                    return False  # prometheus-client's to fail on, as it does
                else:
                    value = ""
                line = f"{prefix} {value}{stamp}\n"
                if text and s.name.startswith(metric.name) and s.name[len(metric.name) :] in _OM_SUFFIXES:
                    later.setdefault(s.name[len(metric.name) :], []).append(line)
                else:
                    out.append(line)
            for suffix, lines in sorted(later.items()):
                out.append(_text_header(metric.name + suffix, "gauge", metric.documentation, ""))
                out.extend(lines)
        return True

    def _own_rows(self, own: OwnCollector, text: bool, out: list[str]) -> bool:
        """The worker's own instruments rendered into ``out``; False when prometheus-client must render."""
        if own.target is not None and not self._render([own.target], text, out):
            return False
        for inst in own.instruments:
            series, rows = inst.snapshot()
            if not rows:
                continue  # nothing recorded: no family, as the exporter gives none
            layout = self._layouts.get(inst.name)
            if layout is None or layout.series != series:
                if (layout := _layout(own, inst, series, rows)) is None:
                    return False
                self._layouts[inst.name] = layout
            head, prefixes = layout.text if text else layout.openmetrics
            last = layout.last_text if text else layout.last_openmetrics
            out.append(head)
            for i, row in enumerate(rows):
                # Most series have not moved since the last scrape (a histogram's buckets least of all).
                if (seen := last[i]) is not None and seen[0] == row:
                    out.append(seen[1])
                    continue
                if len(row) != len(prefixes[i]):
                    return False
                lines = "".join([f"{p} {_go_float(v)}\n" for p, v in zip(prefixes[i], row, strict=True)])
                last[i] = (row, lines)
                out.append(lines)
        return True


class _Layout:
    """An own instrument's text as the exporter translated it for its number of series: per format, the
    header and, per series, each sample's name and labels in the order of the row's values; and per series
    the row and lines last written."""

    __slots__ = ("last_openmetrics", "last_text", "openmetrics", "series", "text")

    def __init__(
        self, series: tuple[Any, ...], text: tuple[str, list[list[str]]], openmetrics: tuple[str, list[list[str]]]
    ) -> None:
        self.series = series  # the series it was made for, in order (a new or gone series makes another)
        self.text, self.openmetrics = text, openmetrics
        self.last_text: list[tuple[list[float], str] | None] = [None] * len(text[1])
        self.last_openmetrics: list[tuple[list[float], str] | None] = [None] * len(text[1])


def _layout(own: OwnCollector, inst: OwnInstrument, series: tuple[Any, ...], rows: list[list[float]]) -> _Layout | None:
    """``inst``'s layout from the exporter's translation of its last snapshot (``series`` and ``rows``);
    None when the translation's samples are not the rows' values one for one (or carry what the cached path
    does not write)."""
    from prometheus_client.utils import floatToGoString

    metric = inst.metric(time.time_ns(), last=True)
    families = own.families([metric]) if metric is not None else []
    if len(families) != 1:
        return None
    family = families[0]
    values = [v for row in rows for v in row]
    samples = family.samples
    if len(samples) != len(values):
        return None
    for s, v in zip(samples, values, strict=True):
        odd = s.timestamp is not None or s.exemplar is not None or s.native_histogram is not None
        if odd or s.name[len(family.name) :] in _OM_SUFFIXES or floatToGoString(s.value) != floatToGoString(v):  # type: ignore[no-untyped-call]
            return None
    key = (family.name, family.type, family.documentation, family.unit)
    per_series: dict[bool, list[list[str]]] = {True: [], False: []}
    at = 0
    for row in rows:
        for is_text, prefixes in per_series.items():
            prefixes.append([_prefix(s.name, s.labels, is_text) for s in samples[at : at + len(row)]])
        at += len(row)
    return _Layout(series, (_text_header(*key), per_series[True]), (_om_header(*key), per_series[False]))


def _go_float(v: float) -> str:
    """``floatToGoString(v)``, prometheus-client's text of a sample's value, with the integers a histogram's
    buckets and a counter hold written directly (most of an own instrument's values): a call of
    ``floatToGoString`` formats through ``repr`` and its branches each time. Go writes 1e+06 and up in exponent
    form, and ``repr`` 1e+16 and up; between, and for every other value, prometheus-client's own."""
    if type(v) is int and -1_000_000_000_000_000 < v < 1_000_000:
        return f"{v}.0"
    from prometheus_client.utils import floatToGoString

    return floatToGoString(v)  # type: ignore[no-any-return, no-untyped-call]


def _format_of(encoder: Callable[..., bytes]) -> Format | None:
    """Which of the two cached renderings prometheus-client's choice of ``encoder`` is, if either."""
    from prometheus_client import exposition, openmetrics

    om = openmetrics.exposition
    if encoder is exposition.generate_latest:
        return "text"
    if isinstance(encoder, partial) and encoder.keywords.get("escaping") == om.UNDERSCORES:
        if encoder.func is exposition.generate_latest and set(encoder.keywords) == {"escaping"}:
            return "text"
        if encoder.func is om.generate_latest and encoder.keywords == {"escaping": om.UNDERSCORES, "version": "1.0.0"}:
            return "openmetrics"
    return None


def _query(environ: WSGIEnvironment) -> dict[str, list[str]]:
    return parse_qs(environ.get("QUERY_STRING", ""))


def _text_header(name: str, kind: str, documentation: str, unit: str) -> str:
    from prometheus_client.openmetrics.exposition import escape_metric_name

    # The 0.0.4 text's names and types, as prometheus-client munges OpenMetrics ones.
    if kind == "counter":
        name += "_total"
    elif kind == "info":
        name, kind = name + "_info", "gauge"
    elif kind == "stateset":
        kind = "gauge"
    elif kind == "gaugehistogram":
        kind = "histogram"
    elif kind == "unknown":
        kind = "untyped"
    escaped = escape_metric_name(name)
    doc = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {escaped} {doc}\n# TYPE {escaped} {kind}\n"


def _om_header(name: str, kind: str, documentation: str, unit: str) -> str:
    from prometheus_client.openmetrics.exposition import (
        ALLOWUTF8,
        _escape,
        _is_legacy_labelname_rune,
        escape_metric_name,
    )

    escaped = escape_metric_name(name)
    head = f"# HELP {escaped} {_escape(documentation, ALLOWUTF8, _is_legacy_labelname_rune)}\n# TYPE {escaped} {kind}\n"
    return head + (f"# UNIT {escaped} {unit}\n" if unit else "")


def _prefix(name: str, labels: dict[str, str], text: bool) -> str:
    """A sample's name and labels, as prometheus-client writes them."""
    from prometheus_client.openmetrics.exposition import (
        ALLOWUTF8,
        UNDERSCORES,
        _escape,
        _is_legacy_labelname_rune,
        escape_label_name,
        escape_metric_name,
    )

    pairs = ",".join(
        f'{escape_label_name(k)}="{_escape(v, ALLOWUTF8, _is_legacy_labelname_rune)}"'
        for k, v in sorted(labels.items())
    )
    escaped = escape_metric_name(name) if text else _escape(name, UNDERSCORES, _is_legacy_labelname_rune)
    return f"{escaped}{{{pairs}}}" if pairs else escaped
