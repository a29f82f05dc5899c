"""Your own agent (train.environment.agent, docs/pages/how-to/your-own-agent.md): the OpenAI-compatible
endpoint of a generating rank with the real tiny model and the real `openai` client, the keys, the
trajectories, the agents' role, and the tiny tool task learned through an agent on the local cluster."""
import ast
import asyncio
import json
import random
import time

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, job_finished, kill_dead, slurm_log, submit, wait_until, with_train

from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.torch_rollout import TorchRollout
from hpcrl.models import create_model_dir, load_causal_lm
from hpcrl.models.tokenizer import CharTokenizer
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.status import read_events
from hpcrl.ppo.agent_episodes import Forked, chain
from hpcrl.ppo.config import ConfigError, TrainConfig
from hpcrl.ppo.roles.agents import Agents, agent_result
from hpcrl.ppo.roles.endpoint import ServesEndpoint
from hpcrl.ppo.tasks import tool_sums
from hpcrl.serving.keys import episode_key
from hpcrl.serving.openai_api import assistant_message
from hpcrl.serving.server import ATTEMPT_HEADER, Endpoint

openai = pytest.importorskip("openai")


# --- trajectories (pure)

def served(prompt, out, logp, eos=True):
    return {"prompt_ids": prompt, "output_ids": out, "logprobs": logp, "eos": eos, "policy_version": 3}


def test_an_episodes_requests_become_one_trajectory_with_the_models_tokens_masked_in():
    first = served([1, 5, 6], [7, 2], [-0.5, -0.1])
    second = served([1, 5, 6, 7, 2, 9, 9], [8, 2], [-0.3, -0.2])     # continues: prompt + output + tool result
    prompt, ep = chain([first, second], budget=20)
    assert prompt == [1, 5, 6]
    assert ep.tokens == [7, 2, 9, 9, 8, 2]
    assert ep.model == [1, 1, 0, 0, 1, 1]         # the tool result is not the model's
    assert ep.logp == [-0.5, -0.1, 0.0, 0.0, -0.3, -0.2]
    assert (ep.final, ep.turns, ep.eos) == (4, 2, True)
    cut = chain([first, second], budget=5)[1]      # environment.max_tokens: cut, and no stop token in it
    assert (cut.tokens, cut.model, cut.eos) == ([7, 2, 9, 9, 8], [1, 1, 0, 0, 1], False)


def test_an_agent_that_forks_its_conversation_is_refused():
    first = served([1, 5, 6], [7, 2], [-0.5, -0.1])
    branch = served([1, 5, 6, 9], [8, 2], [-0.3, -0.2])      # the same history, without the first answer
    with pytest.raises(Forked, match="request 2 of 2 does not continue"):
        chain([first, branch], budget=20)


def test_what_an_agent_returns():
    assert agent_result(1) == (1.0, {})
    assert agent_result({"reward": 0.5, "info": {"tool_calls": 2, "note": "x", "ok": True}}) == (0.5, {"tool_calls": 2.0})
    for bad, why in (({"score": 1}, "without 'reward'"), (None, "not a finite number"),
                     (float("nan"), "not a finite number"), ({"reward": 1, "info": [1]}, "not a dict")):
        with pytest.raises(TypeError, match=why):
            agent_result(bad)


def test_native_tool_calls_become_openai_tool_calls():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "37+45"}}\n</tool_call>'
    message, reason = assistant_message(text)
    assert reason == "tool_calls" and message["content"] == "Let me compute."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "37+45"}
    assert assistant_message("82") == ({"role": "assistant", "content": "82"}, "stop")


def test_the_spec_field_says_what_is_wrong():
    assert "env" in TrainConfig.parse({"environment": {"agent": "my_agents:solve"}}).roles()
    for bad, said in (({"agent": "my_agents.solve"}, "write it as package.module:function"),
                      ({"agent": "a:b", "cls": "c:D"}, "not both"),
                      ({"agent": "a:b", "agent_time_limit": 0}, "agent_time_limit")):
        with pytest.raises(ConfigError, match=said):
            TrainConfig.parse({"environment": bad})
    with pytest.raises(ConfigError, match="reward.scorers: with environment.agent"):
        TrainConfig.parse({"environment": {"agent": "a:b"}, "reward": {"scorers": [{"role": "reward"}]}})


# --- the endpoint with the real tiny model and the real openai client

class Rank(ServesEndpoint):
    """What a generating rank gives the endpoint: its config and engine (TorchRollout on the CPU)."""
    shares_device, policy_version = False, 0

    def __init__(self, model_dir, temperature=1.0):
        self.cfg = TrainConfig.parse({"rollout": {"max_new_tokens": 4, "temperature": temperature}})
        self.model_dir = str(model_dir)
        tok = CharTokenizer(tool_sums.ALPHABET)
        self.rollout = TorchRollout(load_causal_lm(model_dir).eval().requires_grad_(False), tok.pad_id, tok.stop_ids)


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    model = create_model_dir(tmp_path_factory.mktemp("agents") / "m", CharTokenizer(tool_sums.ALPHABET), 1,
                             hidden_size=64, layers=1, heads=2)
    return Rank(model)


