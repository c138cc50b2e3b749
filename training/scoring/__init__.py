"""Scoring a model's outputs: task metrics, text generation, and the reports and plots of a run."""
