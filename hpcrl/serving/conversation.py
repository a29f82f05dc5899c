"""One episode's requests as token ids: what the engine was given and what it sampled.

An agent sends its whole conversation again with every request (OpenAI's API is stateless), as
text or chat messages. Encoding that text again would not give the tokens the model produced (a
tokenizer may split the same text otherwise, a template may render a turn otherwise), so a
request that continues an earlier one of its episode (its prompt is that request's prompt and
the reply it got, then more) is built from the earlier request's token ids as they were, with
only what the agent added encoded:

    completions   prompt text = earlier prompt + earlier completion + rest
                  -> earlier prompt ids + sampled ids + encode_followup(rest)
    chat          messages = earlier messages + the assistant reply it got + new messages
                  -> earlier prompt ids + sampled ids (+ a stop token if it was cut) +
                     encode_followup(new messages): the chat template's tokens after a turn

A request that continues none is encoded whole (the first of an episode, or a branch). The driver
then chains the requests into trajectories (hpcrl/ppo/agent_episodes.py).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from hpcrl.environments.tool_calls import with_tool_prompt


@dataclass
class Served:
    """One request as the engine served it."""
    prompt_ids: list[int]
    output_ids: list[int]
    """as sampled, its stop token included when it stopped"""
    logprobs: list[float]
    """the sampler's log-prob of each output token"""
    eos: bool
    """it ended with a stop token (not cut at max_tokens)"""
    policy_version: int
    sent: object = None
    """the agent's prompt (text, or normalised chat messages), to know a request that continues it"""
    reply: object = None
    """what the agent got (the completion text, or the normalised assistant message)"""

    def as_dict(self) -> dict:
        return asdict(self)


def normalise(message) -> dict:
    """A chat message as compared between requests: role, text content, tool calls (name, arguments)."""
    content = message.get("content")
    if isinstance(content, list):      # content parts: their text, in order
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append({"name": function.get("name"), "arguments": arguments})
    out = {"role": message.get("role"), "content": content or ""}
    if calls:
        out["tool_calls"] = calls
    return out


def template_message(message: dict) -> dict:
    """A normalised message as chat templates take it (tool calls with their arguments as objects)."""
    out = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "function": c} for c in message["tool_calls"]]
    return out


class Conversation:
    """The requests of one episode; `tok`: the policy's tokenizer (hpcrl/models/tokenizer.py)."""

    def __init__(self, tok):
        self.tok = tok
        self.served: list[Served] = []

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a /v1/completions prompt (text, or token ids taken as they are)."""
        if isinstance(prompt, list):
            return [int(i) for i in prompt]
        for s in reversed(self.served):
            if isinstance(s.sent, str) and isinstance(s.reply, str) and prompt.startswith(s.sent + s.reply):
                rest = prompt[len(s.sent) + len(s.reply):]
                return s.prompt_ids + s.output_ids + (self.tok.encode_followup(rest) if rest else [])
        return self.tok.encode(prompt)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The token ids of a /v1/chat/completions conversation (`messages` normalised)."""
        for s in reversed(self.served):
            if isinstance(s.sent, list) and len(messages) > len(s.sent) + 1 and messages[:len(s.sent)] == s.sent \
                    and messages[len(s.sent)] == s.reply:
                after = [template_message(m) for m in messages[len(s.sent) + 1:]]
                return s.prompt_ids + s.output_ids + ([] if s.eos else self.tok.stop_ids[:1]) + \
                    self.tok.encode_followup(after)
        rendered = [template_message(m) for m in messages]
        if tools and not self.tok.renders_tools:
            return self.tok.encode_chat(with_tool_prompt(rendered, tools))
        return self.tok.encode_chat(rendered, tools or None)

    def add(self, served: Served) -> None:
        self.served.append(served)
