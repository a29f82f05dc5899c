"""A character tokenizer that ships with hpcrl, saved beside the model so every role reads the same.

Ids 0, 1, 2 are pad, bos, eos (pad ≠ eos: a padded position never reads as a stop)."""
from __future__ import annotations

import json
from pathlib import Path

FILE = "hpcrl_tokenizer.json"
SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError(f"tokenizer characters repeat: {chars!r}")
        self.chars = chars
        self.index = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tokenizer's alphabet {self.chars!r}")
        return ([self.bos_id] if bos else []) + [self.index[c] for c in text]

    def decode(self, ids) -> str:
        """Text of the ids up to the first eos, specials dropped."""
        out = []
        for i in (int(x) for x in ids):
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)

    def save(self, model_dir: Path) -> None:
        (Path(model_dir) / FILE).write_text(json.dumps({"chars": self.chars, "specials": SPECIALS}))

    @classmethod
    def load(cls, model_dir: Path) -> CharTokenizer:
        path = Path(model_dir) / FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: the model directory was not made by hpcrl.models.create_model_dir")
        return cls(json.loads(path.read_text())["chars"])