@pytest.fixture
def endpoint(rank):
    ep = Endpoint(rank._sample, CharTokenizer(tool_sums.ALPHABET), rank.cfg.rollout.max_new_tokens, "127.0.0.1")
    yield ep
    ep.shutdown()


SECRET = b"s" * 32


def client(endpoint, key):
    return openai.AsyncOpenAI(base_url=endpoint.url, api_key=key, max_retries=0, timeout=60)


def test_the_trajectory_holds_the_engines_tokens_token_for_token(rank, endpoint):
    tok = CharTokenizer(tool_sums.ALPHABET)
    endpoint.open(SECRET, {"e": 1234}, validation=False, policy_version=0)

    async def agent():      # the sums agent's two requests, the second whatever the first said
        c = client(endpoint, episode_key(SECRET, "e"))
        first = (await c.completions.create(model="policy", prompt="37+45=", max_tokens=4)).choices[0].text
        streamed = [chunk.choices[0].text async for chunk in await c.completions.create(
            model="policy", prompt="37+45=" + first + "82=", max_tokens=4, stream=True)]
        await c.close()
        return first, "".join(streamed)
    first, second = asyncio.run(agent())
    (a, b), = endpoint.close(["e"]).values()
    # the reference: the engine called directly, on the prompts built by hand, with the requests' seeds
    params = SamplingParams(4, 1.0)
    p1 = tok.encode("37+45=")
    ref1 = rank.rollout.generate(torch.tensor([p1]), torch.ones(1, len(p1), dtype=torch.long), params, 1234)
    n1 = int(ref1["response_mask"][0].sum())
    assert a["prompt_ids"] == p1 and a["output_ids"] == ref1["responses"][0, :n1].tolist()
    assert a["logprobs"] == ref1["rollout_log_probs"][0, :n1].tolist() and tok.decode(a["output_ids"]) == first
    p2 = p1 + a["output_ids"] + tok.encode("82=", bos=False)     # the first turn as sampled, its stop token too
    ref2 = rank.rollout.generate(torch.tensor([p2]), torch.ones(1, len(p2), dtype=torch.long), params, 1234 + (1 << 32))
    n2 = int(ref2["response_mask"][0].sum())
    assert b["prompt_ids"] == p2 and b["output_ids"] == ref2["responses"][0, :n2].tolist()
    assert tok.decode(b["output_ids"]) == second
    prompt, ep = chain([a, b], budget=12)
    assert prompt == p1 and ep.tokens == (a["output_ids"] + tok.encode("82=", bos=False) + b["output_ids"])[:12]
    assert ep.model == ([1] * n1 + [0] * 3 + [1] * n2)[:12]


def test_a_request_without_its_episodes_key_is_refused(endpoint):
    endpoint.open(SECRET, {"mine": 1, "closed": 2}, validation=False, policy_version=0)
    endpoint.close(["closed"])

    async def ask(key):
        c = client(endpoint, key)
        try:
            await c.completions.create(model="policy", prompt="1+2=", max_tokens=2)
        finally:
            await c.close()
    for key in (episode_key(b"another run's secret".ljust(32), "mine"), episode_key(SECRET, "closed"), "sk-made-up"):
        with pytest.raises(openai.AuthenticationError, match="not the key of an episode open"):
            asyncio.run(ask(key))
    asyncio.run(ask(episode_key(SECRET, "mine")))
    records = endpoint.close(["mine", "closed"])
    assert list(records) == ["mine"] and len(records["mine"]) == 1      # the refused ones sampled nothing


def test_an_agent_run_again_after_its_rank_was_lost_starts_its_record_afresh(endpoint):
    endpoint.open(SECRET, {"e": 5}, validation=False, policy_version=0)

    async def attempt(name, prompts):
        c = openai.AsyncOpenAI(base_url=endpoint.url, api_key=episode_key(SECRET, "e"), max_retries=0,
                               default_headers={ATTEMPT_HEADER: name})
        for prompt in prompts:
            await c.completions.create(model="policy", prompt=prompt, max_tokens=2)
        await c.close()
    asyncio.run(attempt("lost", ["1+2=", "1+2=3"]))       # the env rank died after these
    asyncio.run(attempt("again", ["4+5="]))
    (record,) = endpoint.close(["e"])["e"]
    assert record["sent"] == "4+5="


