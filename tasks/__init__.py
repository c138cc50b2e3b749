"""Data stages: one module per stage, a pure core over Arrow tables plus its Prefect task."""
