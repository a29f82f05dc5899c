"""Training on megatron-core (GPU only): the actor's log-probs or the critic's values through a
GPTModel split by tensor and pipeline parallelism, trained with megatron's DDP, distributed
optimizer (on torch's fused AdamW and foreach kernels where megatron finds neither Transformer
Engine nor apex: `megatron_optimizer.py`) and micro-batch schedules.

The model is built from the role's HF config and loaded from its HF weights
(`megatron_layout.to_megatron`); `full_weights()` gives them back in HF names, so the rollout
engine, the reference and the checkpoints keep one format. The critic is the same GPTModel with
its output layer replaced by the scalar value head. The layers come from `megatron_layer.py`
(attention through PyTorch's SDPA, and linears that trace without a graph break); on one
tensor-parallel rank the log-probs come from the chunked head of `hpcrl.models.causal_lm`
(`head_log_probs`): no fp32 logits over the whole vocabulary, and without TP or PP each layer is
compiled by Inductor, one graph per layer.

Data: the driver's DP_COMPUTE dispatch cuts a batch into one shard per rank, but the ranks of one
model-parallel group (TP × PP) must see the same samples. Each call gathers the shards of its group
(all ranks of the group then hold the group's data), computes, and returns its own rows, so the
driver needs no knowledge of the layout.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpcrl.controller.batch import Batch
from hpcrl.controller.layer_rehearsal import compile_layers
from hpcrl.engines.train.megatron_layer import attention_mask, layer_spec
from hpcrl.engines.train.megatron_layout import to_hf, to_megatron
from hpcrl.engines.train.megatron_optimizer import use_torch_kernels
from hpcrl.engines.train.torch_trainer import OptimConfig, all_sum, lr_factor
from hpcrl.models.causal_lm import head_log_probs, position_ids
from hpcrl.models.shape import Shape, rope_theta


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> tuple:
    """log softmax(logits)[target] and the entropy, with the vocabulary split over `group` (each rank
    holds columns [vocab_start, vocab_start + logits.shape[-1])). Sums cross the group with an
    all-reduce whose backward is the identity, as megatron's vocab-parallel cross-entropy does."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

    m = logits.detach().max(-1, keepdim=True).values
    if dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = logits - m
    lse = reduce(z.exp().sum(-1, keepdim=True), group).log()
    local = targets - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = reduce(z.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None]).squeeze(-1) * inside, group)
    p = (z - lse).exp()
    entropy = lse.squeeze(-1) - reduce((p * z).sum(-1), group)
    return picked - lse.squeeze(-1), entropy


