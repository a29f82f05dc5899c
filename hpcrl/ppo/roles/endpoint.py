"""The generating role's OpenAI-compatible endpoint (hpcrl/serving): what a rank of rollout (or
actor_rollout) serves to the agents of train.environment.agent while the driver waits for them.

The driver opens a batch's episodes on every rank (`open_episodes`: the first call starts the
rank's server, on the node's address and the port its Ray port block keeps for it), the env role
runs the agents against the ranks' URLs, and the driver closes the episodes and takes their
records (`close_episodes`). The agents' requests are sampled by the rank's own engine, between
the driver's calls: nothing else generates meanwhile.
"""
from __future__ import annotations

import threading

from hpcrl.controller import Dispatch, register
from hpcrl.engines.base import SamplingParams
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.ppo.data import left_padded
from hpcrl.serving.server import Endpoint


def endpoint_ports() -> list[int]:
    """The port this node's Ray port block keeps for the endpoint (none where Ray's node manager
    is not on an hpcrl port block: a local run)."""
    import ray

    from hpcrl.raycluster.ports import ENDPOINT_PORT, NODE_PORTS

    me = ray.get_runtime_context().get_node_id()
    manager = next((n["NodeManagerPort"] for n in ray.nodes() if n["NodeID"] == me), None)
    return [manager - NODE_PORTS["node-manager-port"] + ENDPOINT_PORT] if manager else []


class ServesEndpoint:
    """Mixed into Generates: needs `cfg`, `rank`, `rollout` (the engine), `model_dir`, `policy_version`."""
    endpoint: Endpoint | None = None

    @property
    def engine_lock(self) -> threading.Lock:
        """Held while the endpoint's thread samples, and by the driver's calls that load weights into
        the engine (a sync issued while agents run, one step off): the weights never change under a
        batch being sampled, and each request's record names the weights that sampled it."""
        if "_engine_lock" not in self.__dict__:     # made on the rank's own thread, before the endpoint's
            self.__dict__["_engine_lock"] = threading.Lock()
        return self.__dict__["_engine_lock"]

    @register(Dispatch.ONE_TO_ALL)
    def open_episodes(self, secret: bytes, seeds: dict[str, int], validation: bool) -> str:
        """Serve these episodes (name -> seed of its first request) to requests with their keys;
        returns this rank's base URL."""
        self.engine_lock     # noqa: B018 - made here, on the rank's thread, before the endpoint's thread uses it
        if self.endpoint is None:
            import ray

            self.endpoint = Endpoint(self._sample, load_tokenizer(self.model_dir), self.cfg.rollout.max_new_tokens,
                                     ray.util.get_node_ip_address(), endpoint_ports())
        self.endpoint.open(secret, seeds, validation, self.policy_version)
        return self.endpoint.url

    @register(Dispatch.ONE_TO_ALL)
    def close_episodes(self, names: list[str]) -> dict[str, list[dict]]:
        """Stop serving these episodes; the requests each made here, in order."""
        records = self.endpoint.close(names) if self.endpoint is not None else {}
        if self.shares_device:
            self.rollout.sleep()     # vLLM beside the trainer: free its memory for the update
        return records

    def _sample(self, prompts: list[list[int]], seed: int, validation: bool) -> list[tuple[list[int], list[float], bool]]:
        temperature = self.cfg.validation.temperature if validation else self.cfg.rollout.temperature
        r = self.cfg.rollout
        with self.engine_lock:
            return sampled(self.rollout, prompts, SamplingParams(r.max_new_tokens, temperature, r.top_p, r.top_k), seed)


def sampled(engine, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[tuple[list[int], list[float], bool]]:
    """What an endpoint's `sample` returns (hpcrl/serving/server.py), of one batch of `engine`."""
    batch = left_padded(prompts, engine.pad_id, {})
    out = engine.generate(batch["prompt_ids"], batch["prompt_mask"], params, seed)
    lengths = out["response_mask"].sum(dim=1).tolist()
    return [(out["responses"][i, :n].tolist(), out["rollout_log_probs"][i, :n].tolist(), bool(out["has_eos"][i]))
            for i, n in enumerate(lengths)]
