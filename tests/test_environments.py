"""Multi-turn rollouts, piece by piece, with real parts: the calculator against Python's own
arithmetic, tool calls as Qwen's format writes them, the observation tokens against the chat
template's rendering of the whole conversation, episodes of the real SmolLM2 written turn by turn
by the rollout role and answered by the env role (both real workers, in this process), failed
episodes, and GAE over the model's tokens against a numpy version that never sees an observation."""
import asyncio
import errno
import itertools
import json
import random
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from hpcrl.algo import gae
from hpcrl.controller import local_worker
from hpcrl.controller.batch import Batch
from hpcrl.environments import Calculator, Environment, Tool, ToolEnvironment, ToolError, Turn
from hpcrl.environments.tool_calls import MalformedCall, ToolCall, parse_tool_calls
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.episodes import Episodes, episode_scores
from hpcrl.ppo.roles import Environments, Rollout, RuleReward

XDIST_GROUP = "sandbox"    # one worker for the modules that run sandboxes: a test counts every sandbox process on the host


def test_the_calculator_computes_what_python_does():
    rng = random.Random(7)
    for _ in range(300):
        terms = [str(rng.randint(0, 999)) for _ in range(rng.randint(2, 5))]
        expr = terms[0] + "".join(rng.choice(["+", "-", "*", "//", "%"]) + t for t in terms[1:])
        if rng.random() < 0.3:
            expr = f"({expr})*-{rng.randint(1, 9)}"
        try:
            want = eval(expr)          # noqa: S307 - the reference: digits and operators only
        except ZeroDivisionError:
            with pytest.raises(ToolError, match="division by zero"):
                Calculator().evaluate(expr)
            continue
        assert Calculator().evaluate(expr) == str(want), f"seed 7, {expr}"
    assert Calculator().evaluate("7/2") == "3.5" and Calculator().evaluate("6/3") == "2"


@pytest.mark.parametrize("expr, why", [("__import__('os')", "only numbers"), ("a+1", "only numbers"),
                                       ("9**9**9", "too large"), ("2+", "not an arithmetic"), ("1/0", "division"),
                                       ("(-8)**0.5", "not a real number"), ("1\x00", "not an arithmetic")])
def test_the_calculator_refuses_what_is_not_arithmetic(expr, why):
    with pytest.raises(ToolError, match=why):
        Calculator().evaluate(expr)


@pytest.mark.parametrize("expr, why", [
    ("(9**999)**999", "integers of at most 1000 digits"),       # was an uncaught ValueError (str of the result)
    ("((10**1000)**1000)**1000", "integers of at most 1000 digits"),     # was minutes of work on the event loop
    ("10**999*10", "integers of at most 1000 digits"), ("0x" + "f" * 900, "integers of at most 1000 digits"),
    ("-" * 150 + "1", "151 levels deep.*at most 100"),           # deep unary minus, long sums: RecursionError
    ("+".join(["1"] * 400), "400 levels deep.*at most 100"), ("1" + "+1" * 600, "1201 characters long.*at most 1000"),
    ("-" * 100_000 + "1", "100001 characters long"), ("+".join(["1"] * 100_000), "199999 characters long"),
    ("1e999", "too large for a floating-point number"), ("1e300*1e300", "too large for a floating-point number"),
    ("10**400/3", "too large for a floating-point number")])
def test_the_calculator_says_which_bound_an_expression_passes(expr, why):
    with pytest.raises(ToolError, match=why):
        Calculator().evaluate(expr)
    assert Calculator().evaluate("-" * 99 + "1") == "-1" and Calculator().evaluate("+".join(["1"] * 100)) == "100"
    assert Calculator().evaluate("2**3321") == str(2**3321) and Calculator().evaluate("(-1)**(10**999)") == "1"


def unruly_expression(rng: random.Random, depth: int = 0) -> str:
    """Arithmetic as a model might write it to break a calculator: huge and tiny numbers, towers of
    powers, long sums, deep unary minus, and ordinary pieces between them."""
    if depth > 4 or rng.random() < 0.3:
        return rng.choice([lambda: str(rng.randint(0, 99)), lambda: str(rng.randint(0, 10 ** rng.randint(1, 600))),
                           lambda: f"{rng.random() * 10:.3f}e{rng.randint(-999, 999)}", lambda: hex(rng.getrandbits(64)),
                           lambda: "1e999", lambda: "0"])()
    kind = rng.random()
    if kind < 0.15:
        return "-" * rng.randint(1, 160) + unruly_expression(rng, depth + 1)
    if kind < 0.3:
        return "+".join(unruly_expression(rng, 5) for _ in range(rng.randint(2, 300)))
    if kind < 0.5:
        return "**".join(f"({unruly_expression(rng, depth + 1)})" for _ in range(rng.randint(2, 4)))
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    return f"({unruly_expression(rng, depth + 1)}){op}({unruly_expression(rng, depth + 1)})"


