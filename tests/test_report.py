"""`hpcrl report` on a run with a requeue in it: the PNGs, and an index.html a browser renders;
`hpcrl logs -f`: whole lines, each once, until the run has ended."""
import io
import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT, plot_pixels_seen_by_chromium, sh, wait_until

from hpcrl.observe.logs import follow, run_ended
from hpcrl.observe.report import CURVES, restarts, timeline_spans, utilisation
from hpcrl.observe.status import RunStatus
from hpcrl.slurm.sbatch import component_states


def fake_requeued_run(run):
    """200 steps of the demo's metric names, requeued once: stopped after step 64, resumed from its
    checkpoint at step 60 (steps 61-64 were done again, so metrics.jsonl holds each step once)."""
    run.mkdir()
    records = [{"step": s, "reward/mean": min(1, s / 100), "reward/max": 1.0, "kl": 0.01 * s, "kl_coef": 0.01,
                "actor/pg_loss": -0.01, "actor/clipfrac": 0.1, "actor/entropy": 2 - s / 100, "critic/vf_loss": 1 / s,
                "response_length/mean": 3.0, "timing/generate": 0.05, "timing/score": 0.1, "timing/update_critic": 0.1,
                "timing/update_actor": 0.1,
                "timing/step": 0.4, "time": 1000 + 0.4 * s, "throughput/tokens_per_s": 1000} for s in range(1, 201)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    events = [{"event": "start", "step": 0}, {"event": "checkpoint", "step": 60}, {"event": "checkpoint", "step": 64},
              {"event": "stop", "step": 64}, {"event": "start", "step": 64, "resumed": True},
              {"event": "checkpoint", "step": 200}, {"event": "finish", "step": 200}]
    (run / "events.jsonl").write_text("".join(json.dumps({"time": i, **e}) + "\n" for i, e in enumerate(events)))
    (run / "spec.yaml").write_text((ROOT / "jobs" / "tiny-cpu.yaml").read_text())
    # a pipelined schedule: the rollout generates step s+1 while the actor trains step s
    calls = {"rollout": [("generate_sequences", s + 1, 1000 + 0.4 * s - 0.4, 1000 + 0.4 * s - 0.1) for s in range(1, 200)],
             "actor_rollout": [("update_actor", s, 1000 + 0.4 * s - 0.3, 1000 + 0.4 * s) for s in range(1, 201)]}
    for role, rows in calls.items():
        (run / "logs" / role).mkdir(parents=True)
        (run / "logs" / role / "rank0.calls.jsonl").write_text("".join(
            json.dumps({"method": m, "step": st, "start": a, "end": b}) + "\n" for m, st, a, b in rows))


def test_the_timeline_holds_the_calls_of_the_last_steps_clipped_to_them():
    records = [{"step": s, "time": 10.0 * s} for s in range(1, 9)]          # steps end at 10, 20, ... 80
    calls = {"rollout": [{"method": "generate_sequences", "start": 10.0 * s - 12, "end": 10.0 * s - 4} for s in range(1, 9)],
             "critic": [{"method": "update_critic", "start": 10.0 * s - 3, "end": 10.0 * s - 1} for s in range(1, 9)]}
    t0, t1, lanes, ends = timeline_spans(calls, records, steps=2)
    assert (t0, t1, ends) == (60.0, 80.0, [10.0, 20.0])
    assert lanes["rollout"] == [(0.0, 6.0, "generate_sequences"), (8.0, 16.0, "generate_sequences")]   # 58-66 clipped
    assert lanes["critic"] == [(7.0, 9.0, "update_critic"), (17.0, 19.0, "update_critic")]
    assert timeline_spans({}, records) is None


def test_each_roles_busy_share_of_each_step_is_its_calls_time_within_the_step():
    records = [{"step": 0, "time": 5.0}] + [{"step": s, "time": 10.0 * s} for s in range(1, 4)]   # validation at 0
    calls = {"rollout": [{"start": 2.0, "end": 8.0}, {"start": 9.0, "end": 14.0}, {"start": 25.0, "end": 40.0}],
             "actor_rollout": [{"start": 12.0, "end": 13.0}]}
    # step 1 runs from the first call (2) to 10, step 2 from 10 to 20, step 3 from 20 to 30
    busy = utilisation(calls, records)
    assert busy["rollout"] == [(1, 7 / 8), (2, 0.4), (3, 0.5)]
    assert busy["actor_rollout"] == [(1, 0.0), (2, 0.1), (3, 0.0)]
    assert utilisation({}, records) == {}


def test_restarts_are_the_later_starts():
    assert restarts([{"event": "start", "step": 0}, {"event": "checkpoint", "step": 5},
                     {"event": "start", "step": 5}, {"event": "start", "step": 9}]) == [5, 9]
    assert restarts([{"event": "start", "step": 0}]) == []


def test_report_writes_pngs_and_an_html_that_chromium_renders(tmp_path):
    run = tmp_path / "run"
    fake_requeued_run(run)
    out = subprocess.run([sys.executable, "-m", "hpcrl", "report", str(run)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    index = run / "report" / "index.html"
    assert out.stdout.strip() == f"report: {index}"
    pngs = {p.name for p in (run / "report").glob("*.png")}
    # no held-out set, single-turn, not asynchronous: no validation, episodes or buffer curve
    assert pngs == {"timeline.png", "utilisation.png",
                    *(name for name, *_ in CURVES if name not in ("validation.png", "episodes.png", "buffer.png"))}
    for name in pngs:
        assert (run / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = index.read_text()
    assert set(re.findall(r'<img src="([^"]+)"', page)) == pngs
    assert "1 (resumed at steps 64)" in page and "a100" in page      # restarts and the spec's partitions
    seen = plot_pixels_seen_by_chromium(index, tmp_path / "shot.png")
    # the same page without its images: the check can fail
    (run / "report" / "blank.html").write_text(re.sub(r"<img [^>]+>", "", page))
    blank = plot_pixels_seen_by_chromium(run / "report" / "blank.html", tmp_path / "blank.png")
    assert seen > 5000 and blank == 0, (seen, blank)


def test_tensorboard_gets_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpcrl.observe.metrics import MetricsLog, read_metrics

    log = MetricsLog(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        log.write({"step": step, "time": 1000.0 + step, "reward/mean": step / 4, "actor/pg_loss": None})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]          # None (not measured) is left out
    got = [(e.step, e.value, e.wall_time) for e in events.Scalars("reward/mean")]
    assert got == [(r["step"], r["reward/mean"], r["time"]) for r in read_metrics(tmp_path / "metrics.jsonl")]


def test_the_held_out_score_is_drawn_against_training_time_off_the_validation_clock(tmp_path):
    from hpcrl.observe.metrics import score_over_training_time

    # step 0 validates before training; steps 2 and 4 validate (1.5 s of their step time)
    records = [{"step": 0, "val/score": 0.2}, {"step": 1, "timing/step": 2.0, "reward/mean": 0.1},
               {"step": 2, "timing/step": 3.5, "timing/validate": 1.5, "val/score": 0.4, "reward/mean": 0.2},
               {"step": 3, "timing/step": 2.0, "reward/mean": 0.3},
               {"step": 4, "timing/step": 4.0, "timing/validate": 1.5, "val/score": 0.6, "reward/mean": 0.4}]
    assert score_over_training_time(records) == [(0.0, 0.2), (4.0, 0.4), (8.5, 0.6)]    # by hand: 2+2, 4+2+2.5
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    subprocess.run([sys.executable, "-m", "hpcrl", "report", str(run)], capture_output=True, text=True, cwd=ROOT,
                   check=True)
    assert {"validation.png", "validation_time.png"} <= {p.name for p in (run / "report").glob("*.png")}
    assert 'src="validation_time.png"' in (run / "report" / "index.html").read_text()


def test_follow_prints_a_line_written_in_two_halves_once_whole_and_ends_with_the_run(tmp_path):
    """hpcrl logs -f: a line waits for its end (here cut inside a 4-byte character), is printed once
    and whole; a last line without its newline is printed when the run has ended, and follow returns."""
    run = tmp_path / "run"
    log = run / "logs" / "critic" / "rank0.log"
    log.parent.mkdir(parents=True)
    status = RunStatus(run, total_steps=2)                          # starting: a local run, not over
    lines = ["2025-01-02 03:04:05 [critic rank0] step 1", "2025-01-02 03:04:06 [critic rank0] Größe ≥ 10 ✓ 🚀 done",
             "2025-01-02 03:04:07 [critic rank0] the last, without its newline"]
    wide = (lines[1] + "\n").encode()
    cut = wide.index("🚀".encode()) + 2
    log.write_bytes((lines[0] + "\n").encode() + wide[:cut])

    def append(data: bytes):
        with open(log, "ab") as f:
            f.write(data)
    # before each poll of follow: the file as it is, the line's end, a last line, the run's end
    steps = [lambda: None, lambda: append(wide[cut:]), lambda: append(lines[2].encode()),
             lambda: status.event("finish", step=2)]
    polls = []

    def before_poll() -> bool:
        polls.append(len(polls))
        if len(polls) <= len(steps):
            steps[len(polls) - 1]()
        return len(polls) > 2 * len(steps)       # a guard: a follow that misses the end stops here
    out = io.StringIO()
    follow(run, None, None, poll_s=0, out=out, until=before_poll)
    assert out.getvalue() == "".join(f"critic/rank0  {line}\n" for line in lines)
    assert len(polls) == len(steps)          # it returned at the poll that found the run finished


@pytest.mark.slurm
def test_follow_ends_with_the_job_not_with_a_stopped_driver(slurm_cluster, tmp_path):
    """A driver that stopped (a deadline) is requeued while its job lives: following goes on. A job
    cancelled under a running driver (it never says it ended): following ends, its lines printed."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    job = sh("sbatch", "--parsable", "--hold", "--partition=cpu", "--output=/dev/null", "--wrap=true").strip()
    try:
        (run / "job.json").write_text(json.dumps({"job_id": job}))
        (run / "logs" / f"slurm-{job}.out").write_text("[hpcrl] stopping at step 3: deadline\n")
        status = RunStatus(run, total_steps=5)
        status.event("stop", step=3, reason="deadline")
        assert component_states(job) == {0: "PENDING"} and not run_ended(run)
        status.phase(4, "generate")          # the requeued driver, killed with its job below
    finally:
        sh("scancel", job)
    wait_until(lambda: component_states(job) == {0: "CANCELLED"}, 60, f"job {job} cancelled")
    polls, out = [], io.StringIO()
    follow(run, None, None, poll_s=0, out=out, until=lambda: polls.append(1) or len(polls) > 3)
    assert out.getvalue() == "driver  [hpcrl] stopping at step 3: deadline\n" and len(polls) == 1
