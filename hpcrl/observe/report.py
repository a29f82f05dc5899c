"""`hpcrl report RUN_DIR`: RUN_DIR/report/ with one PNG per view of the run and an index.html;
`hpcrl report SWEEP_DIR`: the sweep's runs' curves on one page, a line per run.

Reads only files: metrics.jsonl (one record per step, continuous across requeues since a resumed
run truncates to its checkpoint), events.jsonl (starts, checkpoints), spec.yaml, allocation.json,
and the roles' calls (logs/<role>/rank0.calls.jsonl) for the timeline: one lane per role on a time
axis over the last steps, where a pipelined run's overlap shows; and for each role's busy share of
every step, over the whole run (how well each partition is used: an asynchronous run's aim). Works on a running, finished or
requeued run. Restarts are dashed vertical lines on every curve, and a role's resizes (hpcrl scale)
dotted ones labelled with the role and its new world size.
"""
from __future__ import annotations

import html
import json
import time
from pathlib import Path

from hpcrl.observe.logs import read_calls
from hpcrl.observe.metrics import read_metrics, score_over_training_time
from hpcrl.observe.startup import ROLE_PHASES, starts
from hpcrl.observe.status import read_events, read_status
from hpcrl.run_dir import RunDir, SweepDir

# (file, title, [(metric key, label)], y label); a key ending in * stands for every key it starts
CURVES = [
    ("reward.png", "Reward", [("reward/mean", "mean"), ("reward/max", "max"), ("score/*", "")], "score"),
    ("validation.png", "Held-out score", [("val/score", "all"), ("val/score/*", "")], "score"),
    ("kl.png", "KL to the reference", [("kl", "KL"), ("kl_coef", "KL coefficient β")], "KL"),
    ("losses.png", "Losses", [("actor/pg_loss", "policy loss"), ("critic/vf_loss", "value loss"),
                              ("vf_loss/*", "")], "loss"),
    ("clipfrac.png", "PPO clip fraction", [("actor/clipfrac", "clip fraction")], "fraction of tokens"),
    ("entropy.png", "Policy entropy", [("actor/entropy", "entropy")], "nats per token"),
    ("response_length.png", "Response length", [("response_length/mean", "mean"), ("response_length/max", "max"),
                                                 ("val/response_length/mean", "held-out mean")], "tokens"),
    ("throughput.png", "Throughput", [("throughput/tokens_per_s", "tokens/s")], "tokens / s"),
    ("episodes.png", "Multi-turn episodes", [("env/turns", "turns"), ("env/tool_calls", "tool calls"),
                                             ("env/tool_errors", "tool errors"), ("env/failed", "failed")],
     "per episode"),
    ("step_time.png", "Time per step", [("timing/step", "step"), ("timing/generate", "waiting for its batch"),
                                        ("timing/environment", "of which the environment"),
                                        ("timing/rollout_idle", "rollout idle (async)")], "seconds"),
    ("buffer.png", "Asynchronous rollout's buffer", [("buffer/depth", "generated batches when a step took one")],
     "batches"),
]
TIMELINE_STEPS = 6    # the timeline shows the last few steps: a whole run's calls would merge into one bar


def restarts(events: list[dict]) -> list[int]:
    """The step each later start of the job resumed from (the first start is not a restart)."""
    starts = [e for e in events if e["event"] == "start"]
    return [e["step"] for e in starts[1:]]


def resizes(events: list[dict]) -> list[tuple[int, str]]:
    """(the step after which a role was resized, "role from→to")."""
    return [(e["step"], f"{e['role']} {e['from']}→{e['to']}") for e in events if e["event"] == "resize"]


TWIN = {"kl_coef"}   # plotted on a right-hand axis of its own scale


def expand(series, records) -> list[tuple[str, str]]:
    """The series with each `prefix*` replaced by every key of the records that starts with prefix."""
    out = []
    for key, label in series:
        if key.endswith("*"):
            prefix = key[:-1]
            out += [(k, k.removeprefix(prefix)) for k in sorted({k for r in records for k in r if k.startswith(prefix)})]
        else:
            out.append((key, label))
    return out


