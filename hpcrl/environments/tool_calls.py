"""Tool calls in the Hermes format that Qwen's chat templates (and many others) teach their models:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*7"}}
    </tool_call>

`parse_tool_calls` finds them in a model's turn; `with_tool_prompt` describes the tools in that
format in the system message, for a chat template that does not render `tools` itself (SmolLM2's).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class MalformedCall:
    text: str
    why: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every <tool_call> block of the turn, in order: a ToolCall, or a MalformedCall saying what is
    wrong (the model is told, as a tool error, and may try again). An unclosed last block counts:
    the stop token may come before </tool_call>."""
    calls: list[ToolCall | MalformedCall] = []
    for body in (m.group(1).strip() for m in _CALL.finditer(text)):
        try:
            call = json.loads(body)
        except ValueError as e:
            calls.append(MalformedCall(body, f"not JSON ({e})"))
            continue
        except RecursionError:      # json reads nested arrays and objects by recursion
            calls.append(MalformedCall(body, "JSON nested deeper than it can be read"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(MalformedCall(body, 'needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):      # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):     # said below: not an object
                pass
        if not isinstance(arguments, dict):
            calls.append(MalformedCall(body, "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls


def tool_prompt(schemas: list[dict]) -> str:
    """A system-prompt section that describes `schemas` and the call format."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call functions to help with the user's request. Their signatures, inside "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n\nTo call one, write a JSON object with its name and "
            'arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function name>, "arguments": '
            "<arguments as a JSON object>}\n</tool_call>\nThe results come back in the next message. When you have "
            "the answer, reply without a tool call.")


def with_tool_prompt(messages: list[dict], schemas: list[dict]) -> list[dict]:
    """The conversation with the tools described at the start of its system message (one is added
    where it has none)."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{tool_prompt(schemas)}"}, *messages[1:]]
    return [{"role": "system", "content": tool_prompt(schemas)}, *messages]
