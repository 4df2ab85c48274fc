"""What runs in the process that holds a service (its owner, or a handle): the
:class:`~.service.VLLMService` facade and its parts (:mod:`.control`, :mod:`.generation`,
:mod:`.lora_serving`, :mod:`.torchrl_engine`), the owner's :class:`~.pool.ReplicaPool`,
prompt forms, the event loop thread, and Ray (:mod:`.cluster`)."""
