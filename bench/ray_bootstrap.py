"""Allocation start -> every Ray node joined: hpcrl's barrier vs Ray's documented sleep-based template.

Needs the local cluster (`slurm/cluster up`). For 1, 2 and 4 nodes (1 component; a100+h100;
a100x2+h100+cpu), in one run:
  hpcrl      the rendered hetjob script: parallel node start, barrier on Ray's node table
  hpcrl mpi  the same script with `bootstrap: mpi`: one `srun --mpi=pmix` step, rank 0 broadcasts
             the head's address, an MPI allgather is the barrier (needs .ci/install-mpi)
  in image   the hpcrl script with every component in slurm/image's Charliecloud image (each node's
             Ray and the barrier start through ch-run; needs `slurm/image build`)
  sleep      Ray's Slurm template on the same allocation shape: head, `sleep 10`, then each worker
             followed by `sleep 5`; the driver starts after the last sleep
  head-only  one bare `ray start --head` until a driver connects (outside Slurm), the reference
Times come from the scripts' own $EPOCHREALTIME, not from scheduling.

    python bench/ray_bootstrap.py [--repeat 1] [--image .images/hpcrl] [--json bench/ray_bootstrap.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.jobspec import parse_spec  # noqa: E402
from hpcrl.raycluster.node import kill_session  # noqa: E402
from hpcrl.raycluster.ports import choose_block  # noqa: E402
from hpcrl.slurm.render import render_hetjob  # noqa: E402

SHAPES = {  # nodes -> roles
    1: {"actor_rollout": {"partition": "a100", "cpus_per_task": 2, "mem": "2G"}},
    2: {"actor_rollout": {"partition": "a100", "cpus_per_task": 2, "mem": "2G"},
        "critic": {"partition": "h100", "cpus_per_task": 2, "mem": "2G"}},
    4: {"actor_rollout": {"partition": "a100", "nodes": 2, "cpus_per_task": 2, "mem": "2G"},
        "critic": {"partition": "h100", "cpus_per_task": 2, "mem": "2G"},
        "ref": {"partition": "cpu", "cpus_per_task": 2, "mem": "2G"}},
}
RAY = str(Path(sys.executable).with_name("ray"))
RUNS = ROOT / "runs"      # a mount point in slurm/image's image


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def run_script(script: str, run_dir: Path) -> str:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / "bench.sbatch"
    path.write_text(script)
    jid = sh("sbatch", "--parsable", "-o", str(run_dir / "out"), str(path)).strip()
    while sh("squeue", "-h", "-j", jid).strip():
        time.sleep(0.5)
    return (run_dir / "out").read_text()


def hpcrl_script(n: int, run_dir: Path, bootstrap: str = "poll", image: Path | None = None) -> str:
    box = {"container": {"runtime": "charliecloud", "image": str(image), "python": "/opt/venv/bin/python",
                         "mounts": [str(RUNS)]}} if image else {}
    spec = parse_spec({"name": f"bench{n}", "run_dir": str(run_dir), "roles": SHAPES[n], "bootstrap": bootstrap, **box})
    job = spec.to_hetjob(python=sys.executable)
    # mark allocation start right where the script begins to work
    return render_hetjob(job, payload='echo "BENCH_END $EPOCHREALTIME"').replace(
        'cd "$HPCRL_RUN_DIR"\n', 'cd "$HPCRL_RUN_DIR"\necho "BENCH_START $EPOCHREALTIME"\n', 1)


def sleep_script(n: int, run_dir: Path) -> str:
    """Ray's documented template (docs: 'Deploying on Slurm'), on our hetjob header and ports."""
    spec = parse_spec({"name": f"sleep{n}", "run_dir": str(run_dir), "roles": SHAPES[n]})
    job = spec.to_hetjob(python=sys.executable)
    header = render_hetjob(job).split("set -uo pipefail")[0]
    groups = [(g, c.nodes) for g, c in enumerate(job.components)]
    lines = [header, "export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0", 'echo "BENCH_START $EPOCHREALTIME"']
    # node names are only known inside the job: resolve them there, as the template does
    lines += ['nodes=()', 'groups=()']
    for g, _ in groups:
        var = "SLURM_JOB_NODELIST" if len(groups) == 1 else f"SLURM_JOB_NODELIST_HET_GROUP_{g}"
        lines.append(f'for h in $(scontrol show hostnames "${var}"); do nodes+=("$h"); groups+=({g}); done')
    lines.append('addr() { scontrol show node "$1" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2; }')
    head_ports = " ".join(choose_block("9999", 0, 4).ray_start_args(head=True))
    lines.append(f'head_ip=$(addr "${{nodes[0]}}"); port={choose_block("9999", 0, 4).gcs}')
    het = (lambda k: f"--het-group=${{groups[{k}]}} ") if len(groups) > 1 else (lambda k: "")
    lines.append(f'srun {het(0)}-w "${{nodes[0]}}" --overlap {RAY} start --head --block '
                 f'--node-ip-address="$head_ip" --include-dashboard=false --num-cpus=2 '
                 f'--object-store-memory=100000000 --temp-dir=/tmp/bench-sleep-$SLURM_JOB_ID-0 {head_ports} &')
    lines.append("sleep 10")
    for k in range(1, 4):
        ports = " ".join(choose_block("9999", k, 4).ray_start_args(head=False))
        lines.append(f'if [ {k} -lt ${{#nodes[@]}} ]; then srun {het(k)}-w "${{nodes[{k}]}}" '
                     f'--overlap {RAY} start --block --address="$head_ip:$port" --node-ip-address="$(addr '
                     f'"${{nodes[{k}]}}")" --num-cpus=2 --object-store-memory=100000000 '
                     f'--temp-dir=/tmp/bench-sleep-$SLURM_JOB_ID-{k} {ports} & sleep 5; fi')
    lines.append('echo "BENCH_END $EPOCHREALTIME"')
    lines.append(f'timeout 60 {sys.executable} -c "import ray; ray.init(address=\\"$head_ip:$port\\", '
                 f'_node_ip_address=\\"$head_ip\\"); print(\\"BENCH_ALIVE\\", len([n for n in ray.nodes() '
                 f'if n[\\"Alive\\"]]))"')
    lines.append("kill $(jobs -p) 2>/dev/null; wait")
    return "\n".join(lines) + "\n"


