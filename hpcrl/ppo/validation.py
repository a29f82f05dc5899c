"""Validation on held-out prompts: the policy answers every one (greedy unless val_temperature > 0,
val_samples times), the run's reward role scores the answers, and the scores are kept per data source.

    val/score                          mean score over every held-out answer
    val/score/<data_source>            the same for each source of a mixed dataset
    val/response_length/mean, /clip_ratio   tokens per answer; share that hit max_new_tokens
"""
from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.episodes import episode_scores


def validate(cfg: TrainConfig, held_out: PromptDataset, generate, reward, step: int) -> dict[str, float]:
    """`generate`: prompts -> a future of the generated batch, or the batch (multi-turn episodes);
    `reward`: the reward role's WorkerGroup.

    The prompts go in pieces of equal size, at most as many answers as a training step generates
    (data.batch_size x rollout.n_samples: what the engine is sized for), the last filled with repeats
    (dropped here) so that an engine that captured a graph for the first piece replays it for every
    one; the next piece is generated while the one before is scored. The GPU spec's 300 held-out
    prompts are 3 pieces of 100, not 19 of 16 each waited for in turn."""
    most = max(1, cfg.data.batch_size * cfg.rollout.n_samples // cfg.validation.samples)
    size = -(-len(held_out) // -(-len(held_out) // most))      # ceil(n / the fewest pieces of at most `most`)
    scores, sources, lengths, clipped = [], [], [], []

    def issued(prompts):
        if cfg.validation.samples > 1:
            prompts = prompts.repeat(cfg.validation.samples)
        prompts.meta.update(step=step, validation=True)
        gen = generate(prompts)
        return prompts, gen, reward.compute_scores.future(gen)     # from the generating ranks to the reward's

    pieces = held_out.in_order(size, fill=True)
    waiting = [issued(p) for p in itertools.islice(pieces, 2)]
    left = len(held_out)
    while waiting:
        prompts, gen, scored = waiting.pop(0)
        waiting += [issued(p) for p in itertools.islice(pieces, 1)]
        out = gen.result() if hasattr(gen, "result") else gen
        real = min(size, left) * cfg.validation.samples      # the rows before the repeats (repeat interleaves)
        left -= size
        scored_rows = episode_scores(out.union(scored.result()), cfg.environment.failed_score)
        scores += scored_rows[:real].tolist()
        sources += list(prompts["data_source"][:real]) if "data_source" in prompts else [None] * real
        lengths += out["response_mask"][:real].sum(dim=1).tolist()
        clipped += (~out["has_eos"][:real]).tolist()
    metrics = {"val/score": float(np.mean(scores)),
               "val/response_length/mean": float(np.mean(lengths)),
               "val/response_length/clip_ratio": float(np.mean(clipped))}
    by_source = defaultdict(list)
    for source, score in zip(sources, scores):
        if source is not None:
            by_source[source].append(score)
    metrics.update({f"val/score/{source}": float(np.mean(s)) for source, s in sorted(by_source.items())})
    return metrics
