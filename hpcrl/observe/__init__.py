"""Seeing a run from the login node, without a Ray connection: what the driver publishes
(status.py: status.json, events.jsonl; metrics.py: metrics.jsonl, TensorBoard), `hpcrl status`
(overview.py), `hpcrl logs` (logs.py) and `hpcrl report` (report.py)."""
