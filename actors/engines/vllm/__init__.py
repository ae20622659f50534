"""The vLLM engine: AsyncLLM in the actor's process, the worker extension in vLLM's."""
