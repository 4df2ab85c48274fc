"""The broadcast transport: packed buckets over NCCL or gloo (sender, receiver, the group)."""
