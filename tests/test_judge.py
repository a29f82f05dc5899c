"""An LLM judge (train.judge, docs/pages/how-to/your-own-agent.md#an-llm-judge): the judge role's
endpoint with the real tiny model and the real `openai` client, its key, a reward function that
awaits it (the judge's answers compared with the engine's own, called directly), the spec's checks,
and a short local run whose reward comes from the judge."""
import asyncio
import inspect
import random

import pytest
import torch

from hpcrl.controller.batch import Batch, object_array
from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.torch_rollout import TorchRollout
from hpcrl.models import create_model_dir, load_causal_lm
from hpcrl.models.tokenizer import CharTokenizer
from hpcrl.ppo.config import ConfigError, TrainConfig
from hpcrl.ppo.roles.endpoint import sampled
from hpcrl.ppo.roles.judge import judge_key
from hpcrl.ppo.tasks import copy_digits
from hpcrl.serving.keys import episode_key
from hpcrl.serving.server import JUDGE_MODEL, Endpoint

openai = pytest.importorskip("openai")

SECRET = b"j" * 32
TOK = CharTokenizer(copy_digits.ALPHABET)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return create_model_dir(tmp_path_factory.mktemp("judge") / "m", TOK, 3, hidden_size=64, layers=1, heads=2)


def greedy(engine, prompt: str, n: int) -> str:
    """The engine's own greedy answer to `prompt`, called directly (the reference)."""
    ids = TOK.encode(prompt)
    out = engine.generate(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), SamplingParams(n, 0.0), 0)
    return TOK.decode(out["responses"][0, :int(out["response_mask"][0].sum())].tolist())


# --- the spec

def test_the_spec_says_what_a_judge_needs():
    cfg = TrainConfig.parse({"judge": {"enabled": True}, "reward": {"fn": "hpcrl.jobs.judge_reward:agrees"}})
    assert cfg.roles()[-1] == "judge" and "judge" not in TrainConfig.parse({}).roles()
    for train, said in (({}, "no reward.fn calls the judge"),
                        ({"reward": {"model_dir": "rm"}}, "reward.model_dir scores with a reward model"),
                        ({"reward": {"fn": "a:b", "scorers": [{"role": "mine"}]}}, "leave out the reward role"),
                        ({"environment": {"agent": "a:b"}}, "with environment.agent")):
        with pytest.raises(ConfigError, match=f"train.judge.enabled: .*{said}"):
            TrainConfig.parse({**train, "judge": {"enabled": True}})


def test_the_reward_function_and_the_judge_setting_must_agree(tmp_path):
    from hpcrl.jobspec.checks import judge_fn_problems

    enabled = TrainConfig.parse({"judge": {"enabled": True}, "reward": {"fn": "hpcrl.ppo.tasks.copy_digits:score"}})
    assert "is not an async function" in judge_fn_problems(enabled)[0]
    off = TrainConfig.parse({"reward": {"fn": "hpcrl.jobs.judge_reward:agrees"}})
    assert "set train.judge.enabled: true" in judge_fn_problems(off)[0]
    assert judge_fn_problems(off.updated(judge={"enabled": True})) == []


# --- the endpoint, as the judge serves it

@pytest.fixture(scope="module")
def engine(model):
    return TorchRollout(load_causal_lm(model).eval().requires_grad_(False), TOK.pad_id, TOK.stop_ids)


@pytest.fixture
def judge_endpoint(engine):
    """What a judge rank serves: its engine, greedy, one key for the whole run, nothing recorded."""
    ep = Endpoint(lambda prompts, seed, validation: sampled(engine, prompts, SamplingParams(3, 0.0), seed), TOK, 3,
                  "127.0.0.1", model=JUDGE_MODEL)
    ep.open(SECRET, {"judge": 1}, validation=False, policy_version=0, record=False)
    yield ep
    ep.shutdown()


