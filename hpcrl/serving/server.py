"""The endpoint: an HTTP server thread in a generating rank's process, serving OpenAI's
/v1/completions, /v1/chat/completions (streaming too) and /v1/models to the agents of the
episodes open on it.

Every request carries its episode's key (`Authorization: Bearer <key>`, keys.py): a key that is
not one of an open episode of this run (made up, another run's, or of an episode already closed)
is answered 401 and nothing is sampled. The requests waiting at once are sampled together, in one
batch of the rank's engine (`sample`), seeded by the first of them (its episode's seed and its
place in the episode): which requests meet in a batch depends on when the agents send them, so an
agent's episodes are not bitwise reproducible as the built-in environments' are. Each request is
recorded under its episode (conversation.py) until the driver closes it and takes its record.
The env role's clients send the attempt they belong to (ATTEMPT_HEADER): an agent run again after
its env rank was rebuilt starts its episode's record afresh, without the lost attempt's requests.
An episode opened with `record=False` (the judge's, hpcrl/ppo/roles/judge.py, open for the whole
run) keeps no record and takes every request on its own: its requests are not one conversation,
and they are sampled together, not one after the other.
"""
from __future__ import annotations

import itertools
import json
import queue
import threading
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Sequence

from hpcrl.serving import openai_api
from hpcrl.serving.conversation import Conversation, Served
from hpcrl.serving.keys import episode_key

Sample = Callable[[list[list[int]], int, bool], list[tuple[list[int], list[float], bool]]]
"""sample(prompts' ids, seed, validation) -> for each prompt (its sampled ids, the stop token
included when it came; their log-probs; whether it stopped)"""
ATTEMPT_HEADER = "X-Hpcrl-Attempt"
"""names one run of an episode's agent (the env role's call that ran it)"""
MAX_BATCH = 256
"""requests sampled in one batch at most"""

MODEL = "policy"
"""the model's name in responses and /v1/models (any name a request gives is served by the policy)"""
JUDGE_MODEL = "judge"
"""the judge's endpoint's model name (hpcrl/ppo/roles/judge.py)"""