def _plot_curves(ax, records, series, restart_steps, resized=()):
    lines = []
    for i, (key, label) in enumerate(expand(series, records)):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            where = ax.twinx() if key in TWIN else ax
            sparse = len(points) < len(records) / 2      # validation: a point every val_every steps
            xs, ys = zip(*points)
            lines += where.plot(xs, ys, label=label, linewidth=1.2, color=f"C{i}", marker="o" if sparse else None,
                                markersize=3)
            if key in TWIN:
                where.set_ylabel(label)
    if len(lines) > 1:
        ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
    for s in restart_steps:
        ax.axvline(s + 0.5, color="0.4", linestyle="--", linewidth=0.9)
    for s, what in resized:
        ax.axvline(s + 0.5, color="C3", linestyle=":", linewidth=1.0)
        ax.annotate(what, (s + 0.5, 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="C3", rotation=90,
                    ha="right", va="top")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def timeline_spans(calls: dict[str, list[dict]], records: list[dict], steps: int = TIMELINE_STEPS):
    """(t0, t1, {role: [(start, end, method)]}, step ends) for the last `steps` steps: every call
    that ran in that window, clipped to it; times in seconds from t0."""
    ends = [r["time"] for r in records if "time" in r and r.get("step")]
    if not ends or not calls:
        return None
    t1 = ends[-1]
    t0 = ends[-steps - 1] if len(ends) > steps else min(c["start"] for cs in calls.values() for c in cs)
    lanes = {role: [(max(c["start"], t0) - t0, min(c["end"], t1) - t0, c["method"]) for c in cs
                    if c["end"] > t0 and c["start"] < t1] for role, cs in calls.items()}
    return t0, t1, {r: spans for r, spans in lanes.items() if spans}, [e - t0 for e in ends if t0 < e <= t1]


def utilisation(calls: dict[str, list[dict]], records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per role, (step, the share of that step's time its rank 0 spent in calls): a step's time runs
    from the end of the step before (the first: from the first call) to its own record, so the first
    step after a restart counts the time the run was down."""
    ends = [(r["step"], r["time"]) for r in records if "time" in r and r.get("step")]
    if not ends or not calls:
        return {}
    begin = min(c["start"] for cs in calls.values() for c in cs)
    spans = [(step, t0, t1) for (step, t1), t0 in zip(ends, [begin] + [t for _, t in ends[:-1]]) if t1 > t0]
    return {role: [(step, min(1.0, sum(max(0.0, min(c["end"], t1) - max(c["start"], t0)) for c in cs) / (t1 - t0)))
                   for step, t0, t1 in spans] for role, cs in calls.items()}


def timeline_chart(ax, spans) -> None:
    """One lane per role; a bar per call, coloured by method; thin lines where steps ended."""
    from matplotlib.patches import Patch

    t0, t1, lanes, step_ends = spans
    methods = list(dict.fromkeys(m for cs in lanes.values() for _, _, m in cs))
    colour = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for y, (role, cs) in enumerate(reversed(list(lanes.items()))):
        for start, end, method in cs:
            ax.broken_barh([(start, max(end - start, (t1 - t0) * 0.002))], (y - 0.35, 0.7), color=colour[method])
    ax.set_yticks(range(len(lanes)), list(reversed(list(lanes))))
    for x in step_ends:
        ax.axvline(x, color="0.6", linewidth=0.6)
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel("seconds (grey lines: a step ended)")
    ax.legend(handles=[Patch(color=colour[m], label=m) for m in methods],
              fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def write_report(run_dir: Path) -> Path:
    """Write RUN_DIR/report/{*.png,index.html}; returns the index path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    paths = RunDir(run_dir)
    records = read_metrics(paths.metrics)
    if not records:
        raise ValueError(f"{paths.metrics}: no steps recorded yet; nothing to report")
    events = read_events(run_dir)
    restart_steps = restarts(events)
    out = paths.report
    out.mkdir(exist_ok=True)
    figures = []
    for name, title, series, ylabel in CURVES:
        if not any(r.get(key) is not None for r in records for key, _ in expand(series, records)):
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6))
        _plot_curves(ax, records, series, restart_steps, resizes(events))
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        figures.append((name, title))
    timed = score_over_training_time(records)
    if timed:          # what a learning bench compares: the held-out score against seconds of training
        fig, ax = plt.subplots(figsize=(7, 3.6))
        ax.plot(*zip(*timed), marker="o", markersize=3, linewidth=1.2)
        ax.set(title="Held-out score against training time", xlabel="seconds of training (validation off the clock)",
               ylabel="score")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "validation_time.png", dpi=110)
        plt.close(fig)
        figures.append(("validation_time.png", "Held-out score against training time"))
    calls = read_calls(run_dir)
    if busy := utilisation(calls, records):
        partition = {role: r.get("partition") for role, r in _spec(run_dir).get("roles", {}).items()}
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for role, shares in busy.items():
            ax.plot(*zip(*shares), linewidth=1.2, label=role + (f" ({partition[role]})" if partition.get(role) else ""))
        ax.set(title="Busy share of each role's rank 0, per step", xlabel="step", ylabel="fraction of the step", ylim=(0, 1.05))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "utilisation.png", dpi=110)
        plt.close(fig)
        figures.append(("utilisation.png", "Busy share of each role per step"))
    spans = timeline_spans(calls, records)
    if spans:
        fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(spans[2])))
        timeline_chart(ax, spans)
        ax.set_title(f"What each role did during the last {len(spans[3])} steps (rank 0)")
        fig.tight_layout()
        fig.savefig(out / "timeline.png", dpi=110)
        plt.close(fig)
        figures.insert(0, ("timeline.png", "Timeline of the roles' calls"))
    index = out / "index.html"
    index.write_text(_html(run_dir, records, events, restart_steps, figures))
    return index


