"""A node's network endpoint: the transport and membership as one PeerNetwork."""