def test_every_expression_is_a_value_or_a_tool_error_within_milliseconds():
    """Whatever the model writes: Python's own value (where it is an integer), or a ToolError; never
    another exception, and never more than a moment of work (bounded before it is computed)."""
    seed = random.randrange(2**32)
    rng, calculator, slowest = random.Random(seed), Calculator(), (0.0, "")
    outcomes = {"value": 0, "refused": 0}
    for _ in range(3000):
        expr = unruly_expression(rng)
        start = time.perf_counter()
        try:
            got = calculator.evaluate(expr)
        except ToolError:
            got = None
        except Exception as e:
            pytest.fail(f"seed {seed}: {expr[:300]!r} raised {type(e).__name__}: {e}")
        slowest = max(slowest, (time.perf_counter() - start, expr))
        outcomes["value" if got is not None else "refused"] += 1
        if got is not None:    # every value on the way was within bounds: Python's own arithmetic is quick here too
            want = eval(expr)           # noqa: S307 - the reference: numbers and operators only
            assert not isinstance(want, int) or got == str(want), f"seed {seed}: {expr[:300]!r}"
    assert slowest[0] < 0.5, f"seed {seed}: {slowest[1][:300]!r} took {slowest[0]:.2f} s"
    assert min(outcomes.values()) > 300, f"seed {seed}: {outcomes}"


def test_tool_calls_in_qwens_format():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": oops}</tool_call><tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "12*7"}), ToolCall("python", {"code": "print(1)"})]
    assert isinstance(calls[2], MalformedCall) and "not JSON" in calls[2].why
    assert calls[3] == ToolCall("calculator", {"expression": "1"})        # unclosed: the stop token came first
    assert parse_tool_calls("The answer is 84.") == []
    deep = parse_tool_calls("<tool_call>" + "[" * 100_000 + '</tool_call><tool_call>{"name": "c", "arguments": "'
                            + "[" * 100_000 + '"}</tool_call>')
    assert [(type(c), c.why) for c in deep] == [(MalformedCall, "JSON nested deeper than it can be read"),
                                                (MalformedCall, "arguments must be a JSON object")]


def test_the_tool_environment_answers_each_call_and_counts_the_errors():
    env = ToolEnvironment(tools=["calculator"], max_calls=2)
    call = '<tool_call>{{"name": "{}", "arguments": {{"expression": "{}"}}}}</tool_call>'

    async def episode():
        await env.start({"extra_info": {"tools_kwargs": {"calculator": {}}}})
        first = await env.step(call.format("calculator", "6*7") + call.format("search", "x") + call.format("calculator", "1"))
        last = await env.step("It is 42.")
        return first, last
    first, last = asyncio.run(episode())
    assert [m["content"] for m in first.observation] == ["42", "error: no tool named 'search' (tools: calculator)",
                                                        "error: at most 2 tool calls per turn; this one was not run"]
    assert first.info == {"tool_calls": 3, "tool_errors": 2} and not first.done
    assert last.done and last.reward == 0.0 and last.info == {"tool_calls": 0, "tool_errors": 0}
    with pytest.raises(ValueError, match="does not have"):
        asyncio.run(env.start({"extra_info": {"tools_kwargs": {"web_search": {}}}}))


@pytest.fixture(scope="module")
def smollm2():
    from hpcrl.models.smollm2 import fetch

    return fetch()


# Qwen2.5's way of rendering tools (a system section) and tool results (user turns of <tool_response>s)
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You help.' }}"
    "\n\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module", params=["smollm2", "hermes"])
