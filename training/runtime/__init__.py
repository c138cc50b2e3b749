"""Where a training worker runs: context, engine, DeepSpeed, checkpoints, telemetry, launcher."""
