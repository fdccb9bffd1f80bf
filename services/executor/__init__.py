"""The executor: one device, the model and its paged KV cache, batched L4M commands."""
