"""The deterministic synthetic demo corpus and the labelled tasks drawn from it."""
