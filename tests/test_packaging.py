"""What the wheel holds and asks pip for (pure logic on the checkout; .ci/wheel-smoke installs and runs the
wheel itself, .ci/test-lowest the lowest versions it asks for)."""
import configparser
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_cfg_lists_every_package_and_maps_the_template_and_jobs_in():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hpcrl").rglob("__init__.py")}
    assert listed == on_disk | {"hpcrl.templates", "hpcrl.jobs"}, listed ^ (on_disk | {"hpcrl.templates", "hpcrl.jobs"})
    mapped = dict(line.split(" = ") for line in cfg["options"]["package_dir"].strip().splitlines())
    assert mapped == {"hpcrl.templates": "templates", "hpcrl.jobs": "jobs"}
    data = {k: v.strip() for k, v in cfg["options.package_data"].items()}
    assert data == {"hpcrl.templates": "*.j2", "hpcrl.jobs": "*.yaml"}
    assert list((ROOT / "templates").glob("*.j2")) and list((ROOT / "jobs").glob("*.yaml"))
    # a folder of Python modules without __init__.py would be left out of the wheel silently
    assert not [p for p in (ROOT / "hpcrl").rglob("*.py") if not (p.parent / "__init__.py").exists()]


def lower_bounds() -> dict[str, str]:
    """setup.cfg's install_requires: normalized name -> lower bound."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    bounds = {}
    for req in cfg["options"]["install_requires"].split():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(,<[0-9.]+)?", req)
        assert match, f"{req}: every requirement needs a plain lower bound (.ci/lock-lowest pins it)"
        bounds[normalized(match[1])] = match[2]
    return bounds


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lowest_lock_pins_every_requirement_at_its_lower_bound():
    """.ci/test-lowest tests what setup.cfg promises: each requirement exactly at its lower bound."""
    from hpcrl.requirements import release

    pins = dict(line.split("==") for line in (ROOT / ".ci" / "constraints-lowest.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    pins = {normalized(name): version for name, version in pins.items()}

    def padded(version):    # 6 == 6.0
        return release(version) + (0,) * (4 - len(release(version)))
    differ = {name: (bound, pins.get(name)) for name, bound in lower_bounds().items()
              if name not in pins or padded(pins[name]) != padded(bound)}
    assert not differ, f"setup.cfg's bound vs .ci/constraints-lowest.txt (run bash .ci/lock-lowest): {differ}"


def test_the_ray_hpcrl_refuses_is_the_one_setup_cfg_excludes():
    from hpcrl.requirements import RAY, ray_problem, release

    assert release(lower_bounds()["ray"]) == RAY == (2, 55)
    assert ray_problem("2.55.0") is None and ray_problem("3.0.0.dev0") is None
    fix = "install ray>=2.55 into it (/opt/venv/bin/python -m pip install 'ray>=2.55'"
    no_auth = ray_problem("2.51.2", "/opt/venv/bin/python")
    assert no_auth.startswith("ray 2.51.2 in /opt/venv/bin/python lacks Ray 2.52's token authentication"), no_auth
    assert "Ray 2.55's --temp-dir on worker nodes" in no_auth and fix in no_auth, no_auth
    shared_temp = ray_problem("2.54.1", "/opt/venv/bin/python")
    assert shared_temp.startswith("ray 2.54.1 in /opt/venv/bin/python lacks Ray 2.55's --temp-dir"), shared_temp
    assert "token" not in shared_temp and fix in shared_temp, shared_temp
    assert ray_problem(None, "/x/python").startswith("ray is not installed in /x/python: hpcrl needs ray>=2.55")


def test_a_process_with_an_older_ray_stops_before_any_ray_cluster_starts():
    """A node task, the batch shell's prepare and a driver all import hpcrl.raycluster first: with a
    Ray older than token authentication (here its metadata says 2.51.2) that import refuses."""
    code = ("import importlib.metadata as m\nreal = m.version\n"
            "m.version = lambda n: '2.51.2' if n == 'ray' else real(n)\nimport hpcrl.raycluster")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1, out.stderr
    assert f"RequirementError: ray 2.51.2 in {sys.executable} lacks Ray 2.52's token authentication" in out.stderr, \
        out.stderr
