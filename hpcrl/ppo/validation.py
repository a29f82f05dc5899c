"""Validation on held-out prompts: the policy answers every one (greedy unless val_temperature > 0,
val_samples times), the run's reward role scores the answers, and the scores are kept per data source.

    val/score                          mean score over every held-out answer
    val/score/<data_source>            the same for each source of a mixed dataset
    val/response_length/mean, /clip_ratio   tokens per answer; share that hit max_new_tokens
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.episodes import episode_scores


def validate(cfg: TrainConfig, held_out: PromptDataset, generate, reward, step: int) -> dict[str, float]:
    """`generate`: prompts -> a future of the generated batch, or the batch (multi-turn episodes);
    `reward`: the reward role's WorkerGroup."""
    scores, sources, lengths, clipped = [], [], [], []
    for prompts in held_out.in_order(cfg.data.batch_size):
        if cfg.validation.samples > 1:
            prompts = prompts.repeat(cfg.validation.samples)
        prompts.meta.update(step=step, validation=True)
        gen = generate(prompts)
        scored = reward.compute_scores.future(gen)      # from the generating ranks to the reward's
        out = gen.result() if hasattr(gen, "result") else gen
        scores += episode_scores(out.union(scored.result()), cfg.environment.failed_score).tolist()
        sources += list(prompts["data_source"]) if "data_source" in prompts else [None] * len(prompts)
        lengths += out["response_mask"].sum(dim=1).tolist()
        clipped += (~out["has_eos"]).tolist()
    metrics = {"val/score": float(np.mean(scores)),
               "val/response_length/mean": float(np.mean(lengths)),
               "val/response_length/clip_ratio": float(np.mean(clipped))}
    by_source = defaultdict(list)
    for source, score in zip(sources, scores):
        if source is not None:
            by_source[source].append(score)
    metrics.update({f"val/score/{source}": float(np.mean(s)) for source, s in sorted(by_source.items())})
    return metrics
