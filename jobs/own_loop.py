"""Your own loop: GRPO written on the public run context, in place of the built-in driver.

    driver: hpcrl.jobs.own_loop:main      # in the spec (jobs/tiny-cpu-rules.yaml runs it in its tests)

It is the built-in loop (hpcrl/ppo/loop.py, `ppo`) cut down to what GRPO without a reference
needs: generate, score (train.reward.scorers, your own roles' scores included), group-normalised
advantages, one actor update, the new weights to the sampler. Requeue, exact resume and role
restart come from the context: resume() first, end_step() after every step.
"""
import time

import numpy as np

import hpcrl
from hpcrl.algo import FixedKLController
from hpcrl.ppo.loop import compute_advantages, pad_for_ranks


def main(ctx: hpcrl.RunContext) -> str | None:
    cfg, actor = ctx.cfg, ctx.groups["actor_rollout"]
    if cfg.algorithm.advantage != "grpo" or cfg.algorithm.uses_ref:
        raise ValueError("hpcrl.jobs.own_loop runs GRPO without a reference: set train.algorithm.advantage: grpo, kl_coef: 0")
    resumed = ctx.resume()
    start = resumed.step if resumed else 0
    for step in range(start + 1, cfg.total_steps + 1):
        t0 = time.perf_counter()
        ctx.status.phase(step, "generate and score")
        prompts = ctx.dataset.next_batch().repeat(cfg.rollout.n_samples)
        prompts["group"] = np.repeat(np.arange(cfg.data.batch_size), cfg.rollout.n_samples)
        prompts.meta["step"] = step                                   # seeds the sampler
        generated = actor.generate_sequences.future(prompts)
        old = actor.compute_log_prob.future(generated)               # rank to rank, as the scores
        batch = ctx.scored(generated).union(old.result())

        ctx.status.phase(step, "update_actor")
        compute_advantages(batch, cfg, FixedKLController(0.0))
        stats = actor.update_actor(pad_for_ranks(batch, actor.world_size))[0]
        actor.sync_rollout_weights(step)

        ctx.log({"step": step, "time": round(time.time(), 3), "reward/mean": float(batch["scores"].mean()),
                 **{f"score/{s.role}": float(batch[f"score/{s.role}"].mean()) for s in cfg.reward.terms()},
                 "actor/pg_loss": stats["pg_loss"], "timing/step": round(time.perf_counter() - t0, 4)})
        print(f"step {step}/{cfg.total_steps} reward {float(batch['scores'].mean()):.3f}", flush=True)
        if reason := ctx.end_step(step):     # checkpoints; on a signal, the stop (the job requeues)
            return reason
    return None
