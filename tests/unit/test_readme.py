from pathlib import Path

from sluice.normalizer.adapters.tables import BEGIN, END, render_tables

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_dialect_tables_are_generated_from_the_adapters() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render_tables(), "run: python -m sluice.normalizer.adapters.tables (and paste)"


def test_readme_names_the_two_commands_ci_runs() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python3 requirements/dev.py test" in ci and "python3 requirements/dev.py test" in text
