"""LoRA adapters (peft) on a training engine's module, and the merged weights the rollout samples with.

peft injects its layers into the HF module in place (`q_proj` becomes a LoRA layer whose frozen
`base_layer` is the original Linear, beside `lora_A`/`lora_B`), so the module keeps its class, its
forward and its generation: the CPU rollout samples with it as it is, adapters included. Its state
dict names change (`…q_proj.base_layer.weight`, `…q_proj.lora_A.default.weight`); a rollout engine
loads weights by a plain model's names, so `merge` gives those: W = W_base + scaling·B·A per adapted
layer, computed from a state dict (the module is never merged in place: unmerging would not give the
base weights back bit for bit).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from hpcrl.engines.train.torch_trainer import TorchTrainer
from hpcrl.models import ValueModel, load_causal_lm

ADAPTER = "default"      # peft's name of the one adapter


def lora_config(settings):
    """A peft LoraConfig of the `train.lora` settings; a new one per call: peft replaces its
    target_modules ("all-linear") by the names it found in the module it was applied to."""
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise RuntimeError(f"train.lora.rank: {settings.rank} needs peft, which does not import here ({e}); "
                           "pip install 'hpcrl[lora]'") from e
    targets = settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules)
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=targets, bias="none")


def add_adapters(module: torch.nn.Module, settings) -> torch.nn.Module:
    """`module` (an HF causal LM, or a critic's ValueModel) with LoRA adapters injected in place,
    every other parameter of the transformer frozen; a critic's adapters go on its backbone and its
    value head (fresh, as a rule) trains whole. Adapter initialisation draws from torch's global
    generator (B starts at 0: the adapted module computes what the base does)."""
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(lora_config(settings), module.backbone if isinstance(module, ValueModel) else module)
    except ValueError as e:      # peft's NoMatchingPeftModuleError is one: no layer has such a name
        raise ValueError(f"train.lora.target_modules: {e}") from None
    return module


def scalings(module: torch.nn.Module) -> dict[str, float]:
    """Module name of every adapted layer -> its scaling (alpha / rank)."""
    from peft.tuners.lora import LoraLayer

    return {name: layer.scaling[ADAPTER] for name, layer in module.named_modules() if isinstance(layer, LoraLayer)}


def merge(state: dict[str, torch.Tensor], scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """A LoRA module's state dict -> the merged model's, by a plain model's names. The same
    arithmetic as peft's merge_and_unload of plain LoRA on Linear layers (what lora_config makes):
    W_base + (B @ A) * scaling, computed in the adapters' dtype (fp32) and given in the base's (bf16
    where the engine stores its base so: what a bf16 rollout would cast it to, at half the memory)."""
    out = {}
    for name, value in state.items():
        if f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name:
            continue
        layer, adapted, leaf = name.rpartition(".base_layer.")
        if not adapted:
            out[name] = value
            continue
        if leaf == "weight":
            a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
            value = (value + (b @ a) * scaling[layer]).to(value.dtype)
        out[f"{layer}.{leaf}"] = value
    return out


def is_adapter_state(model_state: dict) -> bool:
    """A checkpointed module state of a LoRA engine (adapters, no base weights)."""
    return any(f".lora_A.{ADAPTER}." in k for k in model_state)


def save_adapter(model_dir: Path, settings, trained: dict[str, torch.Tensor], out: Path, dtype: torch.dtype) -> None:
    """A causal LM's trained adapters (a LoraTrainer's state) as a peft adapter folder
    (adapter_config.json, adapter_model.safetensors) of the model in model_dir, for
    `peft.PeftModel.from_pretrained(base, out)` and for serving (vLLM's LoRA support)."""
    from peft import get_peft_model

    peft_model = get_peft_model(load_causal_lm(model_dir), lora_config(settings))
    load_adapter_state(peft_model.base_model.model, trained)     # the names of the engine's module
    peft_model.to(dtype).save_pretrained(out)


def load_adapter_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """The trained parameters (adapters, a value head) into a module with adapters, whose frozen
    rest came from the model directory; a key that is not one of its trainable parameters is an error."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise ValueError(f"the adapter state does not fit the module (missing {sorted(trainable & set(missing))[:3]}, "
                         f"unexpected {unexpected[:3]}): were train.lora's settings changed since?")


class LoraTrainer(TorchTrainer):
    """A TorchTrainer whose module carries LoRA adapters: it trains and checkpoints the adapters
    (TorchTrainer leaves frozen parameters out of both) and hands the merged weights to a rollout.
    In bf16 (a GPU's default) the base is stored in bf16 and the adapters train in fp32; the merged
    weights are bf16 then (merge)."""

    def __init__(self, module: torch.nn.Module, *args, **kwargs):
        self.scaling = scalings(module)     # before any wrapper (FSDP2 keeps the names; DDP wraps outside)
        super().__init__(module, *args, **kwargs)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The merged model's parameters by HF name (what a plain model of the directory loads)."""
        return merge(super().full_weights(), self.scaling)

    @contextmanager
    def adapters_off(self):
        """The base model alone for the duration, every adapter skipped (peft's own switch): the
        reference policy of a LoRA run, with no second copy of the model."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.module.modules() if isinstance(m, BaseTunerLayer)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)
