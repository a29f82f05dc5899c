"""Validation on held-out prompts: the policy answers every one (greedy unless val_temperature > 0,
val_samples times), the run's reward role scores the answers, and the scores are kept per data source.

    val/score                          mean score over every held-out answer
    val/score/<data_source>            the same for each source of a mixed dataset
    val/response_length/mean, /clip_ratio   tokens per answer; share that hit max_new_tokens
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

import numpy as np

from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset
from hpcrl.ppo.episodes import episode_scores


def validate(cfg: TrainConfig, held_out: PromptDataset, generate, reward, step: int) -> Callable[[], dict[str, float]]:
    """`generate`: prompts -> a future of the generated batch, or the batch (multi-turn episodes);
    `reward`: the reward role's WorkerGroup. Every piece's generation is issued here, at once, so
    that all of it is made with the weights of now; the returned function scores the answers and
    gives the metrics. The loop issues the score before training behind the first step's generation
    and collects it after the first update: a rollout role of its own answers the held-out prompts
    while the actor trains (the scoring is issued only then, behind the step's own).

    The prompts go in pieces of equal size, at most as many answers as a training step generates
    (data.batch_size x rollout.n_samples: what the engine is sized for), the last filled with repeats
    (dropped here) so that an engine that captured a graph for the first piece replays it for every
    one; each piece is scored once it is generated, while the next is. The GPU spec's 300 held-out
    prompts are 3 pieces of 100, not 19 of 16 each waited for in turn."""
    most = max(1, cfg.data.batch_size * cfg.rollout.n_samples // cfg.validation.samples)
    size = -(-len(held_out) // -(-len(held_out) // most))      # ceil(n / the fewest pieces of at most `most`)

    def issued(prompts):
        if cfg.validation.samples > 1:
            prompts = prompts.repeat(cfg.validation.samples)
        prompts.meta.update(step=step, validation=True)
        return prompts, generate(prompts)

    generating = [issued(p) for p in held_out.in_order(size, fill=True)]
    return lambda: _scored(cfg, generating, reward, size, len(held_out))


def _scored(cfg: TrainConfig, generating: list, reward, size: int, left: int) -> dict[str, float]:
    """The metrics of the answers being generated (prompts, future), scored from rank to rank."""
    scores, sources, lengths, clipped = [], [], [], []
    scoring = [reward.compute_scores.future(gen) for _, gen in generating]   # from the generating ranks to the reward's
    for (prompts, gen), scored in zip(generating, scoring):
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
