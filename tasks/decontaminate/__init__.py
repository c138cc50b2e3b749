"""Decontamination: drop documents that overlap downstream eval sets."""
