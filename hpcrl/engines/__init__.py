"""Engines behind one small interface each: rollout (generate) and training (train_step).
The vLLM rollout engine is `hpcrl.engines.rollout_vllm.VLLMRollout`, imported where it is used."""
from hpcrl.engines.rollout_torch import SamplingParams, TorchRollout
from hpcrl.engines.train_torch import OptimConfig, TorchTrainer

__all__ = ["SamplingParams", "TorchRollout", "OptimConfig", "TorchTrainer"]
