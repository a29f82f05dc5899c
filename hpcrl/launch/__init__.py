"""Starting things: a spec submitted as a hetjob (submit.py), and the driver started the one way
(entrypoint.py: `python -m hpcrl.launch RUN_DIR`), by the batch script, submitit (submitit.py) or locally."""
