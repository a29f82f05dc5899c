"""RUN_DIR/metrics.jsonl: one JSON object per training step, appended and flushed as it happens;
optionally the same scalars as TensorBoard events (RUN_DIR/tensorboard/) and as a Weights & Biases
run (RUN_DIR/wandb/; mode offline works without a network, `wandb sync` uploads it later).

A requeued job continues the same W&B run (its id is kept in RUN_DIR/wandb/run-id). W&B keeps the
first value it was given for a step, so steps redone after a resume keep the values logged before
the preemption there; metrics.jsonl is truncated to the checkpoint and holds the redone ones.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from hpcrl.files import writing
from hpcrl.run_dir import RunDir


class MetricsLog:
    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: dict | None = None):
        paths = RunDir(run_dir)
        self.path = paths.metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.board = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(f"metrics.tensorboard: true, but TensorBoard does not import ({e}); "
                                   "pip install 'hpcrl[tensorboard]', or set it false") from e
            self.board = SummaryWriter(str(paths.tensorboard))
        if wandb:
            self.wandb = _wandb_run(paths, wandb)

    def write(self, record: dict) -> None:
        with writing(self.path), open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        scalars = {k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        if self.board is not None:
            for key, value in scalars.items():
                self.board.add_scalar(key, value, record["step"], walltime=record.get("time"))
            self.board.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

    def size(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def truncate(self, size: int) -> None:
        """Drop what was written after a checkpoint, so a resumed run appends where it stands."""
        if self.path.exists() and self.path.stat().st_size > size:
            with open(self.path, "r+") as f:
                f.truncate(size)


def _wandb_run(paths: RunDir, settings: dict):
    """The run's W&B run, started or resumed (one id per run directory)."""
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(f"metrics.wandb is set, but wandb does not import ({e}); pip install 'hpcrl[wandb]', "
                           "or remove metrics.wandb") from e
    paths.wandb.mkdir(parents=True, exist_ok=True)
    id_file = paths.wandb / "run-id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:16])
    return wandb.init(project=settings["project"], entity=settings.get("entity"), name=settings.get("name"),
                      mode=settings.get("mode", "offline"), dir=str(paths.root), id=id_file.read_text().strip(),
                      resume="allow", reinit="finish_previous")


def read_metrics(path: Path) -> list[dict]:

    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def score_over_training_time(records: list[dict], key: str = "val/score") -> list[tuple[float, float]]:
    """(seconds of training, score) at every record with `key`: each step's time less its
    validation's (the held-out measurement is off the clock), summed up to that record."""
    points, clock = [], 0.0
    for r in records:
        clock += r.get("timing/step", 0.0) - r.get("timing/validate", 0.0)
        if r.get(key) is not None:
            points.append((round(clock, 1), r[key]))
    return points


def reward_table(records: list[dict], first: int = 3, last: int = 3) -> str:
    """The first and last steps' reward, KL and response length (and held-out score, where there is
    one), as a small text table; "-" where a driver of your own did not record a column."""
    val = any("val/score" in r for r in records)
    records = [r for r in records if "reward/mean" in r]     # step 0 holds only a validation
    if not records:
        return "no steps recorded"
    rows = records if len(records) <= first + last else records[:first] + [None] + records[-last:]
    lines = [f"{'step':>6} {'reward/mean':>12} {'reward/max':>11} {'kl':>9} {'resp_len':>9} {'tokens/s':>9}"
             + (f" {'val/score':>10}" if val else "")]
    for r in rows:
        if r is None:
            lines.append(f"{'...':>6}")
            continue
        cells = [(r.get(k), width, form) for k, width, form in (
            ("reward/mean", 12, ".3f"), ("reward/max", 11, ".3f"), ("kl", 9, ".4f"), ("response_length/mean", 9, ".2f"),
            ("throughput/tokens_per_s", 9, ".0f"), *((("val/score", 10, ".3f"),) if "val/score" in r else ()))]
        lines.append(f"{r['step']:>6}" + "".join(f" {'-' if v is None else format(v, form):>{width}}"
                                                  for v, width, form in cells))
    return "\n".join(lines)
