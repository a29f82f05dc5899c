"""Rollout for Llama/Qwen2-shaped models with a preallocated KV cache; on CUDA `check_every` decode
steps, sampler included, are one CUDA-graph replay.

Sampling one token for 64 sequences of a 0.5B model is a few hundred small kernels. Launched one by
one from Python (HF `generate`) the GPU waits on the host; here each decoder layer is compiled (Inductor
fuses the norms, RoPE and activations into few kernels), `check_every` steps of sampling and model
are captured once into a graph and replayed, the cache has a fixed shape so the graph stays valid,
and the host looks at the device once per replay (to stop when every row has stopped). The sampler
draws its randomness outside the graph (sample_token's exponential race), so replays are seeded
and deterministic.

The engine holds its own copy of the weights in the sampling dtype (bf16 on GPU), fused per layer
([q|k|v], [gate|up]); `load_weights` copies new ones into the same storage, so captured graphs
stay valid across updates. On CPU the same code runs eagerly (the tests compare it with HF there).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.torch_rollout import finish_responses, sample_next
from hpcrl.models.shape import Shape, rope_theta

SUPPORTED = ("llama", "qwen2")
CACHE_ROUND = 64


class StaticCacheRollout:
    shares_module = False

    def __init__(self, config, pad_id: int, eos_ids: list[int], device: torch.device | str,
                 dtype: torch.dtype | None = None, check_every: int = 32, compile: bool = True,
                 reload: Callable[[], dict[str, torch.Tensor]] | None = None):
        if config.model_type not in SUPPORTED:
            raise ValueError(f"StaticCacheRollout supports {SUPPORTED}, not {config.model_type!r}")
        self.s = Shape.of(config)
        self.eps = config.rms_norm_eps
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.pad_id, self.eos_ids, self.check_every, self.reload = pad_id, list(eos_ids), check_every, reload
        d = self.s.head_dim
        inv_freq = 1.0 / rope_theta(config) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        # a replay's steps past the last token may run past the model's positions: they are never kept
        positions = config.max_position_embeddings + check_every
        angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().float().to(self.device)
        self.sin = angles.sin().float().to(self.device)
        self.w: dict | None = None
        # a decoder layer, on CUDA compiled by Inductor (lazily, at its first call), and called for every layer
        # with that layer's weights: one small graph to compile rather than the whole model unrolled (30 layers
        # of SmolLM2 took 36 s cold on an H100, 23 s from the compile cache), and the captured decode graph
        # replays the layers' kernels alike. One compiled function for every shape: Dynamo compiles it for the
        # first (rows, cache length) and once more, at the first other, with those sizes symbolic, which then
        # serves every shape. A multi-turn rollout meets a new shape each turn; compiled per shape, each turn
        # took a compile
        self.layer_step = (torch.compile(self._layer, fullgraph=True) if self.device.type == "cuda" and compile
                           else self._layer)
        self.decoders: dict[tuple, tuple] = {}   # (batch, cache length, steps, sampling) -> decode run, its buffers

    # --- weights
    @torch.no_grad()
    def load_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """HF-named parameters (any device and dtype); copied into this engine's own storage."""
        p = next(x for x in ("model.", "") if f"{x}embed_tokens.weight" in hf)
        cast = lambda t: t.detach().to(self.device, self.dtype)   # noqa: E731
        new = {"embed": cast(hf[f"{p}embed_tokens.weight"]), "norm": cast(hf[f"{p}norm.weight"]),
               "lm_head": cast(hf.get("lm_head.weight", hf[f"{p}embed_tokens.weight"])), "layers": []}
        for i in range(self.s.layers):
            h = f"{p}layers.{i}."
            qkv = [hf[f"{h}self_attn.{n}_proj.weight"] for n in "qkv"]
            bias = [hf[f"{h}self_attn.{n}_proj.bias"] for n in "qkv"] if self.s.qkv_bias else None
            new["layers"].append({
                "ln1": cast(hf[h + "input_layernorm.weight"]), "ln2": cast(hf[h + "post_attention_layernorm.weight"]),
                "qkv": cast(torch.cat(qkv)), "qkv_bias": cast(torch.cat(bias)) if bias else None,
                "o": cast(hf[h + "self_attn.o_proj.weight"]),
                "gate_up": cast(torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])),
                "down": cast(hf[h + "mlp.down_proj.weight"])})
        if self.w is None:
            self.w = new
            return
        for old, fresh in zip(self._tensors(self.w), self._tensors(new)):
            old.copy_(fresh)                      # in place: graphs captured on this storage stay valid

    @staticmethod
    def _tensors(w: dict):
        yield from (w["embed"], w["norm"], w["lm_head"])
        for layer in w["layers"]:
            yield from (t for t in layer.values() if t is not None)

    def sleep(self) -> None:
        """Given `reload` (the trainer's weights, in a trainer's process), frees its weights, KV cache and
        graphs for the trainer: the next generate takes the weights again from `reload` and captures its
        graph again. Else keeps them: they are what makes the next step fast."""
        if self.reload is not None:
            self.w = None
            self.decoders.clear()

    # --- the model
    def _rms(self, x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x, cos, sin):           # x (B, heads, T, D); cos/sin (B, 1, T, D)
        x1, x2 = x.chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1).float() * sin).to(x.dtype)

    def _forward(self, ids, pos, slots, cache, keys: int, mask, layer_step: Callable | None = None) -> torch.Tensor:
        """Logits of the last position. ids/pos (B, T); slots (T,) cache columns written; attention over
        the first `keys` columns where mask (B, 1, T, keys) is True; each layer through `layer_step`
        (the compiled layer), else eagerly."""
        x = F.embedding(ids, self.w["embed"])
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        for layer, (kc, vc) in zip(self.w["layers"], cache):
            x = (layer_step or self._layer)(x, layer, kc, vc, cos, sin, slots, keys, mask)
        return F.linear(self._rms(x[:, -1], self.w["norm"]), self.w["lm_head"]).float()

    def _layer(self, x, layer: dict, kc, vc, cos, sin, slots, keys: int, mask) -> torch.Tensor:
        """One decoder layer on x (B, T, hidden): its keys and values written into the cache columns `slots`."""
        s, (b, t) = self.s, x.shape[:2]
        h = self._rms(x, layer["ln1"])
        qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
        q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
        q = self._rope(q.view(b, t, s.heads, s.head_dim).transpose(1, 2), cos, sin)
        k = self._rope(k.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        kc.index_copy_(2, slots, k)
        vc.index_copy_(2, slots, v.view(b, t, s.kv_heads, s.head_dim).transpose(1, 2))
        o = F.scaled_dot_product_attention(q, kc[:, :, :keys], vc[:, :, :keys], attn_mask=mask, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), layer["o"])
        g, u = F.linear(self._rms(x, layer["ln2"]), layer["gate_up"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, layer["down"])

    def _decoder(self, b: int, length: int, steps: int, params: SamplingParams):
        """`steps` decode steps for b rows and a cache of `length` columns, each: sample a token per row
        from the logits in buf["logits"] (on the Exp(1) draws in buf["noise"]), record it, run the model
        on it. On CUDA the whole run is one captured graph, its model step compiled by Inductor (fused
        norms, RoPE and activations); it replays from any position, which lives on the device."""
        key = (b, length, steps, params.temperature, params.top_k, params.top_p)
        if key in self.decoders:
            return self.decoders[key]
        self.decoders.clear()     # one shape at a time: the cache is the big allocation
        s, dev, v = self.s, self.device, self.w["lm_head"].shape[0]
        cache = [tuple(torch.zeros(b, s.kv_heads, length, s.head_dim, device=dev, dtype=self.dtype) for _ in "kv")
                 for _ in range(s.layers)]
        long = dict(dtype=torch.long, device=dev)
        buf = {"pos": torch.zeros(b, 1, **long), "slot": torch.zeros(1, **long),
               "valid": torch.zeros(b, length, dtype=torch.bool, device=dev), "cache": cache,
               "logits": torch.zeros(b, v, device=dev), "done": torch.zeros(b, dtype=torch.bool, device=dev),
               "noise": torch.ones(steps, b, v, device=dev) if params.temperature else [None] * steps,
               "tokens": torch.zeros(b, steps, **long), "log_probs": torch.zeros(b, steps, device=dev)}
        eos = torch.tensor(self.eos_ids, **long)

        def run():
            for j in range(steps):
                tok, logp = sample_next(buf["logits"], buf["noise"][j], buf["done"], params, self.pad_id, eos)
                buf["tokens"][:, j] = tok
                buf["log_probs"][:, j] = logp
                buf["valid"].index_fill_(1, buf["slot"], True)
                buf["logits"].copy_(self._forward(tok[:, None], buf["pos"], buf["slot"], cache, length,
                                             buf["valid"][:, None, None, :], self.layer_step))
                buf["pos"] += 1
                buf["slot"] += 1

        graph = None
        if dev.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):     # compiles, and makes cuBLAS handles and workspaces, before capture
                run()
            torch.cuda.current_stream().wait_stream(side)
            buf["slot"].zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
        self.decoders[key] = (graph.replay if graph is not None else run, buf)
        return self.decoders[key]

    def _rows_that_fit(self, b: int, p: int, length: int, steps: int, params: SamplingParams) -> int:
        """How many rows of a new decoder (KV cache, sampler buffers, the prompt's forward) fit in what
        the GPU has free now, with a tenth kept back: all b where they do, and on CPU."""
        if self.device.type != "cuda":
            return b
        self.decoders.clear()          # the decoder of another shape goes first
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        s, item = self.s, torch.finfo(self.dtype).bits // 8
        per_row = (s.kv_bytes_per_token(item) * length                                         # keys and values
                   + 4 * self.w["lm_head"].shape[0] * ((steps if params.temperature else 0) + 4)  # noise, logits, sampling
                   + p * (6 * s.hidden + 3 * s.ffn) * item)                                     # the prompt's forward
        return max(1, min(b, int(0.9 * free) // per_row))

    # --- sampling
    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 seed: int) -> dict[str, torch.Tensor]:
        """Same layout as TorchRollout.generate; every row's draws come from one generator seeded with
        `seed`. Decodes `check_every` tokens between looks at whether every row has stopped. Where the
        KV cache of every row does not fit in the GPU memory free now, the rows go in the largest
        chunks that do, one after the other, a chunk from row i seeded with `seed` + i."""
        if self.w is None and self.reload is not None:
            self.load_weights(self.reload())
        if self.w is None:
            raise RuntimeError("StaticCacheRollout.generate before load_weights")
        b, p = prompt_ids.shape
        if self.device.type == "cuda" and b < (rounded := 1 << (b - 1).bit_length()):
            # rows rounded up to a power of two with empty ones (dropped after), so that calls of varying
            # sizes (partial rollouts: every response in the making) replay a few captured graphs
            out = self.generate(F.pad(prompt_ids, (0, 0, 0, rounded - b), value=self.pad_id),
                                F.pad(prompt_mask, (0, 0, 0, rounded - b)), params, seed)
            return {k: v[:b] for k, v in out.items()}
        steps = min(self.check_every, params.max_new_tokens)
        runs = -(-params.max_new_tokens // steps)
        # the cache's length rounded up, so that batches of slightly different prompt widths replay
        # one captured graph (the slots past the real tokens stay masked out)
        length = -(-(p + runs * steps) // CACHE_ROUND) * CACHE_ROUND
        key = (b, length, steps, params.temperature, params.top_k, params.top_p)
        rows = b if key in self.decoders else self._rows_that_fit(b, p, length, steps, params)
        if rows < b:
            print(f"static-cache rollout: {b} rows do not fit the free GPU memory at once; {rows} at a time", flush=True)
        parts = [self._generate(prompt_ids[i:i + rows], prompt_mask[i:i + rows], params, seed + i if i else seed,
                                length, steps, runs) for i in range(0, b, rows)]
        return parts[0] if len(parts) == 1 else {k: torch.cat([part[k] for part in parts]) for k in parts[0]}

    def _generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams, seed: int,
                  length: int, steps: int, runs: int) -> dict[str, torch.Tensor]:
        dev = self.device
        b, p = prompt_ids.shape
        decode, buf = self._decoder(b, length, steps, params)
        ids, mask = prompt_ids.to(dev), prompt_mask.to(dev).bool()
        pos = (mask.long().cumsum(1) - 1).clamp_min(0)
        # prompt: causal over real tokens; a pad query sees itself only (never an empty row)
        causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
        attend = (causal & mask[:, None, :]) | torch.eye(p, dtype=torch.bool, device=dev)
        buf["valid"].zero_()
        buf["valid"][:, :p] = mask
        buf["logits"].copy_(self._forward(ids, pos, torch.arange(p, device=dev), buf["cache"], p, attend[:, None]))
        buf["pos"].copy_(mask.long().sum(1, keepdim=True))
        buf["slot"].fill_(p)
        buf["done"].zero_()
        generator = torch.Generator(dev).manual_seed(seed)
        tokens, log_probs = [], []
        for _ in range(runs):
            if params.temperature:
                buf["noise"].exponential_(generator=generator)
            decode()
            tokens.append(buf["tokens"].clone())
            log_probs.append(buf["log_probs"].clone())
            if bool(buf["done"].all()):
                break
        return finish_responses(torch.cat(tokens, 1), torch.cat(log_probs, 1), params, self.pad_id, self.eos_ids)