def head_only() -> float:
    with tempfile.TemporaryDirectory(prefix="bench-head-") as tmp:
        ports = choose_block("9998", 0, 1)
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        t0 = time.monotonic()
        p = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.30",
                              "--include-dashboard=false", "--num-cpus=2", "--object-store-memory=100000000",
                              f"--temp-dir={tmp}", *ports.ray_start_args(head=True)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        probe = (f"import ray\nwhile True:\n    try:\n        ray.init(address='127.0.0.30:{ports.gcs}', "
                 "_node_ip_address='127.0.0.30'); break\n    except Exception: pass")
        subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120)
        dt = time.monotonic() - t0
        kill_session(p.pid)
        p.wait()
        return dt


def span(out: str) -> float:
    t = dict(re.findall(r"^(BENCH_START|BENCH_END) ([\d.]+)$", out, re.M))
    return float(t["BENCH_END"]) - float(t["BENCH_START"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--image", type=Path, default=ROOT / ".images" / "hpcrl", help="slurm/image's image")
    ap.add_argument("--json", default=str(ROOT / "bench" / "ray_bootstrap.json"))
    args = ap.parse_args()
    rows = []
    RUNS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-ray-", dir=RUNS) as tmp:
        head = min(head_only() for _ in range(args.repeat))
        for n in SHAPES:
            h = min(span(run_script(hpcrl_script(n, Path(tmp) / f"h{n}-{r}"), Path(tmp) / f"h{n}-{r}"))
                    for r in range(args.repeat))
            m = min(span(run_script(hpcrl_script(n, Path(tmp) / f"m{n}-{r}", "mpi"), Path(tmp) / f"m{n}-{r}"))
                    for r in range(args.repeat))
            c = min(span(run_script(hpcrl_script(n, Path(tmp) / f"c{n}-{r}", image=args.image.resolve()),
                                    Path(tmp) / f"c{n}-{r}")) for r in range(args.repeat))
            outs = [run_script(sleep_script(n, Path(tmp) / f"s{n}-{r}"), Path(tmp) / f"s{n}-{r}")
                    for r in range(args.repeat)]
            s = min(span(o) for o in outs)
            alive = [int(m) for o in outs for m in re.findall(r"BENCH_ALIVE (\d+)", o)]
            rows.append({"nodes": n, "hpcrl_s": round(h, 2), "hpcrl_mpi_s": round(m, 2), "hpcrl_in_image_s": round(c, 2),
                         "in_image_over_host": round(c / h, 2), "sleep_template_s": round(s, 2),
                         "sleep_template_nodes_alive_at_driver_start": min(alive) if alive else None,
                         "head_only_s": round(head, 2), "hpcrl_over_head": round(h / head, 2)})
    print(f"{'nodes':>5}  {'hpcrl':>8}  {'hpcrl mpi':>9}  {'in image':>8}  {'sleep tmpl':>10}  {'alive@drv':>9}  {'1 head':>7}  {'hpcrl/head':>10}")
    for r in rows:
        print(f"{r['nodes']:>5}  {r['hpcrl_s']:>7.2f}s  {r['hpcrl_mpi_s']:>8.2f}s  {r['hpcrl_in_image_s']:>7.2f}s  {r['sleep_template_s']:>9.2f}s  "
              f"{str(r['sleep_template_nodes_alive_at_driver_start']):>9}  {r['head_only_s']:>6.2f}s  "
              f"{r['hpcrl_over_head']:>10.2f}")
    Path(args.json).write_text(json.dumps({"rows": rows, "measured_at": time.time()}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
