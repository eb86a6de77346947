"""The optimizer layer a training loop calls: GossipOptimizer and what it composes."""
