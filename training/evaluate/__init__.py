"""Evaluation: the stage, intrinsic probes, prompting, generation, reports, plots."""
