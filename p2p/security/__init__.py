"""Who may talk to a node and how much: CURVE keys, sender identity, limits."""
