"""Trainer -> replicas weight sync: a verified, two-phase push (:mod:`.scheme`) over one of the
transports in :mod:`.transports` (storage, broadcast over NCCL or gloo, CUDA IPC, and ``auto``)."""
