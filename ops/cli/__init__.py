"""The ``sluice`` command: ``sluice.cli.main`` parses and dispatches, one module per operator task."""
