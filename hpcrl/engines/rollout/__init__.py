"""RolloutEngines: torch_rollout.py (the training module samples), static_cache.py (CUDA graphs),
vllm_rollout.py (vLLM in the rollout process)."""
