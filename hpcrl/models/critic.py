"""Critic: the policy's backbone with a scalar value head."""
from __future__ import annotations

from pathlib import Path

import torch

from hpcrl.models import plain_decoder
from hpcrl.models.causal_lm import position_ids, straight_to
from hpcrl.models.packing import PACKED, Packed


class ValueModel(torch.nn.Module):
    """V(prefix) for every position. Backbone and head from a causal LM directory (the actor's: a
    fresh head), from a sequence-scoring reward model directory (its score head as the start), or
    from a value model `hpcrl export --role critic` wrote (a token classifier: its head as it is).
    On a GPU `device` the backbone is loaded straight onto it, as load_causal_lm does; `plain` as
    load_causal_lm's (the backbone in plain torch where hpcrl.models.plain_decoder loads the model)."""

    def __init__(self, model_dir: Path, device: torch.device | str | None = None, plain: bool = False):
        super().__init__()
        if plain and plain_decoder.loads(model_dir):
            cfg = plain_decoder.read_config(model_dir)
            self.backbone = plain_decoder.load(model_dir, torch.float32, device, backbone=True)
        else:
            from transformers import AutoConfig, AutoModel

            cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
            self.backbone = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32,
                                                      **straight_to(device))
        self.head = torch.nn.Linear(cfg.hidden_size, 1)
        architectures = cfg.architectures or []
        if any("ForTokenClassification" in a for a in architectures):
            from transformers import AutoModelForTokenClassification

            values = AutoModelForTokenClassification.from_pretrained(model_dir, local_files_only=True,
                                                                     dtype=torch.float32)
            head = getattr(values, "score", None) or values.classifier
            self.head.load_state_dict({"weight": head.weight.data[:1], "bias": head.bias.data[:1]})
        elif any("ForSequenceClassification" in a for a in architectures):
            from transformers import AutoModelForSequenceClassification

            scorer = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True,
                                                                        dtype=torch.float32)
            self.head.weight.data.copy_(scorer.score.weight.data[:1])
            self.head.bias.data.zero_()
        else:
            torch.nn.init.normal_(self.head.weight, std=1.0 / (cfg.hidden_size + 1) ** 0.5)
            torch.nn.init.zeros_(self.head.bias)
        self.head.to(self.backbone.device)     # made on the host: the same draws wherever the backbone is

    def forward(self, input_ids, attention_mask, packed: bool = False):
        """(B, L) values; `packed`: computed on the rows packed into one (hpcrl.models.packing), 0 at padding."""
        if not packed:
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
            return self.head(hidden).squeeze(-1).float()
        pk = Packed.of(input_ids, attention_mask)
        hidden = self.backbone(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).last_hidden_state
        return pk.unpack(self.head(hidden).squeeze(-1).float())


def response_values(model: ValueModel, input_ids, attention_mask, response_len: int, packed: bool = False) -> torch.Tensor:
    """V_t for response token t: the value of the prefix that precedes it."""
    return model(input_ids, attention_mask, packed=packed)[:, -response_len - 1:-1]


def values_head(model: ValueModel, mb) -> dict:
    """The critic's forward for an engine: {"values"} of a micro-batch's response tokens."""
    return {"values": response_values(model, mb["input_ids"], mb["attention_mask"], mb["responses"].shape[1],
                                      mb.meta.get(PACKED, False))}
