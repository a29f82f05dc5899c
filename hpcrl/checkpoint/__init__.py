"""Checkpoints: one HDF5 file per role (format.py), written by the role itself (role.py; a
data-parallel role through parallel HDF5: parallel.py), committed by the driver with a manifest
(commit.py) in the run's store (store.py). Import the modules themselves: this one imports nothing,
so that an MPI writer task (`python -m hpcrl.checkpoint.parallel`) does not load torch."""
