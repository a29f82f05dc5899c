"""hpcrl: Slurm-native multi-controller RLHF.

    import hpcrl
    spec = hpcrl.load_spec("jobs/tiny-cpu.yaml")
    job = hpcrl.submit(spec, via="sbatch")      # job.job_id, job.state(), job.wait(), job.logs(role)
    hpcrl.submit("jobs/tiny-cpu.yaml", overrides=["train.optim.actor_lr=1e-6"], run_dir="runs/lr", wait=True)
    hpcrl.run(spec, run_dir="runs/here")         # hpcrl run --local
    hpcrl.sweep(spec, {"train.seed": [1, 2]}, max_running=1)   # hpcrl sweep
    hpcrl.cancel("runs/lr")                      # hpcrl cancel: a last checkpoint, no requeue
    hpcrl.scale("runs/lr", {"reward": 3})        # hpcrl scale: satellite jobs grow a role while it trains

Each takes the options of its command, as keyword arguments.

The names below are imported when first used, so `import hpcrl` (and every `python -m hpcrl.<step>`
of a batch script) loads nothing it does not need.
"""
from hpcrl._version import __version__

_API = {"JobSpec": "hpcrl.jobspec", "SpecError": "hpcrl.jobspec", "load_spec": "hpcrl.jobspec",
        "submit": "hpcrl.launch.submit", "run": "hpcrl.launch.local", "sweep": "hpcrl.launch.sweep",
        "cancel": "hpcrl.launch.cancel", "scale": "hpcrl.launch.scale", "JobHandle": "hpcrl.slurm.sbatch",
        "connect": "hpcrl.raycluster",
        # for your own roles and driver (docs: how-to/own-role.md)
        "Worker": "hpcrl.controller", "register": "hpcrl.controller", "Dispatch": "hpcrl.controller",
        "Batch": "hpcrl.controller.batch", "RunContext": "hpcrl.ppo.context",
        # for your own environments (docs: how-to/environments.md)
        "Environment": "hpcrl.environments", "Turn": "hpcrl.environments"}

__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'hpcrl' has no attribute {name!r}")
