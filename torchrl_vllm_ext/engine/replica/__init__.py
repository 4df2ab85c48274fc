"""What runs inside a replica's Ray actor: :class:`~.actor.VLLMReplica`, the engine it drives
(:class:`~.engine.Engine`: :class:`~.inproc.InprocEngine` on CPU, stepped by its
:class:`~.engine_thread.EngineThread`,
:class:`~.async_engine.AsyncEngine` with vLLM's engine-core process on GPU), and the engine
core's own error read back from the actor's stderr (:mod:`.stderr_tail`); TorchRL's
actor calls (:mod:`.torchrl_calls`)."""
