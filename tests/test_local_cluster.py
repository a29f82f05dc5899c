"""The local cluster is a real Slurm: batch jobs, hetjobs across partitions, preemption with requeue."""
import pytest
from conftest import job_finished, job_records, sh, wait_until

pytestmark = pytest.mark.slurm


def test_plain_batch_job_runs(slurm_cluster, tmp_path):
    out = tmp_path / "out"
    jid = sh("sbatch", "--parsable", "-p", "cpu", "-o", str(out),
             "--wrap", "echo node=$SLURMD_NODENAME partition=$SLURM_JOB_PARTITION").strip()
    wait_until(lambda: job_finished(jid), 300, f"job {jid}")
    assert job_records(jid)[0]["JobState"] == "COMPLETED"
    assert out.read_text().strip() in ("node=cpun1 partition=cpu", "node=cpun2 partition=cpu")


@pytest.mark.cluster_exclusive    # both a100 nodes at once: a hetjob starts only when all of it fits
def test_hetjob_components_run_on_their_partitions(slurm_cluster, tmp_path):
    script = tmp_path / "het.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH -p h100 -N1 --gres=gpu:h100:2
#SBATCH hetjob
#SBATCH -p a100 -N2 --gres=gpu:a100:1
#SBATCH hetjob
#SBATCH -p cpu -N1
for g in 0 1 2; do
  srun --het-group=$g bash -c "echo \\$SLURM_JOB_PARTITION \\$SLURMD_NODENAME \\$SLURM_JOB_NODELIST \\$SLURM_STEP_GPUS > {tmp_path}/g$g.\\$SLURMD_NODENAME" &
done
wait
""")
    jid = sh("sbatch", "--parsable", "-o", str(tmp_path / "out"), str(script)).strip()
    wait_until(lambda: job_finished(jid), 300, f"hetjob {jid}")
    recs = {int(r["HetJobOffset"]): r for r in job_records(jid)}
    assert [recs[i]["Partition"] for i in range(3)] == ["h100", "a100", "cpu"]
    seen = {p.name: p.read_text().split() for p in tmp_path.glob("g*.*")}
    assert sorted(k.split(".")[0] for k in seen) == ["g0", "g1", "g1", "g2"]
    assert {k for k in seen if k.startswith("g1")} == {"g1.a100n1", "g1.a100n2"}
    for name, (partition, node, nodelist, *gpus) in seen.items():
        group = int(name[1])
        assert partition == ["h100", "a100", "cpu"][group]
        assert node.startswith(partition[:4] if group < 2 else "cpun")
        assert nodelist == recs[group]["NodeList"]
        assert gpus == ([] if group == 2 else ["0,1"] if group == 0 else ["0"])


@pytest.mark.cluster_exclusive    # an urgent job preempts a100n2
def test_urgent_job_preempts_and_victim_is_requeued(slurm_cluster, tmp_path):
    marks = tmp_path / "marks"
    victim = sh("sbatch", "--parsable", "-p", "a100", "-w", "a100n2", "--requeue", "-o", str(tmp_path / "v.out"),
                "--open-mode=append", "--signal=B:USR1@30", "--wrap",
                f"trap 'echo usr1 >> {marks}' USR1; echo start=$SLURM_RESTART_COUNT >> {marks}; "
                # unpreempted, it would outlast the scheduler's pick plus the partition's GraceTime (45 s)
                "if [ ${SLURM_RESTART_COUNT:-0} = 0 ]; then for i in $(seq 1800); do sleep 0.1; done; fi").strip()
    wait_until(lambda: marks.exists() and "start=" in marks.read_text(), 30, "victim running")
    urgent = sh("sbatch", "--parsable", "-p", "urgent", "-w", "a100n2", "--exclusive", "-o", "/dev/null",
                "--wrap", "sleep 1").strip()
    wait_until(lambda: job_finished(urgent), 120, "urgent job")
    wait_until(lambda: "start=1" in marks.read_text(), 90, "victim back with SLURM_RESTART_COUNT=1")
    wait_until(lambda: job_finished(victim), 30, "victim finishing")
    lines = marks.read_text().split()
    assert lines[0] in ("start=", "start=0")
    assert "usr1" in lines, "the victim's --signal must arrive before it is killed (preempt_send_user_signal)"
    assert lines[-1] == "start=1"
    assert job_records(victim)[0]["Restarts"] == "1"
