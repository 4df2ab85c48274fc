"""Trainer -> replicas weight sync: packed broadcast (NCCL | gloo) or a memory-mapped double buffer."""
