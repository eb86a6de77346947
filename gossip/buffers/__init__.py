"""Flat model buffers: the host vector, its chunked operations, device staging."""
