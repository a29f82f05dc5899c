"""What a step of the built-in loop logs: every metric that it (hpcrl/ppo/loop.py) and its
validation (hpcrl/ppo/validation.py) write to RUN_DIR/metrics.jsonl, TensorBoard and W&B, with its
unit and meaning (METRICS), and a step's record computed from its batch (`step_record`).

The reference page docs/pages/reference/metrics.md is generated from METRICS
(hpcrl/reference_docs.py), and tests/test_reference_docs.py runs a short training and checks both
ways: every key it logs has an entry here, and every entry here is logged. A key in angle brackets
(`score/<role>`) stands for a family, one key per role or data source.
"""
from __future__ import annotations

import re
import time
from typing import NamedTuple

import numpy as np
import torch

from hpcrl import algo
from hpcrl.controller.batch import Batch


class Metric(NamedTuple):
    unit: str
    meaning: str


METRICS: dict[str, Metric] = {
    "step": Metric("", "the training step the record is of; 0 is the validation before the first step "
                       "(`train.validation.before_train`), whose record holds only `val/` keys"),
    "time": Metric("s since 1970", "when the record was written (Unix time)"),
    "reward/mean": Metric("score", "mean score of the step's responses: the weighted sum of the terms of "
                                   "`train.reward.scorers`, before the KL penalty and "
                                   "`train.reward.missing_eos_penalty`"),
    "reward/max": Metric("score", "highest score of the step's responses"),
    "score/<role>": Metric("score", "mean of one term of `train.reward.scorers` (the role's scoring method, before "
                                    "its weight); logged when there is more than one term"),
    "kl": Metric("nats per token", "mean per-token KL(π‖π_ref) of the step's responses "
                                   "(`train.algorithm.kl_estimator`): the actor's log-probs before its update "
                                   "against the reference's; 0 without a reference role"),
    "kl_coef": Metric("", "β of the step: the KL controller's value when the KL is in the rewards (adaptive with "
                          "`train.algorithm.kl_target`), `train.algorithm.kl_coef` when it is in the actor's loss"),
    "actor/pg_loss": Metric("", "clipped PPO surrogate loss (aggregated as `train.algorithm.loss_agg_mode` says), "
                                "mean over the step's optimizer steps; null while `train.optim.critic_warmup` trains "
                                "only the critic"),
    "actor/clipfrac": Metric("fraction of tokens", "share of response tokens where the ε clip was active, mean over "
                                                   "the optimizer steps; null during the critic's warm-up"),
    "actor/mis_masked": Metric("fraction of tokens", "share of response tokens `train.algorithm.mis_band` dropped from "
                                                     "the policy loss (π_actor/π_rollout outside the band), mean over "
                                                     "the optimizer steps; null without mis_band"),
    "actor/entropy": Metric("nats per token", "mean entropy of the policy over the step's response tokens, from the "
                                              "actor's log-prob pass before its update"),
    "actor/approx_kl": Metric("nats per token", "mean of log π_old − log π over the response tokens: how far the "
                                                "updates moved the policy, mean over the optimizer steps; null during "
                                                "the critic's warm-up"),
    "actor/grad_norm": Metric("", "the actor's gradient norm before clipping to `train.optim.grad_clip`, mean over "
                                  "the optimizer steps; null during the critic's warm-up"),
    "critic/vf_loss": Metric("", "value loss (clipped around the old values by `train.algorithm.vf_clip`), per "
                                 "token, mean over the critic's optimizer steps; null without a critic (GRPO)"),
    "critic/vf_explained_var": Metric("", "1 − Var(returns − values) / Var(returns) over the response tokens, the "
                                          "values being the critic's before its update (1: it predicts the returns); "
                                          "NaN when the returns are all equal; null without a critic"),
    "batch/kept_groups": Metric("groups", "prompt groups (a prompt and its `train.rollout.n_samples` responses) the "
                                          "step trained on: all of the batch's, unless "
                                          "`train.algorithm.dynamic_sampling` dropped those whose scores were all "
                                          "equal (0: the step made no update)"),
    "batch/refills": Metric("batches", "batches generated beyond the step's own to refill it to `train.data.batch_size` "
                                       "groups (`train.algorithm.dynamic_sampling`, at most `train.algorithm.refills`); "
                                       "0 without dynamic sampling"),
    "policy/version": Metric("step", "the step whose actor update made the weights that sampled the batch (0: the "
                                     "initial weights); the oldest, when the samples trained on came from batches "
                                     "sampled with different weights (dynamic sampling's refills)"),
    "policy/lag": Metric("updates", "how many updates older the sampling weights are than the actor the batch "
                                    "trains: 0 when each step generates with the newest weights, up to "
                                    "`train.rollout.max_staleness` with `train.rollout.pipeline: one_step_off` "
                                    "or `async` (with async, less when the rollout is the slower side); the "
                                    "largest of the samples trained on"),
    "policy/lag/<lag>": Metric("fraction of samples", "the staleness histogram: the share of the samples trained on "
                                                      "(all of the step's where dynamic sampling kept none) that are "
                                                      "<lag> updates old, one key per lag that occurs"),
    "buffer/depth": Metric("batches", "`train.rollout.pipeline: async` only: batches already generated in the buffer "
                                      "when the step took its batch, that one included (0: the trainer waited for "
                                      "the rollout; `train.rollout.max_staleness` + 1: the rollout waited for the "
                                      "trainer)"),
    "rollout/versions_per_response": Metric("versions", "`train.rollout.partial_rollout: continue` only: policy versions "
                                                        "among a response's tokens, mean over the step's responses (1: "
                                                        "one set of weights sampled each whole)"),
    "rollout/log_prob_diff": Metric("nats per token", "mean |log π_old − log π_rollout| over the response tokens: "
                                                      "the actor's recomputed log-probs against the sampler's "
                                                      "(kernels, precision, stale weights); null when the rollout "
                                                      "engine returns no log-probs"),
    "response_length/mean": Metric("tokens", "mean response length, the stop token counted"),
    "response_length/max": Metric("tokens", "longest response of the step"),
    "response_length/clip_ratio": Metric("fraction of responses", "share of responses without a stop token: cut at "
                                                                  "`train.rollout.max_new_tokens`"),
    "env/turns": Metric("turns", "model turns per episode, mean over the step's episodes; multi-turn runs only "
                                 "(`train.environment`)"),
    "env/failed": Metric("fraction of episodes", "share of the step's episodes whose environment failed (raised, timed "
                                                 "out, or lost its process): scored `train.environment.failed_score`, "
                                                 "each named in the log"),
    "env/<info>": Metric("per episode", "a number the environment reports in `Turn.info`, summed over an episode's "
                                        "turns, mean over the step's episodes: `tool_calls` and `tool_errors` (malformed "
                                        "calls, unknown tools, calls that failed) of the tool environment"),
    "val/score": Metric("score", "mean score of every held-out answer (`train.validation.dataset`, "
                                 "`train.validation.samples` answers per prompt); in the records of the steps "
                                 "validated: every `train.validation.every` steps, the last step, and step 0 with "
                                 "`train.validation.before_train`"),
    "val/score/<data_source>": Metric("score", "the same for the held-out prompts of one `data_source` (verl's "
                                               "field), when they carry one"),
    "val/response_length/mean": Metric("tokens", "mean length of the held-out answers"),
    "val/response_length/clip_ratio": Metric("fraction of responses", "share of held-out answers cut at "
                                                                      "`train.rollout.max_new_tokens`"),
    "timing/generate": Metric("s", "waiting for the step's batch to be generated (pipelined: only what the "
                                   "training of the step before did not hide) and for the last weights sent"),
    "timing/score": Metric("s", "old log-probs, reference log-probs, values, and the scores not issued as soon as "
                                "the batch existed"),
    "timing/environment": Metric("s", "within `timing/generate`, the multi-turn episodes' waits for the env role "
                                      "(starting episodes, answering turns); multi-turn runs only"),
    "timing/advantage": Metric("s", "the KL-shaped token rewards and the advantages, on the driver"),
    "timing/update_critic": Metric("s", "the critic's updates; not logged without a critic"),
    "timing/update_actor": Metric("s", "the actor's updates; not logged during the critic's warm-up"),
    "timing/sync_weights": Metric("s", "the new weights to the generating engine (pipelined: sent off; the wait "
                                       "falls in the next step's `timing/generate`)"),
    "timing/rollout_idle": Metric("s", "`train.rollout.pipeline: async` only: since the step before took its batch, "
                                       "the time the rollout role had no batch to generate (the buffer was full: "
                                       "the staleness bound held it back). The trainer's idle time is "
                                       "`timing/generate`"),
    "timing/validate": Metric("s", "the validation after this step, when there was one"),
    "timing/step": Metric("s", "the whole step, validation included, checkpoint not"),
    "timing/startup": Metric("s", "on the first step of each start of the run only: from the start's beginning (the "
                                  "submission, the end of the start before it, or the driver's start for a local run) "
                                  "to the end of this step; the `startup` events say where the time went"),
    "throughput/tokens_per_s": Metric("tokens/s", "prompt and response tokens of the step's batch (padding not "
                                                  "counted) per second of the step, validation not counted"),
    "throughput/rollout_tokens_per_s": Metric("tokens/s", "`train.rollout.pipeline: async` only: the rollout's throughput "
                                                          "with the newest version of the weights it has sampled with: the "
                                                          "response tokens it sampled with them over the seconds of its "
                                                          "calls with them, so far (the records of one version follow "
                                                          "its figure as its calls come in)"),
    "throughput/rollout_version": Metric("step", "the version `throughput/rollout_tokens_per_s` is of: the step whose "
                                                 "update made those weights"),
}


