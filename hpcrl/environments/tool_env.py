"""ToolEnvironment: the model calls tools in its chat template's format until it answers.

A turn with tool calls (Hermes `<tool_call>` JSON, tool_calls.py) gets one `tool` message per call,
the calls run at once; a turn without one is the answer: the episode ends there, and the reward
role scores it as it scores a single-turn response (train.reward). A malformed call, an unknown
tool, a call that fails (ToolError) or one cut at its tool's `time_limit_s` is answered with the
error, counted in `tool_errors`, and the model may try again. Each call runs in a thread of its
own on an event loop of its own: a tool that computes or blocks holds up neither the env rank's
loop (every other episode) nor the other calls. Rows in verl's multi-turn format name their tools in
`extra_info.tools_kwargs` ({tool name: {...}}): only those are callable in that episode.

    train:
      environment:
        cls: hpcrl.environments:ToolEnvironment
        kwargs: {tools: [calculator, {python: {wall_s: 5}}]}
"""
from __future__ import annotations

import asyncio
import contextlib
import threading

from hpcrl.environments.base import Environment, Turn
from hpcrl.environments.tool_calls import MalformedCall, ToolCall, parse_tool_calls
from hpcrl.environments.tools import Tool, ToolError, tool_class


class ToolEnvironment(Environment):
    """`tools`: built-in names (calculator, python), `module:Class`, or {name: keyword arguments};
    `max_calls`: tool calls run per turn (more are answered with an error)."""

    def __init__(self, tools: list = ("calculator",), max_calls: int = 4):
        made = [cls(**kwargs) for cls, kwargs in map(tool_class, tools)]
        self.all = {t.name: t for t in made}
        self.max_calls = max_calls
        self.callable = dict(self.all)

    @classmethod
    def tool_schemas(cls, tools: list = ("calculator",), **_) -> list[dict]:
        return [tool.schema() for tool, _ in map(tool_class, tools)]

    async def start(self, row: dict) -> None:
        named = ((row.get("extra_info") or {}).get("tools_kwargs") or {}) if isinstance(row.get("extra_info"), dict) else {}
        if named:
            unknown = sorted(set(named) - set(self.all))
            if unknown:
                raise ValueError(f"extra_info.tools_kwargs names tools {unknown} this environment does not have "
                                 f"(it has {sorted(self.all)}; add them to train.environment.kwargs.tools)")
            self.callable = {n: t for n, t in self.all.items() if n in named}

    async def step(self, text: str) -> Turn:
        calls = parse_tool_calls(text)
        if not calls:      # the counts still said: a step without any call logs 0, not nothing
            return Turn(done=True, info={"tool_calls": 0, "tool_errors": 0})
        answers = await asyncio.gather(*(self._answer(c) for c in calls[:self.max_calls]))
        if len(calls) > self.max_calls:
            answers += [(f"error: at most {self.max_calls} tool calls per turn; this one was not run", True)] * \
                (len(calls) - self.max_calls)
        errors = sum(failed for _, failed in answers)
        return Turn([{"role": "tool", "content": content} for content, _ in answers],
                    info={"tool_calls": len(calls), "tool_errors": errors})

    async def _answer(self, call: ToolCall | MalformedCall) -> tuple[str, bool]:
        """(what the model reads, whether the call failed)."""
        if isinstance(call, MalformedCall):
            return f"error: malformed tool call ({call.why})", True
        tool = self.callable.get(call.name)
        if tool is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.callable)})", True
        try:
            return await _call(tool, call.arguments), False
        except ToolError as e:
            return f"error: {e}", True


async def _call(tool: Tool, arguments: dict) -> str:
    """The tool's answer, from a thread of its own running the call on an event loop of its own.
    Past tool.time_limit_s (or when the episode's step is cancelled) the call is cancelled in its loop
    and answered as a ToolError; a call that blocks its thread without awaiting cannot be cancelled,
    and its thread is left to finish unheard (a daemon: it never holds up the process's exit)."""
    loop, own = asyncio.get_running_loop(), asyncio.new_event_loop()
    answer = loop.create_future()

    async def call():
        return await tool(arguments)
    task = own.create_task(call())      # the tool's code first runs in the thread, never on this loop

    def settle(result, error) -> None:
        if answer.done():       # the call was cut meanwhile
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)

    def run() -> None:
        try:
            outcome = own.run_until_complete(task), None
        except BaseException as e:   # noqa: BLE001 - the tool's own error (ToolError or not) goes to the episode
            outcome = None, e
        with contextlib.suppress(RuntimeError):    # the environment's loop closed meanwhile: no one waits
            loop.call_soon_threadsafe(settle, *outcome)
        own.run_until_complete(own.shutdown_default_executor())     # the tool's to_thread work, if it was cut
        own.close()
    threading.Thread(target=run, name=f"tool {tool.name}", daemon=True).start()
    try:
        return await asyncio.wait_for(answer, tool.time_limit_s)
    except asyncio.TimeoutError:
        raise ToolError(f"stopped: {tool.name} did not answer within its time limit of {tool.time_limit_s:g} s") from None
    finally:
        if not task.done():
            with contextlib.suppress(RuntimeError):     # its loop closed meanwhile: the call ended
                own.call_soon_threadsafe(task.cancel)
