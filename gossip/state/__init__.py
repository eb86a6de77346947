"""State transfer: what a newcomer takes from live members, both sides of it."""
