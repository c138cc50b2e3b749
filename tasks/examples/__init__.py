"""Pretraining examples: cutting and packing, the objective cores, inspection, the stage."""
