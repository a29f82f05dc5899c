"""The driver as a submitit function: what `hpcrl submit --via submitit` runs for a spec with `train:`.

submitit calls `checkpoint()` from its USR2 handler (time limit near, or preemption), on the main
thread. Training therefore runs on a second thread: the handler asks it to stop after the current
step, waits until that step's checkpoint is committed, and hands submitit this same object to run
again. The requeued job resumes from the run's newest checkpoint, as the sbatch path does.
"""
from __future__ import annotations

import threading
from pathlib import Path

import submitit


class SubmititTraining(submitit.helpers.Checkpointable):
    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict:
        import ray

        from hpcrl.config import PPOConfig
        from hpcrl.metrics import read_metrics
        from hpcrl.raycluster import connect
        from hpcrl.spec import load_spec
        from hpcrl.trainer import StopRequest, train   # here: `import hpcrl` must not import the trainer

        run_dir = Path(self.run_dir)
        spec = load_spec(run_dir / "spec.yaml", run_dir=run_dir)
        cfg = PPOConfig.from_dict(spec.train)
        connect(run_dir)
        self._stop, outcome = StopRequest(), {}

        def run():
            try:
                outcome["reason"] = train(cfg, run_dir, stop=self._stop, tensorboard=spec.metrics.tensorboard)[1]
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                outcome["error"] = e
        self._thread = threading.Thread(target=run, name="hpcrl-train")
        self._thread.start()
        self._wait()
        ray.shutdown()
        if "error" in outcome:
            raise outcome["error"]
        records = read_metrics(run_dir / "metrics.jsonl")
        return {"steps": len(records), "stopped": outcome.get("reason"),
                "reward/mean": records[-1]["reward/mean"] if records else None}

    def _wait(self) -> None:
        while self._thread.is_alive():
            self._thread.join(0.5)   # short joins: submitit's signal handler runs in between

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        self._stop.request("USR2 (submitit)")
        self._wait()
        return submitit.helpers.DelayedSubmission(SubmititTraining(self.run_dir))


def training_function(spec, via: str):
    """Through submitit, a spec with `train:` runs the driver; anything else, submitit's default."""
    return SubmititTraining(str(spec.run_dir)) if via == "submitit" and spec.train else None


def submit(spec, via: str = "sbatch", **kw):
    """Submit a JobSpec (see `hpcrl.load_spec`) as one heterogeneous job; returns its JobHandle.
    With a `train:` section the job trains; via submitit, the driver is a Checkpointable."""
    from hpcrl.slurm.submit import submit as submit_spec

    kw.setdefault("fn", training_function(spec, via))
    return submit_spec(spec, via, **kw)
