"""hpcrl: Slurm-native multi-controller RLHF.

    import hpcrl
    spec = hpcrl.load_spec("jobs/tiny-cpu.yaml")
    job = hpcrl.submit(spec, via="sbatch")      # job.job_id, job.state(), job.wait(), job.logs(role)
"""
__version__ = "0.1.0"

from hpcrl.spec import JobSpec, SpecError, load_spec  # noqa: E402
from hpcrl.slurm.submit import JobHandle  # noqa: E402
from hpcrl.submitit_training import submit  # noqa: E402
from hpcrl.raycluster import connect  # noqa: E402

__all__ = ["JobSpec", "SpecError", "load_spec", "submit", "JobHandle", "connect", "__version__"]
