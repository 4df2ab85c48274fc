"""The CUDA IPC transport: the trainer's buckets mapped on its own GPU (sender, receiver, handles)."""
