"""The Prefect flows (one per module), their steps, stage tracking, summaries."""