def test_an_agent_that_hangs_is_cut_at_its_limit_and_fails(endpoint):
    agents = Agents("hpcrl.jobs.sums_agent:hangs", time_limit=2.0)
    names = ["hangs 0", "hangs 1"]
    endpoint.open(SECRET, {n: i for i, n in enumerate(names)}, validation=False, policy_version=0)
    from hpcrl.controller.batch import Batch, object_array
    t0 = time.monotonic()
    out = agents.run_agents(Batch(arrays={"prompt": object_array(["1+2=", "3+4="]), "episode": object_array(names),
                                          "episode_key": object_array([episode_key(SECRET, n) for n in names]),
                                          "endpoint": object_array([endpoint.url] * 2)}))
    assert time.monotonic() - t0 < 60       # not the hour it sleeps
    assert out["agent_reward"].tolist() == [0.0, 0.0]
    assert all("did not finish within train.environment.agent_time_limit (2 s)" in f for f in out["failure"])
    assert set(endpoint.close(names)) == set(names)     # each made its request before it hung


def test_an_agent_function_that_is_not_async_is_refused_at_the_roles_start():
    with pytest.raises(ValueError, match="train.environment.agent: .* is not an async function"):
        Agents("hpcrl.jobs.sums_agent:digits_right", time_limit=1.0)
    with pytest.raises(ValueError, match="train.environment.agent: "):
        Agents("hpcrl.jobs.no_such_module:solve", time_limit=1.0)


# --- the tiny tool task through an agent, on the local cluster

STEPS = 60
"""jobs/tiny-cpu-agent.yaml (32 prompts a step) with hpcrl run --local, seeds 1-3: the share of episodes
that call the calculator was 0.12-0.32 over steps 1-10 and 0.92-0.98 by steps 21-30; the reward (0.2 a
call + the answer's digits) 0.11-0.15 over steps 1-10 and 0.35-0.45 over 51-60. With 16 prompts a step,
on the local cluster, one run lost its calls (0.99 over steps 51-60, 0.16 over 71-80) and its reward fell
back to where it began; the test still asks that the calls were learned, not that they held."""


@pytest.mark.slurm
def test_an_openai_agent_learns_the_tool_task_on_the_cluster_and_goes_on_after_its_env_rank_is_killed(
        slurm_cluster, tmp_path):
    tree = ast.parse((ROOT / "jobs" / "sums_agent.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    # the agent is written against the openai package alone (its annotations through typing)
    assert imported == {"openai", "asyncio", "typing", "__future__"}
    path, run = tmp_path / "agent.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(with_train(yaml.safe_load((ROOT / "jobs" / "tiny-cpu-agent.yaml").read_text()),
                                              total_steps=STEPS, progress=False)))
    job = submit(path, run)
    seed = random.randrange(2**32)
    kill_at = random.Random(seed).randint(5, 30)
    print(f"the env process is killed after step {kill_at} (seed {seed})")       # shown with a failure
    wait_until(lambda: len(read_metrics(run / "metrics.jsonl")) >= kill_at, 600, f"{kill_at} steps (seed {seed})")
    kill_dead(json.loads((run / "status.json").read_text())["roles"]["env"]["ranks"][0]["pid"])
    wait_until(lambda: job_finished(job), 900, "the job")
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), slurm_log(run)
    rebuilt = [(e["event"], e["role"]) for e in read_events(run) if e["event"] in ("rebuild", "rebuilt")]
    assert rebuilt == [("rebuild", "env"), ("rebuilt", "env")], slurm_log(run)
    placed = {c["partition"]: c["members"] for c in json.loads((run / "allocation.json").read_text())["components"]}
    assert placed == {"a100": ["actor_rollout"], "cpu": ["env", "reward"]}     # the agents on the cpu component
    # no episode failed, not even those whose agents ran again on the rebuilt rank
    assert all(r["env/failed"] == 0 for r in records), slurm_log(run)
    def window(key, steps):
        return float(np.mean([r[key] for r in records[steps]]))
    before = window("env/tool_calls", slice(0, 3))     # steps 1-10 reached 0.56 on a CI run that learned fast
    calls = [window("env/tool_calls", slice(k, k + 10)) for k in range(0, STEPS, 10)]
    reward = [window("reward/mean", slice(0, 10)), window("reward/mean", slice(-10, None))]
    print(f"tool calls, steps 1-3 {before}, by 10 steps {calls}; reward, first and last 10 steps {reward}")
    # it learns to call the calculator, as the built-in environment's run does (tests/test_multi_turn.py),
    # and its reward rises
    assert before < 0.5 and max(calls) > 0.9, (before, calls)
    assert reward[1] > reward[0] + 0.1, reward


# --- chat, with a real chat template

@pytest.fixture(scope="module")
def smollm2():
    from hpcrl.models.smollm2 import fetch

    return fetch()


