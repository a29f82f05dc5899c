"""Math problems with checkable answers, written as datasets in verl's Parquet format, from
packages on PyPI (no dataset hub):

    reasoning-gym   generators deterministic by seed: chain_sum, basic_arithmetic, gsm_symbolic
                    (GSM8K-derived), countdown, ... (pip install 'hpcrl[data]')
    MathQA          bigbench's elementary_math_qa task file: 7,688 word problems, 5,308 of them with
                    a numeric answer (its sdist is downloaded once, never installed: it pulls TensorFlow)

    hpcrl data reasoning-gym chain_sum OUT_DIR --train 2000 --test 300 --set min_terms=2 max_terms=2
    hpcrl data mathqa OUT_DIR --test 500

Each writes OUT_DIR/train.parquet and OUT_DIR/test.parquet. No problem of the test split is in the
train split. A row is verl's: data_source, prompt (one user message), ability, reward_model
({style: rule, ground_truth}), extra_info ({split, index}); hpcrl/ppo/verifiers.py scores it.
"""
from __future__ import annotations

import json
import random
import tarfile
import tempfile
from pathlib import Path

from hpcrl.files import cache_dir
from hpcrl.pip_download import pip_download
from hpcrl.ppo.data import write_rows

MATHQA_SDIST = "bigbench==1.0.0"
MATHQA_FILE = "bigbench/benchmark_tasks/elementary_math_qa/question_only/task.json"


def row(data_source: str, question: str, answer, split: str, index: int) -> dict:
    return {"data_source": data_source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index}}


def write_splits(out_dir: str | Path, train: list[dict], test: list[dict], n_train: int) -> tuple[Path, Path]:
    """test as it is; train without the questions test holds, cut to n_train."""
    held = {r["prompt"][0]["content"] for r in test}
    kept = [r for r in train if r["prompt"][0]["content"] not in held][:n_train]
    for i, r in enumerate(kept):
        r["extra_info"]["index"] = i
    out = Path(out_dir)
    return write_rows(kept, out / "train.parquet"), write_rows(test, out / "test.parquet")


def reasoning_gym_problems(task: str, n: int, seed: int, split: str, **settings) -> list[dict]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise RuntimeError(f"reasoning-gym does not import ({e}): pip install 'hpcrl[data]'") from None
    problems = reasoning_gym.create_dataset(task, size=n, seed=seed, **settings)
    return [row(f"reasoning_gym/{task}", p["question"], p["answer"], split, i) for i, p in enumerate(problems)]


def write_reasoning_gym(out_dir: str | Path, task: str, n_train: int, n_test: int, seed: int = 42,
                        **settings) -> tuple[Path, Path]:
    """The test split from seed + 1, the train split from seed (twice the problems, before the
    test's are taken out)."""
    test = reasoning_gym_problems(task, n_test, seed + 1, "test", **settings)
    train = reasoning_gym_problems(task, 2 * n_train, seed, "train", **settings)
    return write_splits(out_dir, train, test, n_train)


def mathqa_problems(task_json: dict) -> list[tuple[str, str]]:
    """(question, answer) of every problem whose correct option (target score 1) is a plain number."""
    out = []
    for example in task_json["examples"]:
        right = [option for option, score in example["target_scores"].items() if score == 1]
        if len(right) == 1 and _is_number(right[0]):
            out.append((example["input"].strip(), right[0].replace(",", "").strip()))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
        return True
    except ValueError:
        return False


def fetch_mathqa(cache: str | Path | None = None) -> Path:
    """bigbench's MathQA task file, downloaded once (the 358 MB sdist; only the one file is kept)."""
    path = Path(cache) if cache else cache_dir() / "mathqa-task.json"
    if path.exists():
        return path
    with tempfile.TemporaryDirectory(prefix="hpcrl-bigbench-") as tmp:
        pip_download(MATHQA_SDIST, tmp, "--no-binary", ":all:",
                     instead=f"fetch {MATHQA_FILE} from {MATHQA_SDIST}'s sdist elsewhere and pass it as the cache")
        sdist = next(Path(tmp).glob("bigbench-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(MATHQA_FILE))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tar.extractfile(member).read())
    return path


def write_mathqa(out_dir: str | Path, n_test: int, seed: int = 42, task_file: str | Path | None = None) -> tuple[Path, Path]:
    """MathQA's numeric problems, shuffled by seed: n_test for test, the rest for train."""
    problems = mathqa_problems(json.loads(Path(task_file or fetch_mathqa()).read_text()))
    random.Random(seed).shuffle(problems)
    test = [row("mathqa", q, a, "test", i) for i, (q, a) in enumerate(problems[:n_test])]
    train = [row("mathqa", q, a, "train", i) for i, (q, a) in enumerate(problems[n_test:])]
    return write_splits(out_dir, train, test, len(train))
