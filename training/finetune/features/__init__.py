"""Downstream tables to model inputs, per task type, and their collators."""
