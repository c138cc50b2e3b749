"""Ingestion: sources, readers, records, text clean-up and sentences (C kernels), dedup, stage."""