def test_the_judge_answers_many_requests_at_once_as_its_engine_does_and_keeps_no_record(engine, judge_endpoint):
    seed = random.randrange(2**32)
    prompts = [f"{a}=" for a in random.Random(seed).sample(range(10, 100), 12)]

    async def ask():
        c = openai.AsyncOpenAI(base_url=judge_endpoint.url, api_key=judge_key(SECRET), max_retries=0, timeout=60)
        answers = await asyncio.gather(*(c.completions.create(model="judge", prompt=p, max_tokens=3) for p in prompts))
        models = await c.models.list()
        await c.close()
        return [a.choices[0].text for a in answers], [m.id for m in models.data]
    answers, models = asyncio.run(ask())
    assert answers == [greedy(engine, p, 3) for p in prompts], f"seed {seed}"
    assert models == ["judge"]
    assert judge_endpoint.close(["judge"]) == {}      # nothing recorded: no trajectory is made of the judge


def test_a_request_without_the_judges_key_is_refused(judge_endpoint):
    async def ask(key):
        c = openai.AsyncOpenAI(base_url=judge_endpoint.url, api_key=key, max_retries=0, timeout=60)
        try:
            return (await c.completions.create(model="judge", prompt="12=", max_tokens=2)).choices[0].text
        finally:
            await c.close()
    for key in (episode_key(SECRET, "step 1 sample 0 (dataset row 3)"), judge_key(b"another run".ljust(32)), "sk-x"):
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            asyncio.run(ask(key))
    assert isinstance(asyncio.run(ask(judge_key(SECRET))), str)


# --- the judge and reward roles on a real Ray

@pytest.fixture(scope="module")
def ray_roles(tmp_path_factory):
    import ray

    from hpcrl.raycluster.session import start_local

    start_local(["judge", "reward"], run_dir=tmp_path_factory.mktemp("run"), num_cpus=2)
    yield
    ray.shutdown()


def test_a_reward_function_awaits_the_judge_role_and_gets_what_its_engine_says(ray_roles, model, engine):
    from hpcrl.controller import ResourcePool, WorkerGroup
    from hpcrl.jobs.judge_reward import agrees
    from hpcrl.ppo.roles import Judge, RuleReward

    assert inspect.iscoroutinefunction(agrees)
    cfg = TrainConfig.parse({"judge": {"enabled": True, "max_new_tokens": 3},
                             "reward": {"fn": "hpcrl.jobs.judge_reward:agrees"}})
    judge = WorkerGroup(ResourcePool.for_role("judge"), Judge, (str(model), cfg, SECRET))
    reward = WorkerGroup(ResourcePool.for_role("reward", uses_gpus=False), RuleReward,
                         (str(model), cfg.reward.fn, False, judge_key(SECRET)))
    try:
        (url,) = judge.url()
        seed = random.randrange(2**32)
        rng = random.Random(seed)
        # half of the responses what the judge says itself (of the prompts it answers in three
        # characters: the untrained model often stops at once), half random digits
        answers = {f"{a}=": greedy(engine, f"{a}=", 3) for a in range(10, 100)}
        whole = [p for p, a in answers.items() if len(a) == 3]
        prompts = [rng.choice(whole) if i % 2 else rng.choice(list(answers)) for i in range(8)]
        responses = [answers[p] if i % 2 else "".join(rng.choice("0123456789") for _ in range(3))
                     for i, p in enumerate(prompts)]
        ids = [TOK.encode(r, bos=False) for r in responses]
        batch = Batch({"responses": torch.tensor([i + [TOK.pad_id] * (3 - len(i)) for i in ids])},
                      arrays={"prompt": object_array(prompts)})
        scores = reward.compute_scores(batch)["scores"].tolist()
        expected = [asyncio.run(agrees(p, r, _Direct(engine))) for p, r in zip(prompts, responses)]
        assert scores == pytest.approx(expected), f"seed {seed}: prompts {prompts}, responses {responses}"
        assert scores[1::2] == [1.0] * 4, f"seed {seed}"      # the judge agrees with its own answers
        # the judge's URL answers only its key
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(openai.AsyncOpenAI(base_url=url, api_key=episode_key(SECRET, "x"), max_retries=0)
                        .completions.create(model="judge", prompt="12=", max_tokens=2))
    finally:
        reward.shutdown()
        judge.shutdown()


