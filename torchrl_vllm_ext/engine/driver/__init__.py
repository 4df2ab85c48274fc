"""What runs in the process that holds a service (its owner, or a handle): the
:class:`~.service.VLLMService` facade and its parts (:mod:`.generate_calls` over
:mod:`.generation`, :mod:`.lora_serving`, :mod:`.control`, :mod:`.torchrl_engine`), the
owner's :class:`~.pool.ReplicaPool` and its parts (:mod:`.records`, :mod:`.launcher`,
:mod:`.admission`, :mod:`.health`), prompt forms, the event loop thread, and Ray
(:mod:`.cluster`)."""
