"""Fine-tuning: config, data, loop, strategies, adapters, comparison, the stage."""
