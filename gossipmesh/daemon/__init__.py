"""The daemon's runtime: the training loop, checkpoints, metrics, the status server."""
