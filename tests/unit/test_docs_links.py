"""The documentation stays linked: every page under docs/ is reachable from README.md, and every relative
link in README.md and docs/ names a file that exists and, for a Markdown page, an anchor it has.

Anchors are GitHub's heading slugs (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for
repeats).
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _ of any script
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose_lines(text):
        if m := _HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(_HTML_ANCHOR.findall(line))
    return out


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, code blocks and code spans left out."""
    out: list[str] = []
    for line in _prose_lines(text):
        out += _LINK.findall(_CODE_SPAN.sub("", line))
    return out


def pages(root: Path) -> list[Path]:
    docs = root / "docs"
    return sorted(docs.rglob("*.md")) if docs.is_dir() else []


def broken_links(root: Path) -> list[str]:
    """Every relative link in README.md and the docs pages that does not resolve, as ``file: target (why)``."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for page in [root / "README.md", *pages(root)]:
        for target in links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            name = f"{page.relative_to(root)}: {target}"
            try:
                rel = dest.relative_to(root).as_posix()
            except ValueError:
                problems.append(f"{name} (outside the repository)")
                continue
            if not dest.exists():
                problems.append(f"{name} (no such file)")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in cache:
                    cache[dest] = anchors(dest.read_text())
                if anchor not in cache[dest]:
                    problems.append(f"{name} (no heading with that anchor in {rel})")
    return problems


def unlinked_pages(root: Path) -> list[str]:
    """The docs pages not reachable from README.md by following relative links."""
    reached: set[Path] = set()
    todo = deque([(root / "README.md").resolve()])
    while todo:
        page = todo.popleft()
        if page in reached or not page.is_file():
            continue
        reached.add(page)
        for target in links(page.read_text()):
            path_part = target.partition("#")[0]
            if path_part.endswith(".md") and not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                todo.append((page.parent / path_part).resolve())
    return [p.relative_to(root).as_posix() for p in pages(root) if p.resolve() not in reached]


def test_every_relative_link_resolves_to_a_file_and_an_anchor() -> None:
    assert broken_links(ROOT) == []


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    assert unlinked_pages(ROOT) == []


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("The HTTP/1.1 parser", "the-http11-parser"),
        ("durability = replica", "durability--replica"),
        ("The AI SDK's UI message stream", "the-ai-sdks-ui-message-stream"),
        ("`anthropic`", "anthropic"),
        ("Fourth session (2026-12-01): the cost", "fourth-session-2026-12-01-the-cost"),
        ("What [the relay](relay.md) sends", "what-the-relay-sends"),
        ("Запуск воркеров", "запуск-воркеров"),
        ("snake_case stays", "snake_case-stays"),
    ],
)
def test_slugs_are_githubs(heading: str, expected: str) -> None:
    assert slug(heading) == expected


def test_repeated_headings_get_numbered_anchors_and_code_blocks_have_none() -> None:
    text = "# Top\n\n## Run\n\n```toml\n# not a heading\n```\n\n## Run\n\n### Run\n"
    assert anchors(text) == {"top", "run", "run-1", "run-2"}


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_checks_find_a_missing_file_a_missing_anchor_and_an_unlinked_page(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "README.md": "# R\n\nSee [a](docs/a.md#there), [gone](docs/gone.md), [self](#nowhere), `[x](docs/no.md)`\n",
            "docs/a.md": "# A\n\n## Here\n\n[back](../README.md#r) [web](https://example.com/x.md) [b](b.md#here)\n",
            "docs/b.md": "# B\n\n## Here\n",
            "docs/orphan.md": "# Orphan\n\n[bad](../nope.py)\n",
        },
    )
    assert broken_links(root) == [
        "README.md: docs/a.md#there (no heading with that anchor in docs/a.md)",
        "README.md: docs/gone.md (no such file)",
        "README.md: #nowhere (no heading with that anchor in README.md)",
        "docs/orphan.md: ../nope.py (no such file)",
    ]
    assert unlinked_pages(root) == ["docs/orphan.md"]