def chat_model(request, smollm2, tmp_path_factory):
    """SmolLM2 as it is (a template that ignores tools), and with a template that renders them."""
    if request.param == "smollm2":
        return smollm2
    out = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(smollm2, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def test_observation_tokens_complete_the_chat_templates_rendering(chat_model):
    """A conversation built as an episode builds it — the prompt, each assistant turn's tokens and
    its stop token as sampled, then encode_followup of what the tools said — is token for token the
    template's rendering of the whole conversation (which ends with the newline after the last stop)."""
    from transformers import AutoTokenizer

    tok, hf = load_tokenizer(chat_model), AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    tools = ToolEnvironment.tool_schemas(tools=["calculator", "python"])
    question = [{"role": "user", "content": "What is 12*7+1?"}]
    turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>',
             '<tool_call>\n{"name": "calculator", "arguments": {"expression": "84+1"}}\n</tool_call>'
             '<tool_call>\n{"name": "python", "arguments": {"code": "print(85)"}}\n</tool_call>', "It is 85."]
    said = [[{"role": "tool", "content": "84"}], [{"role": "tool", "content": "85"}, {"role": "tool", "content": "85\n"}]]
    from hpcrl.ppo.data import prompt_ids

    ids, model = prompt_ids({"prompt": question}, tok, tools), []
    conversation = list(question)
    for k, text in enumerate(turns):
        sampled = hf(text, add_special_tokens=False)["input_ids"] + tok.stop_ids[:1]
        ids, model = ids + sampled, model + list(range(len(ids), len(ids) + len(sampled)))
        conversation.append({"role": "assistant", "content": text})
        if k < len(said):
            ids += tok.encode_followup(said[k])
            conversation += said[k]
    if not tok.renders_tools:
        from hpcrl.environments.tool_calls import with_tool_prompt

        conversation = with_tool_prompt(conversation, tools)
    rendered = hf.apply_chat_template(conversation, tools=tools if tok.renders_tools else None, tokenize=False)
    want = hf(rendered, add_special_tokens=False)["input_ids"]
    assert ids == want[:len(ids)] and hf.decode(want[len(ids):]).strip() == ""
    assert hf.decode([ids[i] for i in model]) == "".join(t + "<|im_end|>" for t in turns)
    assert ("<tools>" in rendered) and ("# Tools" in hf.decode(ids[:20 + len(ids) // 4]))


class Nudge(Environment):
    """Answers every turn "Say it again, shorter." as the user, with a reward of 0.25, for two turns."""

    async def start(self, row):
        self.left = 2

    async def step(self, text):
        self.left -= 1
        return Turn([{"role": "user", "content": "Say it again, shorter."}], reward=0.25, done=self.left < 0)


def test_episodes_of_a_real_model_are_its_conversation_as_the_template_renders_it(smollm2):
    """SmolLM2 (the rollout role) and Nudge (the env role) take three turns per episode; the batch's
    response is the rest of the template's rendering of the conversation, the response_mask covers
    exactly the model's turns, each turn's reward sits on its stop token, and the reward role reads the last turn."""
    from transformers import AutoTokenizer

    cfg = TrainConfig.parse({"rollout": {"max_new_tokens": 16},      # some turns are cut: they go on, a stop token put after
                             "environment": {"cls": "test_environments:Nudge", "max_turns": 3, "max_tokens": 300}})
    tok, hf = load_tokenizer(smollm2), AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    rollout, env = local_worker(Rollout, str(smollm2), cfg), local_worker(Environments, "test_environments:Nudge", {}, 5.0)
    questions = ["Name a colour.", "What is 2+2?"]
    ids = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    width = max(map(len, ids))
    prompts = Batch({"prompt_ids": torch.tensor([[tok.pad_id] * (width - len(s)) + s for s in ids]),
                     "prompt_mask": torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])},
                    {"index": np.arange(2), "prompt": np.array(questions, dtype=object)}, {"step": 3, "validation": True})   # greedy
    out = Episodes(cfg, rollout, env, tok).generate(prompts)
    for i, q in enumerate(questions):
        seen = out["attention_mask"][i, width:].bool()
        response, model = out["responses"][i][seen].tolist(), out["response_mask"][i][seen].bool()
        runs = [[t for t, _ in run] for m, run in itertools.groupby(zip(response, model.tolist()), lambda x: x[1]) if m]
        turns = [hf.decode(run).removesuffix("<|im_end|>") for run in runs]      # a turn cut short has no stop token
        assert len(turns) == int(out["env/turns"][i]) == 3, f"episode {i}: {hf.decode(response)!r}"
        conversation = [{"role": "user", "content": q}]
        for k, t in enumerate(turns):
            conversation.append({"role": "assistant", "content": t})
            if k < len(turns) - 1:
                conversation.append({"role": "user", "content": "Say it again, shorter."})
        rendered = hf.apply_chat_template(conversation, tokenize=False)
        assert hf.decode(ids[i] + response) == rendered.rstrip("\n").removesuffix("" if out["has_eos"][i] else "<|im_end|>")
        ends = [k for k, (m, after) in enumerate(zip(out["response_mask"][i], out["response_mask"][i][1:])) if m and not after]
        assert torch.nonzero(out["turn_rewards"][i]).flatten().tolist() == ends[:2]     # the answered turns' last tokens
        assert tok.decode(out["responses"][i][int(out["final_turn"][i]):]) == turns[-1]
        assert out["rollout_log_probs"][i][seen][~model].eq(0).all() and out["rollout_log_probs"][i][seen][model].lt(0).all()
    fn = local_worker(RuleReward, str(smollm2), "test_environments:is_ground_truth")
    final = [tok.decode(out["responses"][i][int(out["final_turn"][i]):]) for i in range(2)]
    assert fn.compute_scores(out.union(Batch(arrays={"ground_truth": np.array(final, dtype=object)})))["scores"].tolist() == [1.0, 1.0]


def is_ground_truth(prompt, response, ground_truth, **_):
    return float(response == ground_truth)


class Flaky(Environment):
    """Row 0 raises, row 1 hangs, row 2 answers: episodes that fail are named, the others go on."""

    async def start(self, row):
        self.row = int(row["index"])

    async def step(self, text):
        if self.row == 0:
            raise RuntimeError("the simulator crashed")
        if self.row == 1:
            await asyncio.sleep(30)
        return Turn("=", reward=1.0, done=True)


def test_a_failing_or_hanging_environment_fails_its_episode_by_name(tmp_path):
    from hpcrl.models import create_model_dir
    from hpcrl.models.tokenizer import CharTokenizer
    from hpcrl.ppo.tasks import tool_sums

    model = create_model_dir(tmp_path / "m", CharTokenizer(tool_sums.ALPHABET), 1, hidden_size=64, layers=1, heads=2)
    cfg = TrainConfig.parse({"rollout": {"max_new_tokens": 4}, "environment": {"cls": "test_environments:Flaky",
                                                                               "step_timeout": 0.5, "failed_score": -1.0}})
    tok = load_tokenizer(model)
    env = local_worker(Environments, "test_environments:Flaky", {}, 0.5)
    said = []
    prompts = Batch({"prompt_ids": torch.tensor([tok.encode("1+2=")] * 3), "prompt_mask": torch.ones(3, 5, dtype=torch.long)},
                    {"index": np.arange(3)}, {"step": 1})
    # no turn may end without its stop token here: every turn goes to the environment
    rollout = local_worker(Rollout, str(model), cfg.updated(rollout={"max_new_tokens": 40}))
    out = Episodes(cfg.updated(rollout={"max_new_tokens": 40}), rollout, env, tok, said.append).generate(prompts)
    assert out["env/failed"].tolist() == [True, True, False]
    assert "step 1 sample 0 (dataset row 0): the environment's step raised RuntimeError: the simulator crashed" in said
    assert "step 1 sample 1 (dataset row 1): the environment's step timed out after 0.5 s" in said
    assert episode_scores(out.union(Batch({"scores": torch.tensor([0.5, 0.5, 0.5])})), -1.0).tolist() == [-1.0, -1.0, 0.5]
    lost = local_worker(Environments, "test_environments:Flaky", {}, 0.5)      # a rebuilt rank: its episodes are gone
    answer = lost.step_episodes(Batch(arrays={"episode": np.array(["step 1 sample 2"], dtype=object),
                                              "action": np.array(["5"], dtype=object)}))
    assert "step 1 sample 2: its environment was lost" in answer["failure"][0]


def test_gae_over_a_multi_turn_response_is_gae_over_the_models_tokens_alone():
    """Observations in the middle of a response: GAE skips them, as if the model's tokens were one
    sequence (numpy, on the model's tokens only)."""
    rng = np.random.default_rng(3)
    mask = np.array([[1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]])
    rewards, values = rng.normal(size=mask.shape) * mask, rng.normal(size=mask.shape)
    gamma, lam = 0.9, 0.8
    adv, _ = gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam)
    for row in range(2):
        keep = mask[row].astype(bool)
        r, v = rewards[row][keep], values[row][keep]
        want, last = np.zeros_like(r), 0.0
        for t in reversed(range(len(r))):
            last = r[t] + gamma * (v[t + 1] if t + 1 < len(r) else 0.0) - v[t] + gamma * lam * last
            want[t] = last
        np.testing.assert_allclose(adv[row].numpy()[keep], want, rtol=1e-10)
        assert np.all(adv[row].numpy()[~keep] == 0)


