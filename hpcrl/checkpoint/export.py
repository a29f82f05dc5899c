"""`hpcrl export`: one role of a committed step as a Hugging Face folder, for
`from_pretrained` and for serving with vLLM.

    actor_rollout, ref   the policy: a *ForCausalLM (safetensors), its config, generation config and tokenizer
    critic               the value model as a *ForTokenClassification of one label: its `score` layer is the
                         value head, so AutoModelForTokenClassification gives V at every position

The weights come from the role's HDF5 file: the torch engine's state dict as it is, or
megatron-core's shards (any TP × PP layout) joined back to HF names. The architecture, tokenizer and
generation config come from the model directory the run started from.

A role that trained LoRA adapters (train.lora) checkpointed only those: the policy is exported as a
peft adapter folder of the model directory's model (adapter_config.json, adapter_model.safetensors:
`peft.PeftModel.from_pretrained(base, folder)`), or with `merged` as the whole model above, its
weights W + scaling·B·A; the critic is always merged.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from hpcrl.checkpoint.format import read_role_file
from hpcrl.checkpoint.store import CheckpointStore
from hpcrl.models import ValueModel, load_causal_lm
from hpcrl.models.tokenizer import FILE as CHAR_TOKENIZER

VALUE_ROLES = ("critic",)


def role_weights(state: dict, config, value_head: bool) -> dict[str, torch.Tensor]:
    """HF-named weights of a role's checkpointed state (torch engine or megatron shards)."""
    if "layout" in state:          # megatron: every rank's shard, with its place in the TP × PP grid
        from hpcrl.engines.train.megatron_layout import to_hf
        from hpcrl.models.shape import Shape

        tp, pp = state["layout"]["tensor_parallel"], state["layout"]["pipeline_parallel"]
        shards = [[None] * tp for _ in range(pp)]
        for rank in sorted(state["ranks"]):
            p, t = state["ranks"][rank]["coords"]
            if shards[p][t] is None:        # data-parallel replicas hold the same shard
                shards[p][t] = state["ranks"][rank]["model"]
        return to_hf(shards, Shape.of(config), value_head=value_head)
    return state["model"]


def export_role(store: CheckpointStore, role: str, model_dir: str | Path, out_dir: str | Path,
                step: int | None = None, dtype: str = "auto", lora=None, merged: bool = False) -> Path:
    """Write `role` of `step` (default: the newest step that verifies) into out_dir; returns it.
    dtype: "auto" (the model directory's), "bf16" or "fp32". A role that trained LoRA adapters
    (`lora`: the run's train.lora settings): the policy as a peft adapter folder of model_dir's
    model, or `merged` into a whole model folder; the critic always merged."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from hpcrl.engines.train.lora import add_adapters, is_adapter_state, load_adapter_state, merge, save_adapter, scalings

    model_dir, out = Path(model_dir), Path(out_dir)
    if step is None:
        found = store.latest_good()
        if found is None:
            raise ValueError(f"{store.root}: no committed checkpoint that verifies; nothing to export")
        step, manifest = found
    else:
        if step not in store.committed_steps():
            raise ValueError(f"{store.root}: no committed step {step} (committed: {store.committed_steps() or 'none'})")
        problems = store.verify(step)
        if problems:
            raise ValueError(f"step {step} does not verify: {'; '.join(problems)}")
        manifest = store.manifest(step)
    if role not in manifest["roles"]:
        raise ValueError(f"step {step} has no role {role!r} (it has: {', '.join(manifest['roles'])})")
    state, _ = read_role_file(store.path(manifest["roles"][role]["path"], step))
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype) or _config_dtype(config)
    staged = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(staged, ignore_errors=True)
    if is_adapter_state(state["role"].get("model", {})):
        if lora is None or not lora.rank:
            raise ValueError(f"{role} of step {step} holds LoRA adapters, but no train.lora settings with a rank "
                             "came with it (the run's spec has lora.rank: 0?)")
        if role not in VALUE_ROLES and not merged:
            save_adapter(model_dir, lora, state["role"]["model"], staged, torch_dtype)
            return _replace(out, staged)
        module = add_adapters(ValueModel(model_dir) if role in VALUE_ROLES else load_causal_lm(model_dir), lora)
        load_adapter_state(module, state["role"]["model"])
        weights = merge(module.state_dict(), scalings(module))
    else:
        weights = role_weights(state["role"], config, role in VALUE_ROLES)
    if role in VALUE_ROLES:
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)  # the weights as trained
        model.base_model.load_state_dict({k.removeprefix("backbone."): v for k, v in weights.items()
                                          if k.startswith("backbone.")})
        head = getattr(model, "score", None) or model.classifier
        head.load_state_dict({"weight": weights["head.weight"], "bias": weights["head.bias"]})
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]:
            raise ValueError(f"{role} of step {step} does not fit {model_dir}'s architecture "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.to(torch_dtype)
    model.config.dtype = torch_dtype         # what from_pretrained's dtype "auto" loads it as
    model.save_pretrained(staged)
    _copy_tokenizer(model_dir, staged)
    return _replace(out, staged)


def _replace(out: Path, staged: Path) -> Path:
    """The complete folder `staged` in out's place (a crash leaves the old one, never half of one)."""
    if out.exists():
        shutil.rmtree(out)
    os.replace(staged, out)
    return out


def _config_dtype(config) -> torch.dtype:
    """The dtype the model directory's config names."""
    named = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, named) if isinstance(named, str) else named


def _copy_tokenizer(model_dir: Path, out: Path) -> None:
    """The tokenizer and generation config the run used, unchanged."""
    if (model_dir / CHAR_TOKENIZER).exists():
        shutil.copy2(model_dir / CHAR_TOKENIZER, out / CHAR_TOKENIZER)
    else:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_dir, local_files_only=True).save_pretrained(out)
    if (model_dir / "generation_config.json").exists():
        shutil.copy2(model_dir / "generation_config.json", out / "generation_config.json")
