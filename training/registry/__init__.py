"""The MLflow model registry, experiment tracking, and model references."""
