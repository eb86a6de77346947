"""The transport: the network thread, its sockets, what it sends and receives."""