def _pattern(name: str) -> re.Pattern:
    """`val/score/<data_source>` -> val/score/ and any rest (a data source may hold a slash)."""
    return re.compile("".join(".+" if part.startswith("<") else re.escape(part)
                              for part in re.split(r"(<[a-z_]+>)", name)))


_PATTERNS = {name: _pattern(name) for name in METRICS}


def entry(key: str) -> str | None:
    """The METRICS entry a logged key belongs to (`score/reward` -> `score/<role>`), or None."""
    return next((name for name, p in _PATTERNS.items() if p.fullmatch(key)), None)


def explained_variance(values, returns, mask) -> float:
    m = mask.bool()
    var = torch.var(returns[m])
    return float(1 - torch.var(returns[m] - values[m]) / var) if var > 0 else float("nan")


def versions_per_response(token_versions: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean number of distinct policy versions among each response's tokens."""
    return float(np.mean([len(set(v[m.bool()].tolist())) for v, m in zip(token_versions, mask)]))


def step_record(step: int, batch: Batch, trained: Batch, terms: list[str], kl: dict, actor: dict, critic: dict | None,
                trained_with: int, times: dict[str, float], step_s: float, train_s: float, val: dict) -> dict:
    """The metrics of one step (METRICS): from its batch after the updates and the part of it
    `trained` on (all of it unless dynamic sampling dropped groups), the scoring `terms`
    (roles), the KL controller's `kl`, the actor's and critic's update statistics (critic None:
    there is none), the policy version the actor trained from, the phases' `times`, the step's
    seconds with and without validation, and the validation's scores."""
    mask = batch["response_mask"]
    lengths = mask.sum(dim=1).float()
    sampled_by = trained if len(trained) else batch
    versions = sampled_by["policy_version"] if "policy_version" in sampled_by else \
        torch.full((len(sampled_by),), int(batch.meta.get("policy_version", 0)))     # a driver of your own's batch
    lags, counts = np.unique(trained_with - versions.numpy(), return_counts=True)
    sampled = int(versions.min())
    return {"step": step, "time": round(time.time(), 3),
            "reward/mean": float(batch["scores"].mean()), "reward/max": float(batch["scores"].max()),
            **({f"score/{role}": float(batch[f"score/{role}"].mean()) for role in terms} if len(terms) > 1 else {}),
            **kl,
            "actor/pg_loss": actor.get("pg_loss"), "actor/clipfrac": actor.get("clipfrac"),
            "actor/mis_masked": actor.get("mis_masked"),
            "actor/entropy": float(algo.masked_mean(batch["entropy"], mask)),
            "actor/approx_kl": actor.get("approx_kl"), "actor/grad_norm": actor.get("grad_norm"),
            "critic/vf_loss": critic.get("vf_loss") if critic is not None else None,
            "critic/vf_explained_var": explained_variance(trained["values"], trained["returns"], trained["response_mask"])
            if critic is not None else None,
            "batch/kept_groups": len(np.unique(trained["group"])) if "group" in trained else len(trained),
            "batch/refills": batch.meta.get("refills", 0),
            "policy/version": sampled, "policy/lag": trained_with - sampled,
            **{f"policy/lag/{lag}": float(n / counts.sum()) for lag, n in zip(lags.tolist(), counts)},
            "rollout/log_prob_diff": float(algo.masked_mean((batch["old_log_probs"] - batch["rollout_log_probs"]).abs(),
                                                            mask)) if "rollout_log_probs" in batch else None,
            **({"rollout/versions_per_response": versions_per_response(batch["token_versions"], mask)}
               if "token_versions" in batch else {}),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float((~batch["has_eos"]).float().mean()), **val,
            **{k: float(batch[k].float().mean()) for k in batch.tensors if k.startswith("env/")},
            **times, **({"timing/environment": round(batch.meta["environment_seconds"], 4)}
                        if "environment_seconds" in batch.meta else {}),
            "timing/step": round(step_s, 4),
            "throughput/tokens_per_s": round(int(mask.sum() + batch["prompt_mask"].sum()) / train_s, 1)}
