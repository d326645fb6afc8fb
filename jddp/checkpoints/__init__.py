"""Checkpoints: the orbax store with exact resume, and weights in or out (init_from, export)."""
