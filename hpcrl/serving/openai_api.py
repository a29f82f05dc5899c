"""The bodies of OpenAI's /v1/completions and /v1/chat/completions: what is read of a request,
and the response, whole or as server-sent-event chunks (`stream: true`).

What the endpoint honours of a request: the prompt or messages, `tools`, `max_tokens` (or
`max_completion_tokens`, at most train.rollout.max_new_tokens), `stream`, `stream_options`.
Sampling is the run's (train.rollout's temperature, top_p, top_k; the validation's for held-out
prompts): the trainer's importance ratios assume the distribution the tokens were drawn from, so
`temperature`, `top_p`, `seed`, `stop` and the like are ignored; `n` > 1 is refused (one
completion per request: send several requests, each is recorded).
"""
from __future__ import annotations

import json
import time
import uuid

from hpcrl.environments.tool_calls import ToolCall, parse_tool_calls
from hpcrl.serving.conversation import normalise


class BadRequest(ValueError):
    """A request the endpoint cannot serve; the message says why (HTTP 400)."""


def read_request(body: dict, chat: bool, max_new_tokens: int) -> tuple[object, list[dict] | None, int]:
    """(the prompt: text, token ids or normalised messages; the tools; max tokens) of a request body."""
    if int(body.get("n", 1) or 1) != 1:
        raise BadRequest("n must be 1: the endpoint samples one completion per request (send several requests)")
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or max_new_tokens
    if not isinstance(limit, int) or limit < 1:
        raise BadRequest(f"max_tokens must be a positive integer, not {limit!r}")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("messages must be a non-empty list of messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadRequest("tools must be a list of tool schemas")
        return [normalise(m) for m in messages], tools, min(limit, max_new_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]      # a batch of one prompt
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt))):
        raise BadRequest("prompt must be one text or one list of token ids")
    return prompt, None, min(limit, max_new_tokens)


def assistant_message(text: str) -> tuple[dict, str]:
    """The model's turn as an OpenAI assistant message: the tool calls in its native format
    (hpcrl/environments/tool_calls.py) as `tool_calls`, the text before them as content. Returns
    (the message, its finish reason when the turn stopped by itself)."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
    if not calls:
        return {"role": "assistant", "content": text}, "stop"
    content = text[:text.find("<tool_call>")].strip() or None
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]}, \
        "tool_calls"


def response(chat: bool, model: str, text: str, eos: bool, prompt_tokens: int, completion_tokens: int) -> dict:
    """The whole response body; for chat also the assistant message it answers with."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    if chat:
        message, reason = assistant_message(text)
        return {**head, "object": "chat.completion", "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": reason if eos else "length",
                             "logprobs": None}]}
    return {**head, "object": "text_completion", "usage": usage,
            "choices": [{"index": 0, "text": text, "finish_reason": "stop" if eos else "length", "logprobs": None}]}


def stream_events(whole: dict, include_usage: bool) -> list[str]:
    """The response as the server-sent events OpenAI streams: the completion in one content chunk
    (the endpoint answers once the turn is sampled), then its finish reason, then [DONE]."""
    chat = whole["object"] == "chat.completion"
    head = {k: whole[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    choice = whole["choices"][0]
    if chat:
        message = choice["message"]
        delta = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        chunks = [{"index": 0, "delta": delta, "finish_reason": None},
                  {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]
    else:
        chunks = [{"index": 0, "text": choice["text"], "finish_reason": None},
                  {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]
    events = [{**head, "choices": [c]} for c in chunks]
    if include_usage:
        events.append({**head, "choices": [], "usage": whole["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def error(message: str, kind: str, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
