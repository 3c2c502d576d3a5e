"""Measuring a window inside the fit: per-batch timers, this rank's probe, Lightning's loop internals, DDP reduction."""
