"""Prefect tasks: read inputs, call hisr_core, write Parquet, log to MLflow."""

from tasks.runtime import configure_offline

configure_offline()
