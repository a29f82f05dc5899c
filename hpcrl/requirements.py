"""The Ray that the running interpreter has, refused where it cannot run the job's Ray cluster.

pip holds setup.cfg's bound on ray, but an interpreter can have an older Ray all the same: a container
image built before, packages installed with --target or --no-deps, a site's Ray module. What an older
Ray lacks fails silently or far from its cause (NEEDS), so hpcrl.raycluster checks when it is
imported, which every process that starts or joins the job's cluster does first, in its own
interpreter (a node task in its image, a satellite, the batch shell's prepare, a driver).
"""
from __future__ import annotations

import importlib.metadata
import re
import sys

NEEDS = [((2, 52), "token authentication (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH): an older Ray ignores both "
                   "and the job's Ray cluster would start open to anyone who reaches its ports"),
         ((2, 55), "--temp-dir on worker nodes (hpcrl gives each Ray node its own): an older Ray ignores it and "
                   "gives every worker node the head's, so the job's Ray nodes that share a host share one session "
                   "directory and all but one fail to start")]
"""What hpcrl needs of Ray, from the release that has it."""
RAY = max(version for version, _ in NEEDS)
"""The lowest Ray hpcrl runs on; setup.cfg asks for the same (tests/test_packaging.py)."""


class RequirementError(RuntimeError):
    """This interpreter's packages cannot run the job safely; the message says which and the fix."""


def release(version: str) -> tuple[int, ...]:
    """The release numbers a version starts with: '2.52.0rc1' -> (2, 52, 0), '3.0.0.dev0' -> (3, 0, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    if not match:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(n) for n in match.group().split("."))


def ray_problem(found: str | None, python: str = sys.executable) -> str | None:
    """Why `found` (the installed Ray's version, None: no Ray) cannot run the job's cluster, or None."""
    need = ".".join(map(str, RAY))
    fix = (f"install ray>={need} into it ({python} -m pip install 'ray>={need}'; for a container image, "
           "rebuild the image with it)")
    if found is None:
        return f"ray is not installed in {python}: hpcrl needs ray>={need}; {fix}"
    lacks = [f"Ray {'.'.join(map(str, version))}'s {what}" for version, what in NEEDS if release(found) < version]
    return f"ray {found} in {python} lacks {'; and '.join(lacks)}; {fix}" if lacks else None


def require_ray() -> None:
    """RequirementError unless this interpreter's Ray has all of NEEDS. Reads the installed version
    (package metadata), not `import ray`: a node task must not pay a second of imports for it."""
    try:
        found = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        found = None
    problem = ray_problem(found)
    if problem:
        raise RequirementError(problem)
