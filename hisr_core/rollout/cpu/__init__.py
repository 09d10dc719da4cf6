"""CPU-only speed-ups of the hf backend: the compiled decode-attention kernel."""
