"""The job spec: the models (models.py), reading one from YAML (load.py), and every check of it
before submission (checks.py)."""
from hpcrl.jobspec.load import load_spec, parse_spec
from hpcrl.jobspec.models import JobSpec, RoleSpec, SpecError

__all__ = ["JobSpec", "RoleSpec", "SpecError", "load_spec", "parse_spec"]
