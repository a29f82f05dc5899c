"""The driver as a submitit function: what `hpcrl submit --via submitit` runs for a spec with `train:`.

submitit calls `checkpoint()` from its USR2 handler (time limit near, or preemption), on the main
thread. Training therefore runs on a second thread: the handler asks it to stop after the current
step, waits until that step's checkpoint is committed, and hands submitit this same object to run
again. The requeued job resumes from the run's newest checkpoint, as the sbatch path does.
"""
from __future__ import annotations

import threading

import submitit

from hpcrl.run_dir import RunDir
from hpcrl.stop import StopRequest


class SubmititTraining(submitit.helpers.Checkpointable):
    def __init__(self, run_dir: str):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict:
        from hpcrl.launch.entrypoint import run  # here: `import hpcrl` must not import the trainer
        from hpcrl.observe.metrics import read_metrics

        self._stop, outcome = StopRequest(cancel_file=RunDir(self.run_dir).cancel), {}

        def train():
            try:
                outcome["reason"] = run(self.run_dir, self._stop)[1]
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                outcome["error"] = e
        self._thread = threading.Thread(target=train, name="hpcrl-train")
        self._thread.start()
        self._wait()
        if "error" in outcome:
            raise outcome["error"]
        records = read_metrics(RunDir(self.run_dir).metrics)
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
