"""Containers per component: what is refused before anything is written, and on a node that lacks
the image, the barrier failing by name. (A preempted hetjob in slurm/image's image, resumed bitwise
as on the host: tests/test_requeue.py; the scripts of all three runtimes: tests/test_render.py.)"""
import json
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, job_finished, slurm_log, wait_until, with_train

from hpcrl.jobspec import SpecError, load_spec
from hpcrl.jobspec.checks import problems_before_submit
from hpcrl.slurm.cluster_info import ClusterInfo
from hpcrl.slurm.sbatch import submit_hetjob

TINY = ROOT / "jobs" / "tiny-cpu-containers.yaml"


def spec_file(tmp_path, change, name="spec"):
    data = yaml.safe_load(TINY.read_text())
    change(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_what_cannot_run_in_a_container_is_refused_by_field(tmp_path):
    cases = {
        "bootstrap: mpi, but a component runs in a container": lambda s: s.update(bootstrap="mpi"),
        "train.checkpoint.io: parallel, but a component runs in a container": lambda s: with_train(
            s, checkpoint={"io": "parallel"}),
        "roles.reward: has same_nodes_as and resource fields ['container']": lambda s: s["roles"]["reward"].update(
            container="host"),
        "container.env: ['1X']: names of letters": lambda s: s["container"].update(env={"1X": "y"}),
        "container.runtime: Input should be 'apptainer', 'pyxis' or 'charliecloud'": lambda s: s["container"].update(
            runtime="docker"),
        "container.mounts: 'a\\nb': give one non-empty line": lambda s: s["container"].update(
            mounts=["a\nb"]),
    }
    for i, (message, change) in enumerate(cases.items()):
        with pytest.raises(SpecError) as refused:
            load_spec(spec_file(tmp_path, change, f"bad{i}"), run_dir=tmp_path / "run")
        assert any(p.startswith(message) for p in refused.value.problems), (message, refused.value.problems)
    auto = load_spec(spec_file(tmp_path, lambda s: s.update(bootstrap="auto")), run_dir=tmp_path / "run")
    assert auto.to_hetjob("python3").bootstrap == "poll"       # an MPI rendezvous would need the image's MPI


@pytest.mark.slurm
def test_the_login_node_checks_runtime_image_and_mount_points(slurm_cluster, tmp_path, image, monkeypatch):
    """Against what this node sees: ch-run on PATH, the image folder, the mounts' folders, and in
    the image the folder of each bind (ch-run cannot make one in a read-only image)."""
    monkeypatch.chdir(ROOT)      # the spec's `mounts: [runs]`: the checkout's runs/, a folder in the image
    cluster = ClusterInfo.live()

    def problems(change):
        spec = load_spec(spec_file(tmp_path, change), run_dir=ROOT / "runs" / "x")
        return problems_before_submit(spec, spec.to_hetjob(sys.executable), cluster)
    ok = lambda s: s["container"].update(image=str(image))      # noqa: E731
    assert problems(ok) == []
    missing = problems(lambda s: s["container"].update(image=str(tmp_path / "nope")))
    assert f"container.image: {tmp_path / 'nope'} does not exist" in missing[0], missing
    data = Path(tempfile.mkdtemp(dir="/var/tmp"))        # on the host, not in the image (nor under /tmp)
    try:
        unbound = problems(lambda s: (ok(s), s["container"]["mounts"].append(str(data))))
    finally:
        data.rmdir()
    assert unbound == [f"container: Charliecloud binds {data} at {data}, which the image {image} lacks and cannot make "
                       f"(read-only): mkdir -p {image}{data}, or mount under /tmp"], unbound
    absent = problems(lambda s: (ok(s), s["container"]["mounts"].append(str(data))))     # rmdir'ed above
    assert absent[0] == (f"container.mounts: {data} does not exist on this node (create it, or leave it out "
                      "of mounts)"), absent
    monkeypatch.setenv("PATH", str(tmp_path))
    gone = problems(ok)
    assert "container.runtime: charliecloud needs `ch-run`, which is not on this node's PATH" in gone[0], gone


@pytest.mark.slurm
def test_a_node_without_the_image_fails_the_barrier_naming_node_runtime_and_image(slurm_cluster, tmp_path, image):
    """The critic's image is there when the job is checked and gone when its node starts (a node
    that does not mount the images' storage): the node says so, and the barrier, in the actor's
    image, fails at once naming it."""
    (ROOT / "runs").mkdir(exist_ok=True)      # the spec's `mounts: [runs]`
    gone = tmp_path / "image"
    gone.symlink_to(image)

    def change(s):
        s["container"]["image"] = str(image)
        s["roles"]["critic"]["container"] = {**s["container"], "image": str(gone)}
    spec = load_spec(spec_file(tmp_path, change), run_dir=tmp_path / "run")
    job = spec.to_hetjob(sys.executable)
    assert problems_before_submit(spec, job, ClusterInfo.live()) == []
    gone.unlink()
    handle = submit_hetjob(job, spec_data=spec.as_data())
    wait_until(lambda: job_finished(handle.job_id), 300, "the job to fail")
    log = slurm_log(tmp_path / "run")
    node = json.loads((tmp_path / "run" / "allocation.json").read_text())["components"][1]["nodes"][0]["name"]
    why = f"node {node}: the image {gone} (for ch-run) does not exist there"
    assert why in (tmp_path / "run" / "logs" / "ray" / f"{node}.log").read_text()
    assert f"[hpcrl] {why}" in log, log
    assert "Ray cluster of job" in log and f"a node failed ({node}: [hpcrl] {why}" in log, log
