"""`python -m paraloom` runs the CLI."""

from paraloom.cli import entry

entry()