SWEEP_CURVES = [("reward.png", "Reward (mean)", "reward/mean"), ("validation.png", "Held-out score", "val/score"),
                ("kl.png", "KL to the reference", "kl"), ("response_length.png", "Response length", "response_length/mean")]


def write_sweep_report(root: Path) -> Path:
    """Write SWEEP_DIR/report/{*.png,index.html}: every run of the sweep on each curve, and the
    table of `hpcrl sweep status`; returns the index path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpcrl.observe.runs import format_runs, run_row

    where = SweepDir(root)
    sweep = where.read()
    runs = {r["name"]: read_metrics(RunDir(where.run(r["name"])).metrics) for r in sweep["runs"]}
    if not any(runs.values()):
        raise ValueError(f"{where.root}: no run of the sweep has recorded a step yet; nothing to report")
    where.report.mkdir(exist_ok=True)
    figures = []
    for name, title, key in SWEEP_CURVES:
        if not any(r.get(key) is not None for records in runs.values() for r in records):
            continue
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for i, (run, records) in enumerate(runs.items()):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), label=run, linewidth=1.2, color=f"C{i % 10}", marker="o" if len(points) < 12 else None,
                        markersize=3)
        ax.set(title=title, xlabel="step", ylabel=key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(where.report / name, dpi=110)
        plt.close(fig)
        figures.append((name, title))
    e = html.escape
    table = format_runs([run_row(where.run(r["name"]), where.root) for r in sweep["runs"]])
    axes = "  ".join(f"{p} = {', '.join(vs)}" for p, vs in sweep["axes"].items())
    imgs = "".join(f'<figure><img src="{e(n)}" alt="{e(t)}"><figcaption>{e(t)}</figcaption></figure>' for n, t in figures)
    index = where.report / "index.html"
    index.write_text(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hpcrl sweep: {e(where.root.name)}</title>
<style>body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }} img {{ max-width: 100%; }}
figure {{ display: inline-block; margin: 0.5em; }} figcaption {{ font-size: 0.85em; color: #555; }}</style></head><body>
<h1>Sweep {e(where.root.name)}</h1>
<p>{e(sweep['spec'])}: {e(axes)}; {len(sweep['runs'])} runs, written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>
<pre>{e(table)}</pre>
{imgs}
</body></html>
""")
    return index


def _trend(name: str, records: list[dict], key: str) -> list[tuple[str, str]]:
    """("name", "first at step a → last at step b"), or nothing where no record has the key."""
    if not records:
        return []
    first, last = records[0], records[-1]
    return [(name, f"{first[key]:.3f} at step {first['step']} → {last[key]:.3f} at step {last['step']}")]


def _spec(run_dir) -> dict:
    """The run's spec.yaml, {} where there is none."""
    import yaml

    path = RunDir(run_dir).spec
    return yaml.safe_load(path.read_text()) if path.exists() else {}


