"""Checkpoints: the orbax store with exact resume, weights in or out (init_from, export), and
Hugging Face checkpoints in and out (`hf`)."""
