"""Downstream datasets described by config: readers, checks, and the stage."""
