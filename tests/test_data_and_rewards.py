"""Datasets (JSONL, verl's Parquet), the built-in verifiable scorers, micro-batches by token
budget, validation and the metrics trackers, on real files, real tokenizers and real models."""
import json
import re
import struct

import numpy as np
import pytest
import torch
from conftest import wait_until

from hpcrl.controller.batch import Batch
from hpcrl.models import CharTokenizer
from hpcrl.ppo import verifiers
from hpcrl.ppo.data import PromptDataset, read_rows, write_rows
from hpcrl.ppo.tasks import copy_digits


def verl_rows():
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them, and one MATH-style row."""
    question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " \
               "How many clips did Natalia sell altogether in April and May? Let's think step by step and output " \
               "the final answer after \"####\"."
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"split": "train", "index": 0, "answer": "Natalia sold 48/2 = 24 clips in May. #### 72",
                            "question": question}},
            {"data_source": "DigitalLearningGmbH/MATH-lighteval", "prompt": [{"role": "user", "content": "1/2 = ?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
             "extra_info": {"split": "train", "index": 1, "answer": "", "question": "1/2 = ?"}}]


def test_gsm8k_scorer_reads_the_last_answer_line():
    assert verifiers.gsm8k("48/2 = 24 in May, so 48 + 24 = 72.\n#### 72", "72") == 1.0
    assert verifiers.gsm8k("#### 1,234", "1234") == 1.0 and verifiers.gsm8k("#### $72", "72") == 1.0
    assert verifiers.gsm8k("#### 70\nno wait\n#### 72", "72") == 1.0      # the last answer line counts
    assert verifiers.gsm8k("The answer is 72.", "72") == 0.0              # no answer line: GSM8K's format asked for one
    assert verifiers.gsm8k("#### 71", "72") == 0.0


def test_last_number_scorer_agrees_with_reasoning_gyms_own_check():
    import reasoning_gym

    data = reasoning_gym.create_dataset("chain_sum", size=40, seed=7, min_terms=2, max_terms=2, min_digits=1,
                                        max_digits=2)
    for entry in data:
        truth = entry["answer"]
        for answer in (truth, str(int(truth) + 1), str(-int(truth))):
            for response in (answer, f"The final answer is {answer}.", f"{truth} + 0 = ...\nSo: {answer}"):
                # reasoning-gym gives 0.5 for a sign error; a verifiable reward is right or wrong
                assert verifiers.last_number(response, truth) == float(data.score_answer(answer, entry) == 1.0), response


def test_math_scorer_uses_math_verify():
    assert verifiers.math("so the result is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert verifiers.math("The answer is $1,234$.", "1234") == 1.0
    assert verifiers.math("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}") == 0.0


def test_scorer_is_chosen_by_data_source_and_an_unknown_one_is_named():
    assert verifiers.by_data_source("q", "#### 72", data_source="openai/gsm8k", ground_truth="72") == 1.0
    assert verifiers.by_data_source("q", "it is 71", data_source="reasoning_gym/chain_sum", ground_truth="71") == 1.0
    assert verifiers.by_data_source("q", "\\boxed{0.5}", data_source="HuggingFaceH4/MATH-500", ground_truth="1/2") == 1.0
    with pytest.raises(ValueError, match=r"no built-in scorer for data_source 'my/source' \(known: openai/gsm8k"):
        verifiers.by_data_source("q", "1", data_source="my/source", ground_truth="1")



@pytest.mark.parametrize("held_out,batch_size,n_samples,samples", [(7, 2, 2, 1), (300, 16, 8, 1), (5, 4, 1, 2), (3, 8, 8, 1)])
def test_validation_scores_every_held_out_prompt_once_in_equal_pieces(tmp_path, held_out, batch_size, n_samples, samples):
    """The held-out prompts go to the engine in pieces of one size (the last filled with repeats),
    at most a training step's answers each, all of them at once; every prompt's answers are scored once
    they are collected, as a plain mean over the prompts (numpy) says. The engine and scorer answer from
    the prompt's text alone."""
    from types import SimpleNamespace

    from hpcrl.ppo.config import TrainConfig
    from hpcrl.ppo.validation import validate

    tok = CharTokenizer(copy_digits.ALPHABET)
    numbers = [int(x) for x in np.random.default_rng(held_out).integers(1, 10 ** 4, held_out)]
    data = PromptDataset(write_rows([{"prompt": f"{n}="} for n in numbers], tmp_path / "v.jsonl"), tok, batch_size, seed=0)
    cfg = TrainConfig.parse({"data": {"batch_size": batch_size}, "rollout": {"n_samples": n_samples},
                             "optim": {"mini_batch_size": batch_size * n_samples, "micro_batch_size": batch_size * n_samples},
                             "validation": {"dataset": str(tmp_path / "v.jsonl"), "samples": samples}})
    sizes = []

    def score_of(prompt: str) -> float:
        return int(prompt.rstrip("=")) % 7 / 7

    def generate(prompts: Batch):
        sizes.append(len(prompts))
        rows = len(prompts)
        out = Batch({"response_mask": torch.ones(rows, 3), "has_eos": torch.tensor([score_of(p) < 0.5 for p in prompts["prompt"]])},
                    {"prompt": prompts["prompt"]})
        return SimpleNamespace(result=lambda: out)

    scored = []

    def score(gen):
        scored.append(gen)
        return SimpleNamespace(result=lambda: Batch({"scores": torch.tensor([score_of(p) for p in gen.result()["prompt"]])}))

    reward = SimpleNamespace(compute_scores=SimpleNamespace(future=score))
    collect = validate(cfg, data, generate, reward, step=3)
    # every piece issued at once (with the weights of the moment), nothing scored before it is collected
    assert len(sizes) == -(-held_out // max(batch_size * n_samples // samples, 1)) and not scored
    metrics = collect()
    assert len(scored) == len(sizes)
    most = batch_size * n_samples // samples
    assert len(set(sizes)) == 1 and sizes[0] <= max(most, 1) * samples and len(sizes) == -(-held_out // max(most, 1)), sizes
    expected = np.mean([score_of(f"{n}=") for n in numbers])
    assert metrics["val/score"] == pytest.approx(expected, abs=1e-6)
    assert metrics["val/response_length/clip_ratio"] == pytest.approx(np.mean([score_of(f"{n}=") >= 0.5 for n in numbers]))

def test_verl_parquet_and_jsonl_read_the_same(tmp_path):
    rows = verl_rows()
    parquet, jsonl = write_rows(rows, tmp_path / "d.parquet"), write_rows(rows, tmp_path / "d.jsonl")
    assert read_rows(parquet) == read_rows(jsonl) == rows


def test_long_prompts_are_left_out_and_counted_never_cut(tmp_path):
    tok = CharTokenizer(copy_digits.ALPHABET)
    path = write_rows([{"prompt": "1" * n + "="} for n in (2, 9, 3, 12, 4)], tmp_path / "p.jsonl")
    data = PromptDataset(path, tok, 2, seed=0, max_prompt_length=6)      # bos + digits + "=": 4, 11, 5, 14, 6 tokens
    assert len(data) == 3 and data.too_long == 2
    seen = sorted(p for b in data.in_order(2) for p in b["prompt"])
    assert seen == sorted(["11=", "111=", "1111="]) and sorted(b for bb in data.in_order(2) for b in bb["index"]) == [0, 2, 4]
    with pytest.raises(ValueError, match="longer than max_prompt_length 2 tokens"):
        PromptDataset(path, tok, 2, seed=0, max_prompt_length=2)


def test_a_row_without_a_prompt_is_named(tmp_path):
    path = write_rows([{"prompt": "12="}, {"question": "x"}], tmp_path / "p.jsonl")
    with pytest.raises(ValueError, match=r"row 2 needs 'prompt' .* \(it has: question\)"):
        PromptDataset(path, CharTokenizer(copy_digits.ALPHABET), 2, seed=0)


def test_token_budget_micro_batches_give_the_full_forwards_values(tmp_path):
    """Micro-batches cut to a token budget, their common padding trimmed, compute what one forward
    over the whole padded batch computes (log-probs of the real tokens)."""
    from hpcrl.engines.micro_batches import micro_batches
    from hpcrl.engines.train.torch_trainer import TorchTrainer
    from hpcrl.models import create_model_dir, load_causal_lm, log_probs_head

    tok = CharTokenizer(copy_digits.ALPHABET)
    model_dir = create_model_dir(tmp_path / "m", tok, seed=0)
    g = torch.Generator().manual_seed(0)
    b, p, r = 12, 9, 7
    prompt_len, resp_len = torch.randint(2, p + 1, (b,), generator=g), torch.randint(1, r + 1, (b,), generator=g)
    pm = (torch.arange(p)[None] >= p - prompt_len[:, None]).long()
    rm = (torch.arange(r)[None] < resp_len[:, None]).long()
    prompts = torch.randint(3, tok.vocab_size, (b, p), generator=g) * pm
    responses = torch.randint(3, tok.vocab_size, (b, r), generator=g) * rm
    batch = Batch({"prompt_ids": prompts, "prompt_mask": pm, "responses": responses, "response_mask": rm,
                   "input_ids": torch.cat([prompts, responses], 1), "attention_mask": torch.cat([pm, rm], 1)})
    engine = TorchTrainer(load_causal_lm(model_dir), None, log_probs_head(1.0, with_entropy=False))
    whole = engine.infer(batch, micro_batch_size=b)["log_probs"]
    micro = micro_batches(batch, size=b, tokens=24)
    assert len(micro) > 2 and all(len(mb) * mb["input_ids"].shape[1] <= 24 or len(mb) == 1 for mb in micro)
    assert sum(mb["input_ids"].numel() for mb in micro) < batch["input_ids"].numel()     # padding was cut
    budgeted = engine.infer(batch, micro_batch_size=b, micro_batch_tokens=24)["log_probs"]
    torch.testing.assert_close(budgeted * rm, whole * rm, atol=1e-5, rtol=1e-5)


def test_chat_prompts_need_a_chat_template():
    with pytest.raises(ValueError, match="no chat template"):
        CharTokenizer("01").encode_chat([{"role": "user", "content": "0"}])


def _wandb_history(path):
    """The history records of a W&B offline run file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, out, pending = path.read_bytes(), 32768, 7, [], b""     # 7: the ":W&B" header
    while pos + 7 <= len(data):
        if block - pos % block < 7:                         # a block's trailer: too short for a header
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                                  # FULL or LAST: a whole record
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            pending = b""
            if rec.WhichOneof("record_type") == "history":
                out.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return out


def test_wandb_offline_run_gets_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    from hpcrl.observe.metrics import MetricsLog

    log = MetricsLog(tmp_path, wandb={"project": "hpcrl-test", "mode": "offline"})
    for step in (1, 2, 3):
        log.write({"step": step, "time": 1000.0 + step, "reward/mean": step / 4, "actor/pg_loss": None})
    log.close()
    # W&B's own service process writes the file; on a loaded machine it may still be at it after finish()
    run_file = next(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    wait_until(lambda: len(_wandb_history(run_file)) >= 3, 60, "the W&B run file's 3 history records", poll=1)
    history = _wandb_history(run_file)
    assert [(h["_step"], h["reward/mean"]) for h in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert not any("actor/pg_loss" in h for h in history)             # None (not measured) is left out
    again = MetricsLog(tmp_path, wandb={"project": "hpcrl-test", "mode": "offline"})   # a requeued job
    again.close()
    # one W&B run id (a second start within the same second gets the folder name `...-<id>-1`)
    ids = {re.match(r"offline-run-\d{8}_\d{6}-([0-9a-z]+)", p.name).group(1) for p in tmp_path.glob("wandb/offline-run-*")}
    assert len(ids) == 1, ids


def test_reward_table_and_report_skip_a_validation_only_step(tmp_path):
    from hpcrl.observe.metrics import reward_table

    records = [{"step": 0, "val/score": 0.2},
               *[{"step": s, "reward/mean": 0.1 * s, "reward/max": 1.0, "kl": 0.0, "response_length/mean": 3.0,
                  "throughput/tokens_per_s": 10.0, **({"val/score": 0.3} if s == 2 else {})} for s in (1, 2)]]
    table = reward_table(records).splitlines()
    assert table[0].split()[-1] == "val/score" and table[1].split()[0] == "1" and table[2].split()[-1] == "0.300"
    assert np.isclose(float(table[2].split()[1]), 0.2)


BATCHED = '''
def score(prompts, responses, data_source=None, **_):
    return [float(len(r)) + (0.5 if s == "b" else 0.0) for r, s in zip(responses, data_source)]
'''


def test_a_batched_reward_function_scores_the_whole_batch(tmp_path, monkeypatch):
    from hpcrl.controller import local_worker
    from hpcrl.ppo.roles import RuleReward

    (tmp_path / "batched_scorer.py").write_text(BATCHED)
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = CharTokenizer(copy_digits.ALPHABET)
    tok.save(tmp_path)
    reward = local_worker(RuleReward, str(tmp_path), "batched_scorer:score", True)
    responses = [tok.encode("12", bos=False) + [tok.eos_id], tok.encode("7", bos=False) + [tok.eos_id, tok.pad_id]]
    batch = Batch({"responses": torch.tensor(responses)},
                  {"prompt": np.array(["12=", "7="], dtype=object), "data_source": np.array(["a", "b"], dtype=object)})
    assert reward.compute_scores(batch)["scores"].tolist() == [2.0, 1.5]


def test_the_report_draws_the_held_out_score(tmp_path):
    from hpcrl.observe.report import write_report

    records = [{"step": 0, "val/score": 0.2, "val/score/reasoning_gym/chain_sum": 0.2}]
    records += [{"step": s, "reward/mean": 0.1 * s, "reward/max": 1.0, "kl": 0.0, "response_length/mean": 3.0,
                 "response_length/max": 5.0, "throughput/tokens_per_s": 10.0, "timing/step": 0.5,
                 **({"val/score": 0.1 * s, "val/score/reasoning_gym/chain_sum": 0.1 * s} if s % 5 == 0 else {})}
                for s in range(1, 11)]
    write_rows(records, tmp_path / "metrics.jsonl")
    page = write_report(tmp_path).read_text()
    assert (tmp_path / "report" / "validation.png").exists() and "Held-out score" in page
    assert "0.200 at step 0 → 1.000 at step 10" in page