@dataclass
class OpenEpisode:
    name: str
    conversation: Conversation
    seed: int
    validation: bool
    policy_version: int
    record: bool = True
    """keep its requests as one conversation (an agent's episode); False: each on its own, unrecorded (the judge)"""
    requests: itertools.count = field(default_factory=itertools.count)
    attempt: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class Endpoint:
    """Serves on `host`, on the first of `ports` that is free (an ephemeral port where none is)."""

    def __init__(self, sample: Sample, tokenizer, max_new_tokens: int, host: str, ports: Sequence[int] = (),
                 model: str = MODEL):
        self.sample, self.tok, self.max_new_tokens, self.model = sample, tokenizer, max_new_tokens, model
        self.episodes: dict[str, OpenEpisode] = {}     # key -> open episode
        self.waiting: queue.Queue = queue.Queue()   # (prompt ids, seed, validation, Future) to sample
        self.server = _bind(host, [*ports, 0], self)
        for target, name in ((self.server.serve_forever, "hpcrl-openai-endpoint"), (self._sampler, "hpcrl-endpoint-sampler")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _sampler(self) -> None:
        """Samples what waits, in batches (a batch: the requests waiting when the last one ended)."""
        while True:
            batch = [self.waiting.get()]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            for validation in {b[2] for b in batch}:    # held-out episodes sample at their own temperature
                part = [b for b in batch if b[2] == validation]
                try:
                    results = self.sample([b[0] for b in part], part[0][1], validation)
                except Exception as e:   # noqa: BLE001 - each waiting request hears it
                    for b in part:
                        b[3].set_exception(e)
                    continue
                for b, result in zip(part, results):
                    b[3].set_result(result)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def open(self, secret: bytes, seeds: dict[str, int], validation: bool, policy_version: int,
             record: bool = True) -> None:
        """Episodes name -> seed are served from now on, each to the requests with its key."""
        for name, seed in seeds.items():
            self.episodes[episode_key(secret, name)] = OpenEpisode(name, Conversation(self.tok), seed, validation,
                                                                policy_version, record)

    def close(self, names: Sequence[str]) -> dict[str, list[dict]]:
        """Stop serving these episodes; each one's requests, in the order they were served (as
        Served.as_dict), for those that made any here."""
        wanted, out = set(names), {}
        for key in [k for k, e in self.episodes.items() if e.name in wanted]:
            episode = self.episodes.pop(key)
            with episode.lock:     # a request being sampled still lands in the record
                if episode.conversation.served:
                    out[episode.name] = [s.as_dict() for s in episode.conversation.served]
        return out

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, key: str | None, body: dict | None, attempt: str | None = None) -> tuple[int, dict | list[str]]:
        """(HTTP status, a JSON body or the events of a stream) for one request of `attempt`."""
        episode = self.episodes.get(key or "")
        if episode is None:
            return 401, openai_api.error("invalid API key: not the key of an episode open on this endpoint "
                                         "(each episode's agent gets its own)", "invalid_request_error", "invalid_api_key")
        if path == "/v1/models" and body is None:
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "hpcrl"}]}
        if path not in ("/v1/completions", "/v1/chat/completions") or body is None:
            return 404, openai_api.error(f"no such route: {path}", "invalid_request_error")
        chat = path == "/v1/chat/completions"
        try:
            prompt, tools, limit = openai_api.read_request(body, chat, self.max_new_tokens)
            with episode.lock if episode.record else nullcontext():
                if attempt is not None and attempt != episode.attempt:
                    if episode.attempt is not None:     # the agent runs again: the lost run's requests go
                        episode.conversation = Conversation(self.tok)
                    episode.attempt = attempt
                conversation = episode.conversation if episode.record else Conversation(self.tok)
                ids = conversation.chat_prompt(prompt, tools) if chat else conversation.completion_prompt(prompt)
                sampled: Future = Future()
                self.waiting.put((ids, episode.seed + (next(episode.requests) << 32), episode.validation, sampled))
                out, logprobs, eos = sampled.result()
                eos = eos and len(out) <= limit
                out, logprobs = out[:limit], logprobs[:limit]
                text = self.tok.decode(out)
                whole = openai_api.response(chat, self.model, text, eos, len(ids), len(out))
                reply = openai_api.normalise(whole["choices"][0]["message"]) if chat else text
                conversation.add(Served(ids, out, logprobs, eos, episode.policy_version, prompt, reply))
        except ValueError as e:   # a BadRequest, or text the tokenizer cannot encode
            return 400, openai_api.error(str(e), "invalid_request_error")
        except Exception as e:   # noqa: BLE001 - the engine failed: the agent hears it, the rank goes on
            return 500, openai_api.error(f"the engine failed: {type(e).__name__}: {e}", "server_error")
        if body.get("stream"):
            return 200, openai_api.stream_events(whole, bool((body.get("stream_options") or {}).get("include_usage")))
        return 200, whole


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024    # every episode of a batch may connect at once (the default backlog, 5, refuses them)


def _bind(host: str, ports: Sequence[int], endpoint: Endpoint) -> _Server:
    class Handler(_Handler):
        pass
    Handler.endpoint = endpoint
    for port in ports:
        try:
            return _Server((host, port), Handler)
        except OSError:
            continue
    raise OSError(f"no port free for the endpoint on {host}")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"     # keep-alive: an agent's client reuses its connection
    endpoint: Endpoint

    def do_GET(self):
        self._reply(*self.endpoint.answer(self.path, self._key(), None))

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError as e:
            self._reply(400, openai_api.error(f"the body is not JSON: {e}", "invalid_request_error"))
            return
        if not isinstance(body, dict):
            self._reply(400, openai_api.error("the body must be a JSON object", "invalid_request_error"))
            return
        self._reply(*self.endpoint.answer(self.path, self._key(), body, self.headers.get(ATTEMPT_HEADER)))

    def _key(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[len("Bearer "):].strip() if auth.startswith("Bearer ") else None

    def _reply(self, status: int, body: dict | list[str]) -> None:
        self.send_response(status)
        if isinstance(body, list):      # a stream: events until the connection closes
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for event in body:
                self.wfile.write(event.encode())
                self.wfile.flush()
            self.close_connection = True
            return
        data = json.dumps(body).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):      # noqa: A002 - one line per request would flood the role's log
        pass
