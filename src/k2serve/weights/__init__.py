"""Checkpoints: the streaming loader, the writer, presets and `make-checkpoint`."""
