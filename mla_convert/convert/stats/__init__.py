"""Calibration statistics of each layer's attention input (second moments, RoPE pair norms)."""
