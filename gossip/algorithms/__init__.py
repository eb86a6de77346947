"""The averaging algorithms and their registry by name."""