class Stuck(Tool):
    """Never answers in time: it awaits forever, or (arguments {"block": s}) blocks its thread s seconds."""
    name = "stuck"
    time_limit_s = 0.5

    async def __call__(self, arguments):
        if "block" in arguments:
            time.sleep(arguments["block"])
        else:
            await asyncio.sleep(3600)
        return "too late"


def stuck_threads() -> int:
    return sum(t.name == "tool stuck" for t in threading.enumerate())


def test_tool_calls_run_off_the_event_loop_and_a_stuck_one_is_cut_at_its_time_limit():
    """Calls that await forever or block their thread are cut at the tool's time limit and answered
    as tool errors; the environment's event loop, which every episode of the env rank shares, never
    waits on a call meanwhile (a ticker on it keeps ticking), and the call that awaited is cancelled."""
    env = ToolEnvironment(tools=["test_environments:Stuck", "calculator"])
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'
    text = (call.format("stuck", "{}") + call.format("stuck", '{"block": 3}')
            + call.format("calculator", '{"expression": "((10**1000)**1000)**1000"}'))

    async def step_and_ticks():
        ticks = [time.monotonic()]

        async def ticker():
            while True:
                await asyncio.sleep(0.01)
                ticks.append(time.monotonic())
        beat = asyncio.create_task(ticker())
        start = time.monotonic()
        turn = await env.step(text)
        took = time.monotonic() - start
        beat.cancel()
        return turn, took, max(b - a for a, b in zip(ticks, ticks[1:]))
    before = stuck_threads()
    turn, took, longest_gap = asyncio.run(step_and_ticks())
    cut = "error: stopped: stuck did not answer within its time limit of 0.5 s"
    assert [m["content"] for m in turn.observation] == [
        cut, cut, "error: the result is too large: the calculator works with integers of at most 1000 digits"]
    assert turn.info == {"tool_calls": 3, "tool_errors": 3}
    assert 0.5 <= took < 2.5 and longest_gap < 0.4, (took, longest_gap)
    deadline = time.monotonic() + 2.0      # the awaiting call was cancelled; the blocked one sleeps on (3 s)
    while stuck_threads() > before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stuck_threads() == before + 1


