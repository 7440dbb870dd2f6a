# The README's two commands; each creates .venv on first use (only Python 3.11+ is needed).
.PHONY: demo test lint
demo:
	python3 requirements/dev.py demo
test:
	python3 requirements/dev.py test
lint:
	python3 requirements/dev.py lint
