"""Partial rollouts (train.rollout.partial_rollout: continue): responses generated a segment at a
time by the real TorchRollout are the responses generated whole, token for token; the rows a
checkpoint keeps read back as they were; an asynchronous run with them keeps its staleness bound
and resumes its rows."""
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import comparable, kill_dead, run_local, start_local_training, wait_until

from hpcrl.checkpoint.inflight import read_inflight
from hpcrl.controller.batch import Batch, object_array
from hpcrl.engines.base import SamplingParams
from hpcrl.engines.rollout.torch_rollout import TorchRollout
from hpcrl.models import CharTokenizer, create_model_dir, load_causal_lm
from hpcrl.observe.logs import read_calls
from hpcrl.observe.metrics import read_metrics
from hpcrl.observe.status import read_events
from hpcrl.ppo.config import TrainConfig
from hpcrl.ppo.generation import SegmentedProducer, VersionThroughput
from hpcrl.ppo.partial_rollouts import Row, absorb, continuation, rows_of, to_batch
from hpcrl.ppo.tasks import copy_digits

TOK = CharTokenizer(copy_digits.ALPHABET)


def prompts_batch(texts: list[str]) -> Batch:
    ids = [TOK.encode(t) for t in texts]
    width = max(map(len, ids))
    prompt = torch.full((len(ids), width), TOK.pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, seq in enumerate(ids):
        prompt[i, width - len(seq):], mask[i, width - len(seq):] = torch.tensor(seq), 1
    return Batch({"prompt_ids": prompt, "prompt_mask": mask},
                 {"group": np.arange(len(texts)), "prompt": object_array(texts)})


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    model_dir = create_model_dir(tmp_path_factory.mktemp("partial") / "m", TOK, 3, hidden_size=64, layers=2, heads=2)
    model = load_causal_lm(model_dir).eval().requires_grad_(False)
    # greedy, the random model never stops; its stop token made a little likelier than token 13 (which
    # it often picks) ends some rows early and others late
    model.lm_head.weight[TOK.stop_ids[0]] = 1.05 * model.lm_head.weight[13]
    return TorchRollout(model, TOK.pad_id, TOK.stop_ids)


@pytest.mark.parametrize("segment", [1, 3, 5])
def test_a_response_generated_a_segment_at_a_time_is_the_response_generated_whole(rollout, segment):
    """Greedy, so that a row's next token depends on its own tokens alone (not on which rows share a
    call, as the sampler's draws do): the segments, each call's prompts being the prompts and the
    tokens so far, give the tokens and log-probs of one call of max_new_tokens."""
    new_tokens = 12
    prompts = prompts_batch(["7=", "41=", "9062=", "3=", "88812=", "50="])
    whole = rollout.generate(prompts["prompt_ids"], prompts["prompt_mask"], SamplingParams(new_tokens, 0.0, 1.0, 0), 1)
    lengths = whole["response_mask"].sum(dim=1).tolist()
    assert len(set(lengths)) > 1, lengths       # some stop early, some later: rows leave the calls one by one

    rows, calls = rows_of(prompts), 0
    while going := [r for r in rows if not r.done]:
        calls += 1
        cont = continuation(going, TOK.pad_id)
        out = rollout.generate(cont["prompt_ids"], cont["prompt_mask"], SamplingParams(segment, 0.0, 1.0, 0), calls)
        absorb(going, Batch(out), calls, new_tokens)
    made = to_batch(rows, new_tokens, TOK.pad_id)
    for key in ("responses", "response_mask", "has_eos"):
        assert torch.equal(made[key], whole[key]), (segment, key, made[key], whole[key])
    torch.testing.assert_close(made["rollout_log_probs"], whole["rollout_log_probs"], atol=1e-5, rtol=0)
    assert torch.equal(made["input_ids"], torch.cat([prompts["prompt_ids"], whole["responses"]], dim=1))
    # each token's version is the call that sampled it: segment by segment
    expected = [[1 + i // segment for i in range(n)] + [-1] * (new_tokens - n) for n in lengths]
    assert made["token_versions"].tolist() == expected
    assert made["policy_version"].tolist() == [1] * len(rows) and calls == -(-max(lengths) // segment)


def test_a_segment_past_the_budget_is_cut_and_its_stop_token_with_it():
    """Hand-made call outputs: a row with 2 tokens left of its budget gets 2 of the segment's 3 and is
    done without a stop token; one whose segment ends in its stop token is done with it."""
    rows = [Row([5, 10], {"group": 0}, tokens=[1, 2, 3], logps=[-1.0] * 3, versions=[0] * 3), Row([6, 10], {"group": 1})]
    stop = TOK.stop_ids[0]
    out = Batch({"responses": torch.tensor([[4, 5, stop], [7, stop, TOK.pad_id]]),
                 "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "has_eos": torch.tensor([True, True]),
                 "rollout_log_probs": torch.tensor([[-0.5, -0.25, -0.125], [-2.0, -3.0, 0.0]])})
    assert absorb(rows, out, 7, max_new_tokens=5) == 2 + 2     # 2 of the first row's 3, the second's 2
    assert (rows[0].tokens, rows[0].versions, rows[0].eos, rows[0].done) == ([1, 2, 3, 4, 5], [0, 0, 0, 7, 7], False, True)
    assert (rows[1].tokens, rows[1].logps, rows[1].eos, rows[1].done) == ([7, stop], [-2.0, -3.0], True, True)
    made = to_batch(rows, 5, TOK.pad_id)
    assert made["response_mask"].tolist() == [[1] * 5, [1, 1, 0, 0, 0]]
    assert made["policy_version"].tolist() == [0, 7]      # each sample's oldest token's


def test_rows_kept_by_a_checkpoint_read_back_as_they_were():
    rows = [Row([3, 4, 10], {"group": np.int64(8), "prompt": "12=", "index": np.int64(5)}, [1, 2], [-0.5, -1.5], [2, 3]),
            Row([9, 10], {"group": np.int64(8), "prompt": "7=", "index": np.int64(6)}, [1, TOK.stop_ids[0]], [-1.0, -2.0],
                [3, 3], eos=True, done=True),
            Row([2, 2, 2, 10], {"group": np.int64(9), "prompt": "222=", "index": np.int64(7)})]
    kept = to_batch(rows, 6, TOK.pad_id, {"calls": 4, "drawn": 2})
    back = rows_of(kept)
    assert [(r.prompt, r.tokens, r.logps, r.versions, r.eos, r.done) for r in back] == \
           [(r.prompt, r.tokens, r.logps, r.versions, r.eos, r.done) for r in rows]
    assert [{k: (v, type(v)) for k, v in r.fields.items()} for r in back] == \
           [{k: (v, type(v)) for k, v in r.fields.items()} for r in rows]


class Prompts:
    batch_size = 2


def producer() -> SegmentedProducer:
    return SegmentedProducer(Prompts(), None, [], 2, 1, 10, segment=3, max_new_tokens=6, pad_id=TOK.pad_id)


def row(group: int, tokens: list[int], done: bool = False) -> Row:
    return Row([3, 4, 10], {"group": np.int64(group), "prompt": "12="}, list(tokens), [-0.5] * len(tokens),
               [1] * len(tokens), eos=done and len(tokens) < 6, done=done)


def test_a_producers_rows_kept_by_a_checkpoint_come_back_where_they_were():
    """The state a checkpoint takes mid-call (whole groups, a group half done, the call's rows as they
    were before it, the pool) resumed into a new producer: the same groups whole and in order, the
    half-done group waiting for its other row, the call's rows first in the pool with the tokens they
    had, and the call counted as not made (it is made again with its own seed)."""
    before = producer()
    before.whole = [[row(4, [5, 2], True), row(4, [6, 2], True)], [row(2, [2], True), row(2, [7, 7, 7, 7, 7, 7], True)]]
    before.partial = {5: [row(5, [2], True)]}
    before.calling = [row(5, [8, 8, 8]), row(6, [9])]
    before.pool = [row(7, []), row(7, [])]
    before.calls, before.drawn = 9, 4
    [kept] = before.held()()
    after = producer()
    after.resume(3, [kept])

    def seen(rows):
        return [(int(r.fields["group"]), r.tokens, r.versions, r.done) for r in rows]
    assert [seen(g) for g in after.whole] == [seen(g) for g in before.whole]
    assert {g: seen(rs) for g, rs in after.partial.items()} == {5: seen(before.partial[5])}
    assert seen(after.pool) == seen(before.calling + before.pool)
    assert (after.calls, after.drawn, after.open) == (8, 4, 5)


def test_the_rollouts_throughput_is_said_for_its_newest_version_so_far():
    t = VersionThroughput()
    assert t.said() == {}                        # no call back yet
    t.add(0, 100, 2.0)
    t.add(0, 50, 1.0)
    assert t.said() == {"throughput/rollout_tokens_per_s": 50.0, "throughput/rollout_version": 0}
    t.add(1, 30, 1.0)
    t.add(3, 8, 0.5)                             # (the rollout skipped version 2)
    assert t.said() == {"throughput/rollout_tokens_per_s": 16.0, "throughput/rollout_version": 3}
    t.add(3, 12, 0.5)
    assert t.said() == {"throughput/rollout_tokens_per_s": 20.0, "throughput/rollout_version": 3}


def test_an_async_run_with_partial_rollouts_resumes_its_rows(tmp_path):
    """pipeline: async, partial_rollout: continue on the copy task with long-tailed lengths, one
    token a call, a checkpoint at step 4. What it keeps are rows: responses in the making (tokens,
    versions, log-probs) and done ones; the resumed run's rollout calls go on from the kept call
    number (the seeds), and where the checkpoint held a whole batch of finished groups, the resumed
    step 5 is the uninterrupted step 5 bitwise (its batch is those groups). Which rows are done when
    the checkpoint is taken depends on how fast each side ran; the test prints it."""
    k, total = 2, 8
    cfg = TrainConfig(total_steps=total, rollout_role=True, save_every=4, progress=False, tis_cap=2.0).updated(
        data={"task_digits": 3, "task_digits_sigma": 0.8, "batch_size": 8},
        rollout={"max_new_tokens": 24, "n_samples": 4, "pipeline": "async", "max_staleness": k,
                 "partial_rollout": "continue", "segment_tokens": 1},
        algorithm={"advantage": "grpo", "kl_coef": 0.0}, optim={"mini_batch_size": 32},
        checkpoint={"keep_last": 2})
    once, twice = tmp_path / "once", tmp_path / "twice"
    records = run_local(once, cfg)
    assert all(0 <= r["policy/lag"] for r in records), records
    assert all(r["rollout/versions_per_response"] >= 1 for r in records)
    said = [(r["throughput/rollout_version"], r["throughput/rollout_tokens_per_s"]) for r in records
            if "throughput/rollout_version" in r]
    assert said and all(v <= w for (v, _), (w, _) in zip(said, said[1:])) and all(t > 0 for _, t in said), said
    calls = [c for c in read_calls(once)["rollout"] if c["method"] == "generate_sequences"]
    assert [c["step"] for c in sorted(calls, key=lambda c: c["start"])] == list(range(1, len(calls) + 1))

    manifest = json.loads((once / "ckpt" / "step_00000004" / "MANIFEST.json").read_text())
    [kept] = read_inflight(once / "ckpt" / manifest["inflight"]["path"])
    rows = rows_of(kept)
    assert rows and all(r.versions == sorted(r.versions) and all(0 <= v <= 3 for v in r.versions) for r in rows)
    assert all(len(r.tokens) == len(r.logps) <= 24 and (r.done or not r.eos) for r in rows)
    groups = {}
    for r in rows:
        groups.setdefault(int(r.fields["group"]), []).append(r)
    whole = [g for g, rs in groups.items() if len(rs) == 4 and all(r.done for r in rs)]

    shutil.copytree(once, twice, ignore=shutil.ignore_patterns("ray", "logs"))
    shutil.rmtree(twice / "ckpt" / "step_00000008")
    (twice / "ckpt" / "LATEST").write_text("step_00000004\n")
    resumed = run_local(twice, cfg)
    assert [r["step"] for r in resumed] == list(range(1, total + 1))
    again = sorted(c["step"] for c in read_calls(twice)["rollout"] if c["method"] == "generate_sequences")
    assert again and again[0] == kept.meta["calls"] + 1, (again, kept.meta)
    print(f"kept {len(rows)} rows ({sum(not r.done for r in rows)} in the making), {len(whole)} whole groups, "
          f"calls {kept.meta['calls']}")
    if len(whole) >= cfg.data.batch_size:
        [a], [b] = comparable(resumed[4:5]), comparable(records[4:5])
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def test_a_rollout_killed_mid_call_is_rebuilt_and_the_call_made_again(tmp_path):
    """The rollout's process killed while partial rollouts go on (one token a call, so a call is nearly
    always in flight): the call it was in, or the next one, fails; the driver's thread rebuilds the
    role, sends it the weights and makes the call again, and the run trains every step."""
    run, total = tmp_path / "run", 40
    cfg = TrainConfig(total_steps=total, rollout_role=True, progress=False, save_every=0).updated(
        data={"task_digits": 3, "task_digits_sigma": 0.8, "batch_size": 8},
        rollout={"max_new_tokens": 24, "n_samples": 4, "pipeline": "async", "max_staleness": 2,
                 "partial_rollout": "continue", "segment_tokens": 1},
        algorithm={"advantage": "grpo", "kl_coef": 0.0}, optim={"mini_batch_size": 32})
    proc = start_local_training(run, cfg)
    wait_until(lambda: len(read_metrics(run / "metrics.jsonl")) >= 3 if (run / "metrics.jsonl").exists() else False,
               300, "3 steps")
    pid = json.loads((run / "status.json").read_text())["roles"]["rollout"]["ranks"][0]["pid"]
    kill_dead(pid)
    assert proc.wait(timeout=600) == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, total + 1))
    # another process, which the weights reached again (the route chosen anew: a weight_sync event after the first)
    assert json.loads((run / "status.json").read_text())["roles"]["rollout"]["ranks"][0]["pid"] != pid
    events = read_events(run)
    assert sum(e["event"] == "weight_sync" for e in events) >= 2
    assert [(e["event"], e["role"]) for e in events if e["event"] in ("rebuild", "rebuilt")] == \
        [("rebuild", "rollout"), ("rebuilt", "rollout")]
