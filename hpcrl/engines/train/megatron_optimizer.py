"""megatron-core's optimizer on plain PyTorch kernels, where neither Transformer Engine nor apex is
installed (megatron then falls back to per-tensor Python loops).

Without them megatron-core 0.19 steps with `torch.optim.AdamW` in its foreach form, computes the
gradient norm tensor by tensor and gathers the norms into a CPU tensor (a host sync per parameter),
and scales or copies lists of tensors one `copy_(src * scale)` at a time. On one H200 with a
Qwen2-0.5B-shaped model that made megatron's `optimizer.step()` 36 ms against the torch engine's
7.5 ms (its fused AdamW and `clip_grad_norm_`). `use_torch_kernels` gives megatron the same kernels:
AdamW's fused form, and `torch._foreach_norm` / `_foreach_mul_` / `_foreach_copy_` as megatron's
multi-tensor fallbacks, which keep their signatures (`op(chunk_size, noop_flag, tensor_lists, *args)`).
With Transformer Engine or apex present, megatron's own fused kernels stay.
"""
from __future__ import annotations

import functools

import torch


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """The l2 norm of all tensors of tensor_lists[0] together, as a 1-element fp32 tensor on their
    device, and None (no per-tensor norms): what megatron's `multi_tensor_l2norm` returns."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)     # fp32 also for bf16 tensors
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """dst = src · scale for the pairs of (tensor_lists[0], tensor_lists[1]); dst may be another
    dtype (fp32 main weights into bf16 model weights), or src itself (gradient clipping)."""
    src, dst = tensor_lists
    if not src:
        return
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, src if scale == 1.0 else torch._foreach_mul(src, scale))


@functools.cache
def _replace_fallbacks() -> None:
    """Point megatron's modules at the foreach kernels where they hold its local fallbacks."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    fallbacks = {utils.local_multi_tensor_l2_norm: foreach_l2_norm, utils.local_multi_tensor_scale: foreach_scale}
    for module, name in [(clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (optimizer, "multi_tensor_scale_impl")]:
        current = getattr(module, name, None)
        if current in fallbacks:
            setattr(module, name, fallbacks[current])


def use_torch_kernels(megatron_optimizer) -> None:
    """Fused AdamW inside `megatron_optimizer` (a chained one included) where megatron fell back to
    torch's, and the foreach kernels for its norms, clipping and copies."""
    _replace_fallbacks()
    for inner in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        if type(inner.optimizer) in (torch.optim.AdamW, torch.optim.Adam):
            for group in inner.optimizer.param_groups:     # read by every step(); its state is made on the first
                group.update(fused=True, foreach=False)
