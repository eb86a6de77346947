"""Self-tuning: values the mesh agrees on per epoch of rounds (H, the codec)."""
