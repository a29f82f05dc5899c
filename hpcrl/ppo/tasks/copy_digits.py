"""Copy: the prompt "4071=" is answered "4071" then the stop token.

The answer depends on the prompt, so no fixed output wins. score = share of the prompt's digits
repeated in place at the start of the response (what follows is not read; `missing_eos_penalty`
can ask for the stop token): a uniform random policy over the tokenizer's 14 ids scores about
0.07, a solved one 1.0."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

ALPHABET = "0123456789="


def write_prompts(path: Path, n: int, digits: int, seed: int, sigma: float = 0.0) -> Path:
    """n prompts of `digits` digits, or with sigma > 0 of a lognormal count (median `digits`, at
    most 10 × digits): a long tail of response lengths."""
    rng = random.Random(seed)

    def count() -> int:
        return min(max(1, round(digits * math.exp(rng.gauss(0.0, sigma)))), 10 * digits) if sigma else digits
    lines = [json.dumps({"prompt": "".join(rng.choice("0123456789") for _ in range(count())) + "="}) for _ in range(n)]
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return Path(path)


def score(prompt: str, response: str, **_) -> float:
    target = prompt.rstrip("=")
    return sum(a == b for a, b in zip(response, target)) / len(target)
