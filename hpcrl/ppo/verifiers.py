"""Verifiable rewards: built-in scorers, and the choice of one by each sample's `data_source`, as
verl's default reward does, so that a dataset mixing sources is scored right sample by sample.

    gsm8k        1 if the last "#### N" of the response is the ground truth's number (GSM8K's format)
    math         1 if math-verify finds the response's final answer (\\boxed{}, LaTeX, fractions,
                 "$1,234$") equal to the ground truth (pip install 'hpcrl[math]')
    last_number  1 if the last number in the response equals the ground truth's
    exact        1 if the response, stripped, is the ground truth

Every scorer is `fn(response, ground_truth) -> float`; `by_data_source` is the reward function
(`train.reward.fn`) that picks one:

    openai/gsm8k, gsm8k                                              gsm8k
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500, math                                     math
    reasoning_gym/<task>, mathqa                                     last_number
    exact                                                            exact
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def _as_number(text: str) -> float | None:
    try:
        return float(str(text).replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def _same_number(found: str | None, ground_truth) -> float:
    if found is None:
        return 0.0
    a, b = _as_number(found), _as_number(ground_truth)
    return float(a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b)))


def gsm8k(response: str, ground_truth) -> float:
    """GSM8K's answer line: the last "#### N" (commas and $ ignored) against the ground truth."""
    found = _GSM8K.findall(response)
    return _same_number(found[-1] if found else None, ground_truth)


def last_number(response: str, ground_truth) -> float:
    """The last number anywhere in the response against the ground truth's."""
    found = _NUMBER.findall(response)
    return _same_number(found[-1] if found else None, ground_truth)


def exact(response: str, ground_truth) -> float:
    return float(response.strip() == str(ground_truth).strip())


def math(response: str, ground_truth) -> float:
    """math-verify's parse and verify: the response's final answer equals the ground truth's."""
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise RuntimeError(f"the math scorer needs math-verify ({e}): pip install 'hpcrl[math]'") from None
    gold = parse(str(ground_truth) if "$" in str(ground_truth) or "\\" in str(ground_truth) else f"${ground_truth}$")
    answer = parse(response)
    return float(bool(gold) and bool(answer) and verify(gold, answer))


SCORERS = {"openai/gsm8k": gsm8k, "gsm8k": gsm8k,
           "lighteval/MATH": math, "DigitalLearningGmbH/MATH-lighteval": math, "HuggingFaceH4/MATH-500": math,
           "math": math, "mathqa": last_number, "exact": exact}
PREFIXES = {"reasoning_gym/": last_number}


def scorer_for(data_source: str):
    """The built-in scorer of a data source, or a ValueError that lists the known ones."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    for prefix, fn in PREFIXES.items():
        if str(data_source).startswith(prefix):
            return fn
    raise ValueError(f"no built-in scorer for data_source {data_source!r} (known: {', '.join(SCORERS)}, "
                     f"{', '.join(p + '*' for p in PREFIXES)}); set train.reward.fn to your own module:function")


def by_data_source(prompt, response: str, data_source: str | None = None, ground_truth=None, **_) -> float:
    """The reward function for datasets in verl's format: the scorer of the sample's data_source."""
    if data_source is None or ground_truth is None:
        raise ValueError("the sample has no data_source or no ground_truth (verl's reward_model.ground_truth); "
                         "the built-in scorers need both, or set train.reward.fn to your own function")
    return scorer_for(data_source)(response, ground_truth)