class _Direct:
    """A judge client that calls the engine itself, greedy (the reference of the role's answers)."""

    def __init__(self, engine):
        self.completions = self
        self.engine = engine

    async def create(self, model, prompt, max_tokens):
        text = greedy(self.engine, prompt, min(max_tokens, 3))
        return type("Completion", (), {"choices": [type("Choice", (), {"text": text})]})


# --- a short run whose reward comes from the judge

def test_a_short_local_run_scores_with_the_judge(tmp_path):
    """The driver starts the judge role beside the others (`hpcrl run --local`'s way) and the reward
    role's function awaits it every step (12 s here)."""
    import json

    from conftest import run_local

    cfg = TrainConfig.parse({"total_steps": 3, "progress": False, "data": {"batch_size": 8},
                             "rollout": {"n_samples": 2}, "algorithm": {"advantage": "grpo", "kl_coef": 0.0},
                             "optim": {"mini_batch_size": 16, "micro_batch_size": 16},
                             "checkpoint": {"save_every": 0, "save_last": False},
                             "reward": {"fn": "hpcrl.jobs.judge_reward:agrees"},
                             "judge": {"enabled": True, "max_new_tokens": 3}})
    records = run_local(tmp_path, cfg)
    assert [r["step"] for r in records] == [1, 2, 3]
    roles = json.loads((tmp_path / "status.json").read_text())["roles"]
    assert set(roles) == {"actor_rollout", "reward", "judge"} and roles["judge"]["restarts"] == 0
    assert "judge endpoint at http://" in (tmp_path / "logs" / "judge" / "rank0.log").read_text()
    # scores are shares of 3 characters the judge's answers agree with: some did
    assert any(r["reward/max"] > 0 for r in records), records


def test_the_docs_judge_is_the_shipped_one_and_runs_against_a_real_chat_model():
    """docs/pages/how-to/your-own-agent.md's `verdict` is jobs/judge_reward.py's, and SmolLM2-135M-Instruct,
    served greedy as the judge role serves it, gives it a yes or no it turns into 1 or 0."""
    from conftest import ROOT

    from hpcrl.jobs.judge_reward import verdict
    from hpcrl.models.smollm2 import fetch
    from hpcrl.models.tokenizer import load_tokenizer

    page = (ROOT / "docs" / "pages" / "how-to" / "your-own-agent.md").read_text()
    shown = page.split("## An LLM judge", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert inspect.getsource(verdict).strip() in shown
    model = fetch()
    tok = load_tokenizer(model)
    engine = TorchRollout(load_causal_lm(model).eval().requires_grad_(False), tok.pad_id, tok.stop_ids)
    ep = Endpoint(lambda prompts, seed, validation: sampled(engine, prompts, SamplingParams(4, 0.0), seed), tok, 4,
                  "127.0.0.1", model=JUDGE_MODEL)
    ep.open(SECRET, {"judge": 1}, validation=False, policy_version=0, record=False)
    try:
        async def both():
            judge = openai.AsyncOpenAI(base_url=ep.url, api_key=judge_key(SECRET), max_retries=0, timeout=120)
            return await asyncio.gather(verdict("What is 2+2?", "4", judge), verdict("What is 2+2?", "5", judge))
        got = asyncio.run(both())
        for answer, v in zip(("4", "5"), got):      # the reference: the template's prompt, greedy, called directly
            question = f"Question: What is 2+2?\nAnswer: {answer}\nIs the answer correct? Reply yes or no."
            ids = tok.encode_chat([{"role": "user", "content": question}])
            out = engine.generate(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), SamplingParams(4, 0.0), 0)
            said = tok.decode(out["responses"][0, :int(out["response_mask"][0].sum())].tolist())
            assert v == float(said.strip().lower().startswith("yes")), (answer, said)
    finally:
        ep.shutdown()
