"""Simulated vLLM replicas: continuous batching, KV blocks, preemption, abort on disconnect."""
