"""The `judge` role: a frozen model serving an OpenAI-compatible endpoint (hpcrl/serving) for the
whole run, for train.reward.fn to call (train.judge; docs: how-to/your-own-agent.md#an-llm-judge).

Each rank loads the judge's model into the run's rollout engine (torch, the CUDA-graph static cache,
or vLLM, as train.rollout.engine says) and, once started, serves one key: `judge_key(secret)`, the
HMAC of the run's endpoint secret and "judge", which only the reward role is given. Its requests are
not recorded (nothing of the judge is trained) and are sampled together, as many as wait at once,
at train.judge.temperature (0: greedy). Nothing ever loads other weights into it.

Where its ranks listen is not known before they start (the port its node's Ray port block keeps for
an endpoint may be taken by the policy's, on the same node): each rank publishes its URL in the Ray
cluster's key-value store under `hpcrl/judge/<rank>` (again when it is rebuilt), and the reward
role reads them there (`judge_urls`).
"""
from __future__ import annotations

from hpcrl.checkpoint.role import Checkpointed
from hpcrl.controller import Dispatch, Worker, register, startup
from hpcrl.engines.base import SamplingParams
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.roles.common import ModelRole
from hpcrl.ppo.roles.endpoint import endpoint_ports, sampled
from hpcrl.ppo.roles.rollout import make_rollout_engine
from hpcrl.serving.keys import episode_key
from hpcrl.serving.server import JUDGE_MODEL, Endpoint

_PUBLISHED = "hpcrl/judge/"
"""the Ray key-value store's prefix of the judge ranks' URLs"""


def judge_key(secret: bytes) -> str:
    """The API key of the judge's endpoint (what the reward role's client sends)."""
    return episode_key(secret, "judge")


def judge_urls() -> list[str]:
    """The base URLs of the judge's ranks, in rank order, as they published them (a rank rebuilt
    since its start: its new one)."""
    from ray.experimental import internal_kv

    keys = sorted(internal_kv._internal_kv_list(_PUBLISHED), key=lambda k: int(k.decode().rsplit("/", 1)[1]))
    return [internal_kv._internal_kv_get(k).decode() for k in keys]


class Judge(Checkpointed, ModelRole, Worker):
    """Serves `model_dir` (train.judge.model, else the policy's initial model) to the key of `secret`."""
    frozen = True    # its weights are the model's on disk: its file only records that it took part

    def __init__(self, model_dir: str, cfg: TrainConfig, secret: bytes):
        import ray
        from ray.experimental import internal_kv

        self.cfg, self.model_dir = cfg, cfg.judge.model or model_dir
        self.engine = make_rollout_engine(cfg, self.model_dir, self.rank, self.device)
        startup.mark("judge engine")
        self.endpoint = Endpoint(self._sample, load_tokenizer(self.model_dir), cfg.judge.max_new_tokens,
                                 ray.util.get_node_ip_address(), endpoint_ports(), model=JUDGE_MODEL)
        self.endpoint.open(secret, {"judge": cfg.seed * 1_000_003 + self.rank}, validation=False, policy_version=0,
                           record=False)
        internal_kv._internal_kv_put(f"{_PUBLISHED}{self.rank}", self.endpoint.url, overwrite=True)
        print(f"judge endpoint at {self.endpoint.url}, serving {self.model_dir}", flush=True)

    @register(Dispatch.ONE_TO_ALL)
    def url(self) -> str:
        """This rank's base URL."""
        return self.endpoint.url

    def _sample(self, prompts: list[list[int]], seed: int, validation: bool) -> list[tuple[list[int], list[float], bool]]:
        judge = self.cfg.judge
        return sampled(self.engine, prompts, SamplingParams(judge.max_new_tokens, judge.temperature), seed)
