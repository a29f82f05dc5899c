"""TrainEngines: torch_trainer.py (DDP on CPU, FSDP2 on GPUs) and megatron.py (TP × PP, GPU only)."""