def test_the_python_tool_is_cut_at_its_wall_clock_and_a_sandbox_that_cannot_start_is_a_tool_error():
    env = ToolEnvironment(tools=[{"python": {"wall_s": 1}}])
    call = '<tool_call>{"name": "python", "arguments": {"code": "import time; time.sleep(1000)"}}</tool_call>'
    start = time.monotonic()
    turn = asyncio.run(env.step(call))
    assert "wall-clock time limit" in turn.observation[0]["content"] and turn.info["tool_errors"] == 1
    assert 1 <= time.monotonic() - start < 1 + env.all["python"].time_limit_s

    def no_processes(code, limits):
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
    env.all["python"].run = no_processes
    turn = asyncio.run(env.step(call))
    assert turn.observation[0]["content"] == ("error: the sandbox could not start: [Errno 11] Resource temporarily "
                                              "unavailable") and turn.info["tool_errors"] == 1


def test_the_python_tool_runs_in_the_sandbox_and_what_it_refuses_is_a_tool_error():
    # a wall-clock limit far above the CPU one: on a loaded machine the spin may get 1 CPU-s only after seconds
    env = ToolEnvironment(tools=[{"python": {"wall_s": 60, "cpu_s": 1}}])
    call = '<tool_call>{{"name": "python", "arguments": {{"code": {}}}}}</tool_call>'

    async def turns(*programs):
        await env.start({})
        return [await env.step(call.format(json.dumps(p))) for p in programs]
    ok, spin, peek = asyncio.run(turns("print(sum(range(10)))", "while True: pass", "print(open('/etc/passwd').read())"))
    assert ok.observation == [{"role": "tool", "content": "45"}] and ok.info == {"tool_calls": 1, "tool_errors": 0}
    assert "CPU time limit" in spin.observation[0]["content"] and spin.info["tool_errors"] == 1
    assert "FileNotFoundError" in peek.observation[0]["content"] and peek.info["tool_errors"] == 1
