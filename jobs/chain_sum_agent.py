"""The chain sums with a calculator (bench/tools.py's tools run, the built-in ToolEnvironment) as an agent
of your own, written against the `openai` package and the standard library alone: the GPU comparison of
issue 59 trains it with `train.environment.agent: hpcrl.jobs.chain_sum_agent:solve` in place of
`train.environment.cls: hpcrl.environments:ToolEnvironment`.

The model sees the calculator in the request's `tools` (the endpoint describes them in the system
message where the chat template does not render them, as the driver does for ToolEnvironment),
calls it in its native format, which comes back as `tool_calls`, and gets one `tool` message per
call, up to MAX_TURNS turns. The reward: 1 when the last number of the final answer is the ground
truth's (verl's reward_model.ground_truth), as the rule reward `last_number` scores it.
"""
from __future__ import annotations

import ast
import json
import operator
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:      # the client is given; the wheel imports this module without the agents extra
    import openai

MAX_TURNS = 4
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
                   "required": ["expression"]}}}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The expression's value, or what is wrong with it (short expressions of small numbers only)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"only numbers and + - * / // % ( ) are allowed, not {ast.unparse(node)!r}")
    if not isinstance(expression, str) or len(expression) > 200:
        return 'error: calculator needs {"expression": "<arithmetic of at most 200 characters>"}'
    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def last_number_right(text: str, truth: str) -> float:
    found = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
    return float(bool(found) and float(found[-1]) == float(truth))


async def solve(row: dict, client: openai.AsyncOpenAI) -> dict:
    messages = list(row["prompt"])
    calls = errors = 0
    for _ in range(MAX_TURNS):
        reply = (await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
        if not reply.message.tool_calls:
            break
        for call in reply.message.tool_calls:
            try:
                answer = calculate(json.loads(call.function.arguments).get("expression"))
            except (ValueError, AttributeError):
                answer = "error: the arguments are not a JSON object"
            calls, errors = calls + 1, errors + answer.startswith("error")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    final = messages[-1].get("content") if messages[-1]["role"] == "assistant" else ""
    return {"reward": last_number_right(final, row["reward_model"]["ground_truth"]),
            "info": {"tool_calls": calls, "tool_errors": errors}}
