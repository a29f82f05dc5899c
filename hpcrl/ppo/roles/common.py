"""What the training roles share: seeding, optimiser settings, their engine, the PPO epoch/mini-batch loop."""
from __future__ import annotations

import numpy as np
import torch

from hpcrl.controller import Dispatch, register, startup
from hpcrl.controller.batch import Batch
from hpcrl.engines.compile_cache import use_compile_cache
from hpcrl.engines.train.torch_trainer import OptimConfig, TorchTrainer, use_bf16
from hpcrl.models import ValueModel, load_causal_lm, log_probs_head, plain_decoder, values_head
from hpcrl.ppo.config import TrainConfig


def seed_all(seed: int) -> None:
    """torch, numpy's and Python's global generators: a role's whole RNG state is then a function of
    the seed, so a resumed run and an uninterrupted one hold the same state (even where unused)."""
    import random

    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def optim_config(cfg: TrainConfig, lr: float) -> OptimConfig:
    return OptimConfig(lr=lr, weight_decay=cfg.optim.weight_decay, warmup_steps=cfg.optim.warmup_steps,
                       grad_clip=cfg.optim.grad_clip, micro_batch_size=cfg.optim.micro_batch_size,
                       micro_batch_tokens=cfg.optim.micro_batch_tokens)


def import_model_code() -> None:
    """transformers' model code, which the roles that hold a model plain_decoder does not load import
    first: most of such a role's start (5.9 s on a GPU node through Slurm), timed apart; a standby
    process imports it ahead (Worker.warm_up), not knowing which model its rank will load."""
    from transformers import AutoModelForCausalLM  # noqa: F401


class ModelRole:
    """A role that holds a model: its standby processes import the model's code ahead, and
    torch.compile's Inductor (which a GPU engine's compiled layers import on their first use:
    1.4 s of a rebuild's engine phase on the CPU here)."""

    @classmethod
    def warm_up(cls) -> None:
        import_model_code()
        import torch._inductor.compile_fx  # noqa: F401


class CompilesAhead:
    """A role whose engine compiles its decoder layers (on a GPU, engine.compile): `compile_ahead` makes
    the layers' calls once on made-up batches of the run's sizes. The driver of a resumed run asks for it
    as soon as the roles are built, so that the graphs its earlier start compiled (the compile cache, and
    Dynamo's record of which sizes vary) load while the rollout generates the first batch, not after it: on
    an H100 the requeued run's first step took 6.1 s instead of 15.5 s. Cold, the made-up sizes compile
    for longer than the first step's own calls do, so a first start does not."""

    @register(Dispatch.ONE_TO_ALL)
    def compile_ahead(self) -> None:
        for batch in made_up_batches(self.cfg):
            self.engine.compile_ahead(batch, self.cfg.optim.micro_batch_size, self.cfg.optim.micro_batch_tokens,
                                      self.trained_outputs())

    def trained_outputs(self) -> tuple[str, ...]:
        """The engine's outputs that the role's loss differentiates (none: a frozen role)."""
        return ()


