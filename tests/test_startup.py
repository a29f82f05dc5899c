"""Where a start's time goes: the `startup` events (hpcrl/observe/startup.py), by hand and from a real
local run's processes; `hpcrl status` and the report show them."""
import json

from hpcrl.controller.startup import process_started
from hpcrl.observe.startup import StartupClock, format_startup, slowest_phases, starts
from hpcrl.observe.status import RunStatus, read_events, read_status


def test_each_phase_takes_the_time_since_the_one_before_and_a_rank_since_its_process_started(tmp_path):
    status = RunStatus(tmp_path, total_steps=3)
    clock = StartupClock(status, 100.0, "the submission", [("queued", 101.5), ("ray", 104.0), ("driver", 106.0)])
    clock.roles({"critic": [{"started": 105.0, "phases": [("process", 108.0, 3.0), ("imports", 111.5, 3.5),
                                                          ("built", 112.0, 0.5)]},
                            {"started": 106.0, "phases": [("process", 107.0, 1.0), ("imports", 113.0, 6.0),
                                                          ("built", 113.25, 0.25)]}]})
    record = {"timing/step": 0.5}
    clock.logged({"val/score": 0.1})
    clock.logged(record)
    clock.logged({"timing/step": 0.4})          # the next step is no phase of the start
    own = [(e["phase"], e["seconds"], e["since_start"]) for e in read_events(tmp_path) if e["role"] is None]
    assert own[:3] == [("queued", 1.5, 1.5), ("ray", 2.5, 4.0), ("driver", 2.0, 6.0)]
    assert [p for p, _, _ in own] == ["queued", "ray", "driver", "roles", "validation", "first_step"]
    ranks = [(e["rank"], e["phase"], e["seconds"], e["since_start"]) for e in read_events(tmp_path) if e["role"]]
    assert ranks == [(0, "process", 3.0, 8.0), (0, "imports", 3.5, 11.5), (0, "built", 0.5, 12.0),
                     (1, "process", 1.0, 7.0), (1, "imports", 6.0, 13.0), (1, "built", 0.25, 13.25)]
    startup = read_status(tmp_path)["startup"]
    assert startup["slowest"]["imports"] == {"role": "critic", "rank": 1, "seconds": 6.0}
    assert startup["slowest"]["process"] == {"role": "critic", "rank": 0, "seconds": 3.0}
    assert record["timing/startup"] == startup["phases"]["first_step"]
    assert "queued 1.5, ray 4.0, driver 6.0" in format_startup(startup)
    assert "imports 6.0 s (critic rank 1)" in format_startup(startup)


def test_a_phase_seen_again_begins_the_next_start():
    ev = [{"event": "startup", "phase": p, "role": r, "rank": 0 if r else None, "seconds": s, "since_start": t}
          for p, r, s, t in [("queued", None, 2, 2), ("process", "actor", 4, 9), ("first_step", None, 9, 20),
                             ("requeued", None, 30, 30), ("process", "actor", 3, 35), ("first_step", None, 8, 44)]]
    got = starts([{"event": "start"}, *ev])
    assert got == [{"phases": {"queued": 2, "first_step": 20}, "slowest": {"process": ("actor", 0, 4)}},
                   {"phases": {"requeued": 30, "first_step": 44}, "slowest": {"process": ("actor", 0, 3)}}]


def test_a_phase_takes_the_time_since_the_mark_before_whoever_made_it():
    from hpcrl.controller import startup

    n = startup.count()
    startup.mark("process")
    startup.mark("built")
    timed = startup.timed(started=12.5)
    (p, p_end, p_took), (b, b_end, b_took) = timed[n:n + 2]
    assert (p, b) == ("process", "built") and b_took == b_end - p_end >= 0
    assert p_took == p_end - (timed[n - 1][1] if n else 12.5)


def test_a_process_knows_when_it_started():
    import subprocess
    import sys
    import time

    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        started = process_started(child.pid)
    finally:
        child.kill()
    assert before - 1.0 <= started <= time.time(), (before, started)


def test_a_rebuild_counts_only_what_its_ranks_did_since_it_began():
    """A standby process's start and imports happened before the rebuild; an idle process Ray started
    ahead counts from the rebuild's beginning."""
    standby = {"started": 10.0, "phases": [("process", 14.0, 4.0), ("imports", 20.0, 6.0), ("group", 100.4, 80.4),
                                           ("imports", 100.5, 0.1), ("model", 101.0, 0.5), ("built", 101.2, 0.2)]}
    fresh = {"started": 50.0, "phases": [("process", 103.0, 53.0), ("group", 103.5, 0.5), ("imports", 109.0, 5.5),
                                         ("model", 109.5, 0.5), ("built", 109.6, 0.1)]}
    assert slowest_phases([standby], 100.0) == {"group": 0.4, "imports": 0.1, "model": 0.5, "built": 0.2}
    assert slowest_phases([standby, fresh], 100.0) == {"group": 0.5, "imports": 5.5, "model": 0.5, "built": 0.2,
                                                       "process": 3.0}
