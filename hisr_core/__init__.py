"""HISR core library: environments, data contracts, models and the method's math.

No Prefect, DVC or MLflow in here; the pipeline's tasks and flows call into this package.
"""
