"""Engines: how a role's model is trained (train/: torch, megatron-core) and how responses are
generated (rollout/: torch, CUDA-graph static cache, vLLM), each behind a Protocol in base.py.
Import the engine modules themselves: vLLM and megatron-core are imported only where they are used."""
