"""Model pieces: checkpoint reading, split plans, KV caches, tree masks, edge and trunk stacks."""
