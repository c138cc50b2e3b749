"""Pretraining: train config, data, loop, losses, length schedule, the stage."""
