"""vLLM engine replicas on Ray, by the process each module runs in.

- :mod:`.replica`: inside each replica's Ray actor (the actor, its vLLM engines, the engine
  core's error read back from stderr).
- :mod:`.driver`: in the process that holds a :class:`~.driver.service.VLLMService` (the
  owner that launched it, or a handle): the service facade, the pool of replicas, routing,
  generation, control, Ray.
- :mod:`.handles`: a service used from other processes: the owner/handle split, the
  directory actor that mirrors the pool, a handle's pool view, the owner's reserved port.

The modules at this level are plain data and rules every process shares: the service's
options (:mod:`.config`), replica views and the narrow protocols weight sync sees
(:mod:`.fleet`), the one fan-out (:mod:`.calls`), pause / sleep states (:mod:`.serving`),
request checks (:mod:`.validation`), adapters (:mod:`.adapters`), vLLM outputs as
columnar batches (:mod:`.outputs`), routing strategies (:mod:`.routing`, :mod:`.sessions`)
and node placement (:mod:`.placement`): pure functions the owner and a handle both run. Nothing here imports :mod:`torchrl_vllm_ext.weight_sync`.
"""
