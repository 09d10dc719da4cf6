"""Prefect flows: one module per stage, each a thin command-line entry point."""

from tasks.runtime import configure_offline

configure_offline()
