"""Two critics of different shapes trained side by side on the same actor data, by a driver of
your own (jobs/tiny-cpu-two-critics.yaml):

    roles:
      critic_small: {same_nodes_as: critic, worker: hpcrl.jobs.two_critics:SmallCritic,
                     worker_args: {hidden_size: 64, layers: 1}}
    driver: hpcrl.jobs.two_critics:main

The built-in critic (role critic: the actor's backbone with a value head) gives the values that
make the GAE advantages, as in the built-in loop; the small one (a fresh 1-layer model of its own)
learns the same returns from its own values and does not touch the actor. Each value loss is
logged as vf_loss/<role>, which `hpcrl report` draws on one plot.
"""
import tempfile
import time
from pathlib import Path

import hpcrl
from hpcrl.algo import FixedKLController
from hpcrl.models import CharTokenizer, create_model_dir
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.loop import compute_advantages, pad_for_ranks
from hpcrl.ppo.step_metrics import explained_variance
from hpcrl.ppo.roles import Critic
from hpcrl.ppo.tasks.copy_digits import ALPHABET


class SmallCritic(Critic):
    """The built-in critic's updates on a value model of its own shape: a seeded tiny Qwen2 over the
    copy task's tokens (the actor's vocabulary), built where this rank runs."""

    def __init__(self, hidden_size: int = 64, layers: int = 1, heads: int = 2, lr: float = 2e-3, seed: int = 1,
                 ppo_epochs: int = 2, mini_batch_size: int = 32):
        model = create_model_dir(Path(tempfile.mkdtemp(prefix="small-critic-")), CharTokenizer(ALPHABET), seed,
                                 hidden_size=hidden_size, layers=layers, heads=heads)
        cfg = TrainConfig(seed=seed, optim={"critic_lr": lr, "ppo_epochs": ppo_epochs, "mini_batch_size": mini_batch_size,
                                            "micro_batch_size": mini_batch_size})
        super().__init__(str(model), cfg)


def main(ctx: hpcrl.RunContext) -> str | None:
    cfg, groups = ctx.cfg, ctx.groups
    actor, critic, small, ref = groups["actor_rollout"], groups["critic"], groups["critic_small"], groups.get("ref")
    kl = FixedKLController(cfg.algorithm.kl_coef)
    resumed = ctx.resume()
    start = resumed.step if resumed else 0
    for step in range(start + 1, cfg.total_steps + 1):
        t0 = time.perf_counter()
        ctx.status.phase(step, "generate and score")
        prompts = ctx.dataset.next_batch()
        prompts.meta["step"] = step
        generated = actor.generate_sequences.future(prompts)
        reads = [actor.compute_log_prob.future(generated), critic.compute_values.future(generated)]
        reads += [ref.compute_ref_log_prob.future(generated)] if ref else []
        small_values = small.compute_values.future(generated)
        batch = ctx.scored(generated)
        for f in reads:
            batch = batch.union(f.result())
        compute_advantages(batch, cfg, kl)                            # GAE on the built-in critic's values

        ctx.status.phase(step, "update the critics and the actor")
        main_stats = critic.update_critic(pad_for_ranks(batch, critic.world_size))[0]
        # the same returns, against the small critic's own values
        side = batch.select(*[k for k in batch.keys() if k != "values"]).union(small_values.result())
        small_stats = small.update_critic(pad_for_ranks(side, small.world_size))[0]
        actor.update_actor(pad_for_ranks(batch, actor.world_size))
        actor.sync_rollout_weights(step)

        mask = batch["response_mask"]
        ctx.log({"step": step, "time": round(time.time(), 3), "reward/mean": float(batch["scores"].mean()),
                 "vf_loss/critic": main_stats["vf_loss"], "vf_loss/critic_small": small_stats["vf_loss"],
                 "vf_explained_var/critic": explained_variance(batch["values"], batch["returns"], mask),
                 "vf_explained_var/critic_small": explained_variance(side["values"], side["returns"], mask),
                 "timing/step": round(time.perf_counter() - t0, 4)})
        if reason := ctx.end_step(step):     # checkpoints; on a signal, the stop (the job requeues)
            return reason
    return None
