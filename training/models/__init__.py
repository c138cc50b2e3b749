"""Model families, presets, FLOPs, ELECTRA, distillation, task models, export."""