def _html(run_dir, records, events, restart_steps, figures) -> str:
    spec, alloc_path = _spec(run_dir), RunDir(run_dir).allocation
    alloc = json.loads(alloc_path.read_text()) if alloc_path.exists() else {}
    status = read_status(run_dir) or {}
    nodes = {m: [n["name"] for n in c["nodes"]] for c in alloc.get("components", []) for m in c["members"]}
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(role)}</td><td>{e(r.get('partition') or 'with ' + r.get('same_nodes_as', '?'))}</td>"
        f"<td>{r.get('nodes', 1)}</td><td>{e(str(r.get('gpus_per_node', 0)))}{' × ' + e(r['gpu_type']) if r.get('gpu_type') else ''}</td>"
        f"<td>{r.get('cpus_per_task', '')}</td><td>{e(str(r.get('mem', '')))}</td><td>{e(str(r.get('time', '')))}</td>"
        f"<td>{e(' '.join(nodes.get(role, [])) or '-')}</td></tr>"
        for role, r in spec.get("roles", {}).items())
    last = records[-1]
    ckpts = [ev for ev in events if ev["event"] == "checkpoint"]
    facts = [("run directory", str(run_dir.resolve())), ("job", str(alloc.get("job_id", "-"))),
             ("state", f"{status.get('state', '?')}, step {last['step']} of {status.get('total_steps', '?')}"),
             ("restarts", f"{len(restart_steps)}" + (f" (resumed at steps {', '.join(map(str, restart_steps))})" if restart_steps else "")),
             ("checkpoints", f"{len(ckpts)}" + (f", last at step {ckpts[-1]['step']}" if ckpts else "")),
             *([("resizes (hpcrl scale)", ", ".join(f"{what} after step {s}" for s, what in resizes(events)))]
               if resizes(events) else []),
             *_trend("reward", [r for r in records if "reward/mean" in r], "reward/mean"),
             *_trend("held-out score", [r for r in records if "val/score" in r], "val/score"),
             ("written", time.strftime("%Y-%m-%d %H:%M:%S"))]
    train = "".join(f"<tr><td>{e(str(k))}</td><td>{e(json.dumps(v))}</td></tr>" for k, v in spec.get("train", {}).items())
    started = starts(events)
    phases = list(dict.fromkeys(p for s in started for p in s["phases"]))
    role_phases = [p for p in ROLE_PHASES if any(p in s["slowest"] for s in started)]
    start_rows = "".join(
        f"<tr><td>{k + 1}</td>" + "".join(f"<td>{s['phases'][p]:.1f}</td>" if p in s["phases"] else "<td></td>" for p in phases)
        + "".join(f"<td>{s['slowest'][p][2]:.1f} ({e(s['slowest'][p][0])} {s['slowest'][p][1]})</td>"
                  if p in s["slowest"] else "<td></td>" for p in role_phases) + "</tr>"
        for k, s in enumerate(started))
    start_head = "".join(f"<th>{e(p)}</th>" for p in phases) + "".join(f"<th>{e(p)}, slowest rank</th>" for p in role_phases)
    imgs = "".join(f'<figure><img src="{e(name)}" alt="{e(title)}"><figcaption>{e(title)}</figcaption></figure>'
                   for name, title in figures)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>hpcrl report: {e(spec.get('name', run_dir.name))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
td, th {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; font-size: 0.9em; }}
figure {{ display: inline-block; margin: 0.5em; }} figcaption {{ font-size: 0.85em; color: #555; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>{e(spec.get('name', run_dir.name))}</h1>
<table>{''.join(f'<tr><th>{e(k)}</th><td>{e(v)}</td></tr>' for k, v in facts)}</table>
<h2>Roles and allocation</h2>
<table><tr><th>role</th><th>partition</th><th>nodes</th><th>GPUs/node</th><th>CPUs</th><th>mem</th><th>time</th><th>allocated nodes</th></tr>{rows}</table>
<h2>Starts</h2>
<p>Seconds from the beginning of each start (the submission; after a requeue, the end of the start before) to the end
of each phase, then how long the slowest rank took for each phase of its own (hpcrl/observe/startup.py).</p>
<table><tr><th>start</th>{start_head}</tr>{start_rows}</table>
<h2>Curves</h2>
{imgs}
<h2>Training settings</h2>
<table>{train}</table>
</body></html>
"""
