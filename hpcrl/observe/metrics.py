"""RUN_DIR/metrics.jsonl: one JSON object per training step, appended and flushed as it happens;
optionally the same scalars as TensorBoard events in RUN_DIR/tensorboard/."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hpcrl.run_dir import RunDir


class MetricsLog:
    def __init__(self, run_dir: Path, tensorboard: bool = False):
        paths = RunDir(run_dir)
        self.path = paths.metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.board = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(f"metrics.tensorboard: true, but TensorBoard does not import ({e}); "
                                   "pip install tensorboard, or set it false") from e
            self.board = SummaryWriter(str(paths.tensorboard))

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.board is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self.board.add_scalar(key, value, record["step"], walltime=record.get("time"))
            self.board.flush()

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def truncate(self, size: int) -> None:
        """Drop what was written after a checkpoint, so a resumed run appends where it stands."""
        if self.path.exists() and self.path.stat().st_size > size:
            with open(self.path, "r+") as f:
                f.truncate(size)


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reward_table(records: list[dict], first: int = 3, last: int = 3) -> str:
    """The first and last steps' reward, KL and response length, as a small text table."""
    if not records:
        return "no steps recorded"
    rows = records if len(records) <= first + last else records[:first] + [None] + records[-last:]
    lines = [f"{'step':>6} {'reward/mean':>12} {'reward/max':>11} {'kl':>9} {'resp_len':>9} {'tokens/s':>9}"]
    for r in rows:
        if r is None:
            lines.append(f"{'...':>6}")
            continue
        lines.append(f"{r['step']:>6} {r['reward/mean']:>12.3f} {r['reward/max']:>11.3f} {r.get('kl', 0.0):>9.4f} "
                     f"{r['response_length/mean']:>9.2f} {r['throughput/tokens_per_s']:>9.0f}")
    return "\n".join(lines)
