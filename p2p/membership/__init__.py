"""Membership: discovery, failure detection, the member table and its messages."""
