"""The README and the docs pages say what the code does: the generated dialect tables, the two commands,
every configuration key and every command are documented where a reader looks for them."""

from __future__ import annotations

import argparse
import html
import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from sluice.cli.main import build_parser
from sluice.normalizer.adapters.tables import BEGIN, END, render_tables
from sluice.normalizer.limits import Limits
from sluice.worker.config import Config, RetryPolicy, Route, Timeouts, load_config
from sluice.worker.observability.telemetry import TelemetryConfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_the_dialect_tables_are_generated_from_the_adapters() -> None:
    text = (DOCS / "dialects.md").read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render_tables(), "run: python -m sluice.normalizer.adapters.tables (and paste)"


def test_readme_names_the_two_commands_ci_runs() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 requirements/dev.py test" in ci and "python3 requirements/dev.py test" in text


def _documented_configuration() -> str:
    """The TOML listings of the configuration page as one file, the commented-out optional keys included."""
    text = (DOCS / "configuration.md").read_text()
    blocks = re.findall(r"^```toml\n(.*?)^```", text, re.M | re.S)
    return re.sub(r"^#\s*(?=\w+\s*=)", "", "\n".join(blocks), flags=re.M)


def _missing(data: dict[str, Any], struct: type[msgspec.Struct], where: str) -> list[str]:
    return [f"{where}{f.name}" for f in msgspec.structs.fields(struct) if f.name not in data]


def test_every_configuration_key_is_in_the_configuration_page_as_a_valid_file(tmp_path: Path) -> None:
    listing = tmp_path / "sluice.toml"
    listing.write_text(_documented_configuration())
    load_config(listing, env={})  # the listing is a configuration a worker accepts
    data = tomllib.loads(listing.read_text())
    routes = data.get("routes", {})
    assert routes, "the listing shows a route"
    missing = _missing(data, Config, "")
    missing += _missing(data.get("timeouts", {}), Timeouts, "timeouts.")
    missing += _missing(data.get("retry", {}), RetryPolicy, "retry.")
    missing += _missing(data.get("limits", {}), Limits, "limits.")
    missing += _missing(data.get("telemetry", {}), TelemetryConfig, "telemetry.")
    in_some_route = {key: True for route in routes.values() for key in route}
    missing += _missing(in_some_route, Route, "routes.<name>.")
    assert missing == []


def test_every_command_is_in_the_cli_page() -> None:
    text = (DOCS / "cli.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert len(sub.choices) > 10
    assert [name for name in sub.choices if f"`sluice {name}" not in text] == []


def _sections(text: str) -> dict[str, str]:
    """The text under each ``### `` heading, by heading."""
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= _options(child)
    return found


def test_every_option_of_every_command_is_in_the_cli_page_under_its_command() -> None:
    sections = _sections((DOCS / "cli.md").read_text())
    common = sections["Options every command that talks to Redis takes"]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        f"sluice {name} {option}"
        for name, parser in sub.choices.items()
        for option in sorted(_options(parser))
        if f"`{option}`" not in sections.get(f"`sluice {name}`", "") + common
    ]
    assert missing == []


def _plain(markdown: str) -> str:
    """A cell as --help would say it: no code spans, links as their text, entities decoded."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown.replace("\\|", "|")).replace("`", "")
    return html.unescape(" ".join(text.split()))


def _rows(section: str) -> dict[str, str]:
    """``{option: what}`` of a section's option table (rows ``| `--opt` META | what |``), as plain text."""
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `(--[\w-]+)`[^|]*\| (.*) \|$", line)
        if m:
            rows[m[1]] = _plain(m[2])
    return rows


def test_every_option_row_says_what_the_command_s_help_says() -> None:
    """The page and ``--help`` agree word for word (a dialect added to the registry shows on both); a
    command's own row wins over the common table's."""
    sections = _sections((DOCS / "cli.md").read_text())
    common = _rows(sections["Options every command that talks to Redis takes"])
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    differ = []
    for name, parser in sub.choices.items():
        rows = common | _rows(sections.get(f"`sluice {name}`", ""))
        for action in parser._actions:
            long = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if long and action.help and long[0] in rows and _plain(action.help.replace("%%", "%")) != rows[long[0]]:
                differ.append(f"sluice {name} {long[0]}: page {rows[long[0]]!r}, --help {action.help!r}")
    assert differ == []


def test_every_dialect_the_registry_knows_is_on_the_cli_page() -> None:
    from sluice.normalizer.adapters import DIALECTS

    normalize = _sections((DOCS / "cli.md").read_text())["`sluice normalize`"]
    assert [d for d in DIALECTS if d not in normalize] == []


def test_every_command_s_help_renders() -> None:
    """argparse formats a help string with ``%``: a bare ``%`` in one breaks ``--help`` of its command."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        assert f"sluice {name}" in parser.format_help(), name
