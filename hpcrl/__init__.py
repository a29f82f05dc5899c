"""hpcrl: Slurm-native multi-controller RLHF.

    import hpcrl
    spec = hpcrl.load_spec("jobs/tiny-cpu.yaml")
    job = hpcrl.submit(spec, via="sbatch")      # job.job_id, job.state(), job.wait(), job.logs(role)
"""
from hpcrl._version import __version__
from hpcrl.job import JobSpec, SpecError, load_spec
from hpcrl.launch.submit import submit
from hpcrl.raycluster import connect
from hpcrl.slurm.submit import JobHandle

__all__ = ["JobSpec", "SpecError", "load_spec", "submit", "JobHandle", "connect", "__version__"]
