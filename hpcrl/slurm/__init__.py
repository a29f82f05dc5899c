"""The Slurm layer: a HetJob (job.py) checked against the live cluster (cluster_info.py), rendered as one
heterogeneous batch script (render.py), submitted by sbatch or submitit (sbatch.py); inside the job,
where each component landed (allocation.py), the requeue step (requeue.py) and MPI steps
(mpi_step.py). It knows nothing of RL or of the job spec: components carry opaque member labels."""
