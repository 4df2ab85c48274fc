"""vLLM engine replicas on Ray: the replica actor, routing, and the service."""
