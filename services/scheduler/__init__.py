"""The scheduler: the L4M service (resource tables, validation, batching, executors)."""
