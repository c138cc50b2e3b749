"""Models, objectives, the Ray Train + DeepSpeed loops, fine-tuning and tracking."""