def made_up_batches(cfg: TrainConfig) -> list[Batch]:
    """Two batches of the run's sizes, tokens made up: a micro-batch of rows with prompts of
    data.max_prompt_length tokens (16 where unlimited) and responses of rollout.max_new_tokens, then half
    as many rows and tokens (a second size is what makes Dynamo trace the graph with symbolic sizes that
    the steps use). The first row's prompt is padded on the left and its response on the right, as
    generated batches are, so that the layers get the masks the steps give them."""
    out = []
    for scale in (1, 2):
        rows = max(2, cfg.optim.micro_batch_size // scale)
        p, r = max(2, (cfg.data.max_prompt_length or 16) // scale), max(2, cfg.rollout.max_new_tokens // scale)
        ids = torch.arange(rows * (p + r)).remainder(50).add(1).view(rows, p + r)
        prompt_mask, response_mask = torch.ones(rows, p, dtype=torch.long), torch.ones(rows, r, dtype=torch.long)
        prompt_mask[0, 0] = response_mask[0, -1] = 0
        out.append(Batch({"input_ids": ids, "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
                          "prompt_mask": prompt_mask, "responses": ids[:, p:], "response_mask": response_mask}))
    return out


def make_train_engine(cfg: TrainConfig, model_dir: str, head: str, device: torch.device, lr: float | None):
    """The engine of a role: head "log_probs" (actor; reference when lr is None) or "values" (critic),
    on cfg.engine.backend. lr None: inference only. With cfg.lora.rank the actor (and the critic,
    unless lora.critic is off) trains LoRA adapters on its frozen base instead. The model is loaded
    onto `device` (a reference that runs in bf16: in bf16, as the engine would store it)."""
    optim = optim_config(cfg, lr) if lr is not None else None
    use_compile_cache(cfg.engine.compile_cache, cfg.rollout.cache_dir, job=cfg.rollout.cache_dir)
    adapted = lr is not None and cfg.lora.rank and (head == "log_probs" or cfg.lora.critic)
    # a small Qwen2 or Llama in plain torch: a third of the role's start on CPU was importing transformers
    plain = cfg.engine.backend == "torch" and not adapted and plain_decoder.loads(model_dir)
    if not plain:
        import_model_code()
    startup.mark("imports")
    if cfg.engine.backend == "megatron":
        try:
            from hpcrl.engines.train.megatron import MegatronEngine
        except ImportError as e:
            raise RuntimeError(f"train.engine.backend: megatron, but megatron-core does not import here ({e}); "
                               "install `hpcrl[megatron]` on the GPU nodes, or use train_engine: torch") from e
        engine = MegatronEngine(model_dir, head, optim, cfg.engine.tensor_parallel, cfg.engine.pipeline_parallel,
                                cfg.rollout.temperature, cfg.seed, cfg.engine.compile, cfg.engine.activation_checkpointing)
        startup.mark("model")
        return engine
    if head == "values":
        module, forward = ValueModel(model_dir, device, plain), values_head
    else:
        dtype = torch.bfloat16 if lr is None and use_bf16(cfg.engine.precision, device) else torch.float32
        module = load_causal_lm(model_dir, dtype, device, plain)
        forward = log_probs_head(cfg.rollout.temperature, lr is not None, cfg.engine.compile)
    startup.mark("model")
    engine = TorchTrainer
    if adapted:
        from hpcrl.engines.train.lora import LoraTrainer, add_adapters

        module, engine = add_adapters(module, cfg.lora), LoraTrainer
    engine = engine(module, optim, forward, device, cfg.engine.precision, cfg.engine.compile, cfg.optim.pack,
                    cfg.engine.activation_checkpointing, cfg.engine.offload)
    startup.mark("engine")
    return engine


def ppo_updates(engine, batch: Batch, cfg: TrainConfig, world_size: int, seed: list[int], loss_fn) -> dict:
    """cfg.optim.ppo_epochs passes over this rank's shard, each in a fresh seeded order, one optimizer step
    per mini-batch. Returns the stats averaged over the optimizer steps."""
    per_rank = max(1, cfg.optim.mini_batch_size // world_size)
    steps = []
    for epoch in range(cfg.optim.ppo_epochs):
        order = np.random.default_rng([*seed, epoch]).permutation(len(batch))
        for mb in batch.reorder(order).split(per_rank):
            steps.append(engine.train_step(mb, loss_fn))
    return {k: float(np.mean([s[k] for s in steps])) for k in steps[0]} if steps else {}


def local_share(mask: torch.Tensor, total_tokens: float) -> float:
    """This micro-batch's share of the mini-batch's tokens (to report losses as per-token means)."""
    return max(float(mask.sum()), 1.0) / max(total_tokens, 1.0)
