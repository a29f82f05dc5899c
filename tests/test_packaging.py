"""What the wheel holds (pure logic on the checkout; .ci/wheel-smoke installs and runs the wheel itself)."""
import configparser
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