class MegatronEngine:
    """head "log_probs" (actor, reference: π(response) at `temperature`, and its entropy) or "values"
    (critic). cfg None: inference only. `compile`: each decoder layer through Inductor (without TP
    or PP), and the chunked LM head's softmax (one TP rank). `checkpointing`: megatron's full
    recompute of each layer in training (it keeps the layer's input only). A TrainEngine
    (hpcrl/engines/base.py)."""
    state_replicated = False     # each rank holds its tensor/pipeline shard

    def __init__(self, model_dir: str, head: str, cfg: OptimConfig | None, tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, temperature: float = 1.0, seed: int = 1, compile: bool = True,
                 checkpointing: bool = False):
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel as mtp
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig
        from transformers import AutoConfig

        if not torch.cuda.is_available():
            raise RuntimeError("train_engine: megatron needs a GPU (megatron-core calls CUDA); use train_engine: torch on CPU")
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.shape, self.head, self.cfg, self.temperature = Shape.of(hf_config), head, cfg, temperature
        self.compile = compile
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.shape.check(tensor_parallel, pipeline_parallel)
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(tensor_parallel, pipeline_parallel)
        elif (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()) != (
                tensor_parallel, pipeline_parallel):
            raise ValueError("roles colocated in one process must use the same tensor_parallel and pipeline_parallel")
        mtp.model_parallel_cuda_manual_seed(seed)
        self.tp, self.pp = tensor_parallel, pipeline_parallel
        self.tp_group, self.pp_group = mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()
        self.mp_group, self.dp_group = mpu.get_model_parallel_group(), mpu.get_data_parallel_group()
        self.tp_rank, self.pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
        self.first, self.last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        s = self.shape
        self.config = TransformerConfig(
            num_layers=s.layers, hidden_size=s.hidden, num_attention_heads=s.heads, num_query_groups=s.kv_heads,
            kv_channels=s.head_dim, ffn_hidden_size=s.ffn, normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=s.qkv_bias,
            hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
            pipeline_dtype=torch.bfloat16, tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            calculate_per_token_loss=True,     # our loss is already each piece's share: megatron must not rescale it
            # stages exchange activations of each micro-batch's own shape (the last may be smaller)
            variable_seq_lengths=pipeline_parallel > 1, moe_token_dispatcher_type="alltoall",
            **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
               if checkpointing else {}))
        values = head == "values"
        model = GPTModel(self.config, layer_spec(), vocab_size=s.padded_vocab(self.tp),
                         max_sequence_length=hf_config.max_position_embeddings, pre_process=self.first,
                         post_process=self.last, share_embeddings_and_output_weights=s.tied and not values,
                         position_embedding_type="rope", rotary_base=int(rope_theta(hf_config)))
        if values and self.last:
            model.output_layer = torch.nn.Linear(s.hidden, 1, dtype=torch.bfloat16)
        model.cuda()
        self._load_hf(model, self._initial_hf(model_dir, values))
        if compile and tensor_parallel == pipeline_parallel == 1:
            # in place, as the torch engine's. Without TP a layer holds no collective (data parallelism
            # reduces gradients outside it, in megatron's DDP hooks); compiled TP or PP was not measured
            compile_layers(list(model.decoder.layers))
        self.bare = model
        if cfg is None:
            model.requires_grad_(False).eval()
            self.model = model
            return
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        self.model = DistributedDataParallel(self.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
        self.config.no_sync_func = self.model.no_sync    # one gradient reduction per step, after the last micro-batch
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.betas[0], adam_beta2=cfg.betas[1],
            clip_grad=cfg.grad_clip, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True), [self.model])
        use_torch_kernels(self.optimizer)
        self.lr_factor, self.steps = lr_factor(cfg), 0

    # --- weights
    @staticmethod
    def _initial_hf(model_dir: str, values: bool) -> dict:
        if values:
            from hpcrl.models.critic import ValueModel

            return ValueModel(model_dir).state_dict()
        from hpcrl.models.causal_lm import load_causal_lm

        return load_causal_lm(model_dir).state_dict()

    def _load_hf(self, model, hf: dict) -> None:
        mine = to_megatron(hf, self.shape, self.tp, self.tp_rank, self.pp, self.pp_rank, value_head=self.head == "values")
        params = {k for k, _ in model.named_parameters()}
        missing = params - mine.keys()
        if missing:
            raise KeyError(f"megatron parameters without an HF source: {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(mine[name])

    def full_weights(self) -> dict[str, torch.Tensor]:
        """HF-named parameters, whole on every rank (gathered over TP, then PP). A collective."""
        local = {k: p.detach() for k, p in self.bare.named_parameters()}
        tp_shards = [dict() for _ in range(self.tp)]
        for k, v in local.items():
            parts = [v]
            if self.tp > 1:
                parts = [torch.empty_like(v) for _ in range(self.tp)]
                dist.all_gather(parts, v.contiguous(), group=self.tp_group)
            for r in range(self.tp):
                tp_shards[r][k] = parts[r]
        stages = [tp_shards]
        if self.pp > 1:
            stages = [None] * self.pp
            cpu = [{k: v.cpu() for k, v in shard.items()} for shard in tp_shards]
            dist.all_gather_object(stages, cpu, group=self.pp_group)
        return to_hf(stages, self.shape, value_head=self.head == "values")

    # --- data
    def _group_batch(self, batch: Batch) -> tuple[Batch, slice]:
        """The samples of every rank of this model-parallel group, and where this rank's own lie."""
        n = dist.get_world_size(self.mp_group)
        if n == 1:
            return batch, slice(0, len(batch))
        parts = [None] * n
        dist.all_gather_object(parts, batch, group=self.mp_group)
        me = dist.get_rank(self.mp_group)
        start = sum(len(p) for p in parts[:me])
        return Batch.concat(parts), slice(start, start + len(batch))

    def _output(self, mb: Batch, hidden_states, output_layer, output_weight=None, **_):
        """The head on the decoder's last hidden states [s, b, h]: (b, r, 2) log-probs and entropy, or (b, r, 1) values."""
        r = mb["responses"].shape[1]
        h = hidden_states[-r - 1:-1]
        if self.head == "values":
            return output_layer(h).float().transpose(0, 1)
        if self.tp == 1:      # the whole vocabulary here: chunked, never all fp32 logits at once
            x = h.transpose(0, 1).reshape(-1, h.shape[-1])
            weight = output_layer.weight if output_weight is None else output_weight
            logp, ent = head_log_probs(x, weight, mb["responses"].reshape(-1), self.temperature, True,
                                       compile=self.compile)
            return torch.stack([logp, ent], dim=-1).view(-1, r, 2)
        logits, _ = output_layer(h, weight=output_weight)
        logits = logits.float().transpose(0, 1) / self.temperature
        width = logits.shape[-1]
        start = self.tp_rank * width
        if start + width > self.shape.vocab:       # vocabulary padding for TP: never a token
            logits[..., max(0, self.shape.vocab - start):] = -1e30
        logp, ent = vocab_parallel_log_probs(logits, mb["responses"], start, self.tp_group)
        return torch.stack([logp, ent], dim=-1)

    def _named(self, out: torch.Tensor) -> dict:
        return {"values": out[..., 0]} if self.head == "values" else {"log_probs": out[..., 0], "entropy": out[..., 1]}

    def _schedule(self, micro: list[Batch], loss: Callable | None) -> list:
        """megatron's forward(-backward) schedule over the micro-batches; on the last pipeline stage
        each micro-batch's record, else []."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data, model):
            mb = next(data)
            mask = mb["attention_mask"]
            out = model(mb["input_ids"], position_ids(mask), attention_mask(mask),
                        output_processor=partial(self._output, mb))
            return out, partial(finish, mb)

        def finish(mb, out):
            if loss is None:
                return out.sum() * 0, torch.ones((), dtype=torch.int, device=out.device), {"out": out.detach()}
            value, stats = loss(self._named(out), mb)
            return value, torch.ones((), dtype=torch.int, device=out.device), {"stats": stats}

        seq = micro[0]["input_ids"].shape[1]
        return get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([mb.to(self.device) for mb in micro]), model=[self.model],
            num_microbatches=len(micro), seq_length=seq, micro_batch_size=len(micro[0]), forward_only=loss is None)

    def _from_last_stage(self, obj):
        if self.pp == 1:
            return obj
        box = [obj]
        from megatron.core import parallel_state as mpu

        dist.broadcast_object_list(box, src=mpu.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
        return box[0]

    # --- the engine interface
    def compile_ahead(self, batch: Batch, micro_batch_size: int, micro_batch_tokens: int = 0,
                      trained: tuple[str, ...] = ()) -> None:
        """TorchTrainer.compile_ahead's forward without gradients (`infer`); the training call's compile is
        left to the first update here (megatron's schedule runs the backward and the step together)."""
        self.infer(batch, micro_batch_size, micro_batch_tokens)

    @torch.no_grad()
    def infer(self, batch: Batch, micro_batch_size: int, micro_batch_tokens: int = 0) -> Batch:
        """micro_batch_tokens is not taken: the pipeline schedule sends tensors of one shape
        between stages (TrainConfig refuses it with megatron)."""
        self.model.eval()
        group, mine = self._group_batch(batch)
        records = self._schedule(group.split(micro_batch_size), None)
        out = torch.cat([r["out"] for r in records]).cpu() if self.last else None
        out = self._from_last_stage(out)
        return Batch({k: v.float() for k, v in self._named(out[mine]).items()})

    def train_step(self, batch: Batch, loss_fn: Callable, mask_key: str = "response_mask") -> dict[str, float]:
        self.model.train()
        group, _ = self._group_batch(batch)
        mask = group[mask_key]
        total_tokens = all_sum(float(mask.sum()), self.device, self.dp_group)
        total_seqs = all_sum(float((mask.sum(dim=1) > 0).sum()), self.device, self.dp_group)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        for g in self.optimizer.param_groups:
            g["lr"] = self.cfg.lr * self.lr_factor(self.steps)
        micro = group.split(self.cfg.micro_batch_size)
        records = self._schedule(micro, lambda out, mb: loss_fn(out, mb, total_tokens, total_seqs))
        self.model.finish_grad_sync()
        _, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        sums: dict[str, float] = {}
        for rec, mb in zip(records, micro):
            share = float(mb[mask_key].sum()) / max(total_tokens, 1.0)
            for k, v in rec["stats"].items():
                sums[k] = sums.get(k, 0.0) + v * share
        sums = self._from_last_stage(sums if self.last else None)
        out = {k: all_sum(v, self.device, self.dp_group) for k, v in sums.items()}
        out.update(grad_norm=float(grad_norm or 0.0), lr=self.cfg.lr * self.lr_factor(self.steps - 1))
        return out

    # --- checkpoints
    def _optimizers(self) -> list:
        """The distributed optimizers (megatron may chain one per parameter kind)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _main_params(self, optimizer) -> dict:
        """Parameter name -> this rank's fp32 shard of it, paired as the optimizer's own copy-back
        pairs them (its name-keyed helpers mis-pair shards in megatron-core 0.19.2)."""
        names = {p: n for n, p in self.bare.named_parameters()}
        return {names[model]: main for models, mains in zip(optimizer.model_float16_groups,
                                                            optimizer.shard_fp32_from_float16_groups)
                for model, main in zip(models, mains)}

    def _shard_states(self, optimizer) -> dict:
        """Parameter name -> {"param": fp32 shard, and its Adam state (exp_avg, exp_avg_sq, step)}."""
        return {name: {"param": main, **{k: v for k, v in optimizer.optimizer.state.get(main, {}).items()
                                         if isinstance(v, torch.Tensor)}}
                for name, main in self._main_params(optimizer).items()}

    def state_dict(self) -> dict:
        """Sharded: every rank's model shard and optimizer state, gathered to rank 0 of the role (a
        collective). Resuming needs the same TP × PP × DP layout; the weights alone convert to HF
        (`full_weights`) for any layout."""
        mine = {"model": {k: p.detach().cpu() for k, p in self.bare.named_parameters()},
                "coords": [self.pp_rank, self.tp_rank]}      # where the shard sits: for hpcrl export
        if self.cfg is not None:
            # each rank's own shard of the fp32 main weights and Adam moments, by parameter name
            mine.update(params=[{name: {k: v.detach().cpu().clone() for k, v in state.items()}
                                 for name, state in self._shard_states(o).items()} for o in self._optimizers()],
                        steps=self.steps)
        ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, ranks, dst=0)
        layout = {"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "world_size": dist.get_world_size()}
        return {"layout": layout, "ranks": dict(enumerate(ranks)) if ranks else {}}

    def load_state_dict(self, state: dict) -> None:
        layout = {"tensor_parallel": self.tp, "pipeline_parallel": self.pp, "world_size": dist.get_world_size()}
        if state["layout"] != layout:
            raise ValueError(f"checkpoint written with {state['layout']}, this run is {layout}: a megatron "
                             "checkpoint resumes on the same layout")
        mine = state["ranks"][dist.get_rank()]
        with torch.no_grad():
            for name, p in self.bare.named_parameters():
                p.copy_(mine["model"][name])
        if self.cfg is not None:
            for o, params in zip(self._optimizers(), mine["params"]):
                for name, main in self._main_params(o).items():
                    saved = params[name]
                    with torch.no_grad():
                        main.copy_(saved["param"])
                    # fused AdamW keeps `step` on the device too
                    o.optimizer.state[main] = {k: v.to(self.device) for k, v in saved.items() if k != "param"}
            self.steps = mine["steps"]
