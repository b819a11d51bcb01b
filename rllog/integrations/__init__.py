"""Integrations with trainers: :mod:`rllog.integrations.transformers` (any HF Trainer) and :mod:`rllog.integrations.trl`."""
