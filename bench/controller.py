"""Controller costs on a local Ray, in one run:

  rebuild     SIGKILL one rank of a torch-importing role -> the retried call has returned, for a
              role of 1 and of 2 ranks, with and without a standby process per rank
  transfer    a 64x512-token Batch (ids, mask, log-probs, values: 0.6 MiB) made by group A and
              consumed by group B (future passed rank to rank), vs. the same two functions called
              locally in the driver, vs. fetching into the driver and sending on

    python bench/controller.py [--repeat 5] [--json bench/controller.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register  # noqa: E402
from hpcrl.controller.batch import Batch  # noqa: E402

B, T = 64, 512


def make_batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch({"input_ids": torch.randint(0, 32000, (B, T), generator=g), "attention_mask": torch.ones(B, T),
                  "log_probs": torch.randn(B, T, generator=g), "values": torch.randn(B, T, generator=g)})


def consume(batch: Batch) -> float:
    return float(batch["log_probs"].sum() + batch["values"].sum())


class Bench(Worker):
    def __init__(self):
        self.model = torch.nn.Linear(8, 8)   # the role really imports and uses torch

    @register(Dispatch.ONE_TO_ALL)
    def ping(self):
        return self.rank

    @register(Dispatch.RANK_ZERO)
    def produce(self, seed):
        return make_batch(seed)

    @register(Dispatch.RANK_ZERO)
    def consume(self, batch):
        return consume(batch)


def median_ms(xs):
    return round(1000 * statistics.median(xs), 2)


def bench_rebuild(ranks: int, standby: bool, repeat: int) -> list[float]:
    wg = WorkerGroup(ResourcePool.for_role("a", processes_per_node=ranks), Bench, standby=standby, restart_limit=repeat)
    times = []
    try:
        for _ in range(repeat):
            wg.ping()
            time.sleep(4 if standby else 0.5)   # a fresh standby has finished importing torch
            os.kill(wg.pids()[-1], signal.SIGKILL)
            t0 = time.perf_counter()
            wg.ping()
            times.append(time.perf_counter() - t0)
    finally:
        wg.shutdown()
    return times


def bench_transfer(repeat: int) -> dict:
    a = WorkerGroup(ResourcePool.for_role("a"), Bench)
    b = WorkerGroup(ResourcePool.for_role("b"), Bench)
    local, groups, via_driver = [], [], []
    try:
        for i in range(repeat + 1):   # the first round warms up
            t0 = time.perf_counter()
            consume(make_batch(i))
            t1 = time.perf_counter()
            b.consume(a.produce.future(i))
            t2 = time.perf_counter()
            b.consume(a.produce(i))
            t3 = time.perf_counter()
            if i:
                local.append(t1 - t0), groups.append(t2 - t1), via_driver.append(t3 - t2)
    finally:
        a.shutdown(), b.shutdown()
    return {"local_ms": median_ms(local), "group_to_group_ms": median_ms(groups), "via_driver_ms": median_ms(via_driver),
            "overhead_ms": round(median_ms(groups) - median_ms(local), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "controller.json")
    args = ap.parse_args()

    import ray

    from hpcrl.raycluster.session import start_local

    start_local(["a", "b"], run_dir=Path(tempfile.mkdtemp(prefix="hpcrl-bench-")), num_cpus=4)
    try:
        rebuild = {f"{n} rank{'s' if n > 1 else ''}, {'standby' if s else 'fresh process'}":
                   median_ms(bench_rebuild(n, s, args.repeat)) / 1000 for n in (1, 2) for s in (False, True)}
        transfer = bench_transfer(args.repeat * 4)
    finally:
        ray.shutdown()
    print(f"\nrebuild of a killed torch role (kill -> retried call returned), median of {args.repeat}")
    print(f"{'layout':<28}{'seconds':>10}")
    for k, v in rebuild.items():
        print(f"{k:<28}{v:>10.2f}")
    print(f"\n{B}x{T}-token Batch, median of {args.repeat * 4}")
    for k, v in transfer.items():
        print(f"{k:<28}{v:>10.2f}")
    result = {"cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__,
              "rebuild_s": rebuild, "transfer": transfer}
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten {args.json}")


if __name__ == "__main__":
    main()
