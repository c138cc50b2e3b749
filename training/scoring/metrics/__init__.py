"""Evaluation metrics as pure functions, and their registry."""