def test_a_chat_turn_continues_from_the_sampled_tokens_as_the_template_renders_it(smollm2):
    """The next request's prompt is the earlier one's ids + the sampled ids + the template's tokens
    after the turn: exactly the template's rendering of the whole conversation with the model's text."""
    from hpcrl.environments.tool_calls import with_tool_prompt
    from hpcrl.models.tokenizer import load_tokenizer
    from hpcrl.serving.conversation import Conversation, Served, normalise

    tok = load_tokenizer(smollm2)
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    user = {"role": "user", "content": "What is 37+45?"}
    said = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37+45"}}\n</tool_call>'
    conversation = Conversation(tok)
    first = conversation.chat_prompt([normalise(user)], tools)
    sampled = tok.tok(said, add_special_tokens=False)["input_ids"] + tok.stop_ids[:1]
    reply = normalise(assistant_message(said)[0])       # what the agent got: a tool call, no content
    conversation.add(Served(first, sampled, [0.0] * len(sampled), True, 0, [normalise(user)], reply))
    # the agent sends its history back as the openai client serialises it, then the tool's result
    history = [user, {**reply, "tool_calls": [{"id": "call_1", "type": "function", "function":
                                                {"name": "calculator", "arguments": '{"expression": "37+45"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "82"}]
    second = conversation.chat_prompt([normalise(m) for m in history], tools)
    assert second[:len(first) + len(sampled)] == first + sampled
    assert second == tok.encode_chat(with_tool_prompt([user, {"role": "assistant", "content": said},
                                                       {"role": "tool", "content": "82"}], tools))
    # a history the model did not write (another reply) is rendered whole, not continued
    other = [user, {"role": "assistant", "content": "83"}, {"role": "user", "content": "sure?"}]
    assert conversation.chat_prompt([normalise(m) for m in other], None) == tok.encode_chat(other)


@pytest.fixture(scope="module")
def smollm2_endpoint(smollm2):
    """SmolLM2-135M-Instruct served by an endpoint, greedy (held-out episodes), on the CPU."""
    from hpcrl.models.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2)
    rank = Rank.__new__(Rank)
    rank.cfg = TrainConfig.parse({"rollout": {"max_new_tokens": 24}, "validation": {"temperature": 0.0}})
    rank.model_dir, rank.rollout = str(smollm2), TorchRollout(load_causal_lm(smollm2).eval(), tok.pad_id, tok.stop_ids)
    endpoint = Endpoint(rank._sample, tok, 24, "127.0.0.1")
    yield endpoint
    endpoint.shutdown()


def one_episode(endpoint, agent, row) -> tuple[object, list[dict]]:
    """(what the agent returned, its requests as served)."""
    endpoint.open(SECRET, {"one": 7}, validation=True, policy_version=0)      # held out: greedy
    result = asyncio.run(agent(row, client(endpoint, episode_key(SECRET, "one"))))
    return result, endpoint.close(["one"])["one"]


def test_the_docs_example_agent_runs_against_a_real_chat_model(smollm2_endpoint):
    """docs/pages/how-to/your-own-agent.md's agent, as written there, against SmolLM2-135M-Instruct:
    its requests form one trajectory."""
    page = (ROOT / "docs" / "pages" / "how-to" / "your-own-agent.md").read_text()
    code = page.split("## An agent in twenty lines", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 20
    example: dict = {}
    exec(compile(code, "your-own-agent.md", "exec"), example)
    result, requests = one_episode(smollm2_endpoint, example["solve"], {"prompt": "What is 37+45? Use the calculator.",
                                                                         "answer": 82})
    assert (result["reward"] if isinstance(result, dict) else result) in (0.0, 1.0)
    prompt, ep = chain(requests, budget=10_000)
    assert ep.turns == len(requests) and sum(ep.model) == sum(len(r["output_ids"]) for r in requests)


def test_the_chain_sum_agent_for_the_gpu_comparison_runs_against_a_real_chat_model(smollm2_endpoint):
    from hpcrl.jobs.chain_sum_agent import calculate, solve

    assert (calculate("17 + 84 - 9"), calculate("2*(3")[:6], calculate("__import__('os')")[:6]) == ("92", "error:", "error:")
    row = {"prompt": [{"role": "user", "content": "State the final answer to the following arithmetic problem: 17 + 84 - 9 ="}],
           "reward_model": {"ground_truth": "92"}}
    result, requests = one_episode(smollm2_endpoint, solve, row)
    assert result["reward"] in (0.0, 1.0) and set(result["info"]) == {"tool_calls", "tool_errors"}
    # the tools went into the system message (SmolLM2's template does not render them), as the driver puts them
    assert '"name": "calculator"' in smollm2_endpoint.tok.tok.decode(requests[0]["prompt_ids"])
