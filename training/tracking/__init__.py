"""Experiment tracking in MLflow: runs and their lineage, the registry, base-model references."""
