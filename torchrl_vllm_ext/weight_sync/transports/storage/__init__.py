"""The storage transport: memory-mapped A/B slots (sender, receiver, actor part, slots)."""
