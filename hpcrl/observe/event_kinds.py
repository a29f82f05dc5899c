"""Every kind of event a run appends to RUN_DIR/events.jsonl (RunStatus.event), with its fields.

Each line is one JSON object: `time` (Unix seconds), `event` (the kind, a key of EVENTS) and the
kind's fields. The reference page docs/pages/reference/events.md is generated from EVENTS
(hpcrl/reference_docs.py); tests/test_reference_docs.py finds every `.event("kind", ...)` call in
hpcrl/ and checks that its kind and fields are here, and that a real run writes nothing else.
"""
from __future__ import annotations

from typing import NamedTuple


class EventKind(NamedTuple):
    meaning: str
    fields: dict[str, str]


EVERY_EVENT = {"time": "when it happened (Unix time, seconds)", "event": "its kind: one of those below"}
"""The fields every event has."""

EVENTS: dict[str, EventKind] = {
    "start": EventKind(
        "the driver started training: a fresh run, or a resumed one (a requeued job, `--resume`)",
        {"step": "the step training goes on after: 0, or the committed checkpoint it resumed from",
         "resumed": "whether it resumed from a checkpoint",
         "total_steps": "the steps the run trains to"}),
    "startup": EventKind(
        "a phase of this start of the job ended, before its first step (hpcrl/observe/startup.py names them): the "
        "run's own (queued or requeued, ray, driver, roles, validation, first_step) and each role rank's (process, "
        "group, imports, model, engine, rollout engine, built)",
        {"phase": "the phase",
         "role": "the role whose rank it is (null for the run's own phases)",
         "rank": "that rank (null for the run's own phases)",
         "seconds": "how long it took: from the end of the phase before (a rank's first, from its process's start)",
         "since_start": "from the beginning of this start (the submission, the end of the start before it, or "
                        "the driver's process start for a local run) to the end of the phase"}),
    "checkpoint": EventKind(
        "every role's file and the manifest of a step are written and committed",
        {"step": "the step checkpointed",
         "bytes": "the size of its files",
         "seconds": "from the start of the save to the commit"}),
    "checkpoint_interval": EventKind(
        "`train.checkpoint.save_every: auto` set the time between periodic checkpoints (after the first periodic "
        "one, and whenever it changes by more than half): the most training a lost node or a killed job loses",
        {"step": "the step of the checkpoint that measured it",
         "seconds": "the interval: the commit's cost / 5%, at least 10 s, at most 30 min",
         "cost": "the seconds that commit held training"}),
    "rebuild": EventKind(
        "a role's process died and the role is being rebuilt (new processes, its state from its newest snapshot "
        "or checkpoint, the calls made since replayed; the rollout role: the actor's weights sent again)",
        {"role": "the role",
         "step": "the step in progress",
         "generating": "the steps whose batches the rollout goes on generating meanwhile (pipelined runs; "
                       "`pipeline: async`: the buffer's batches, numbered as drawn; [] where the rollout is the role)"}),
    "rebuilt": EventKind(
        "the role is back, with the state it had",
        {"role": "the role",
         "step": "the step in progress",
         "seconds": "from the `rebuild` event: the new processes' start, then the state restored and the calls "
                    "since it made again",
         "phases": "where the new processes' start went: each phase of a rank's start (hpcrl/observe/startup.py: "
                   "process, group, imports, model, engine, rollout engine, built) and the seconds of the slowest "
                   "rank's; a process Ray had started ahead, idle, counts from the `rebuild` event",
         "restore": "where the time after the start went, seconds: `state` (the role's snapshot or checkpoint loaded), "
                    "`replay` (the `calls` state-changing calls made since it, made again), `after` (what waits for "
                    "the state: the new weights to a rollout)"}),
    "deadline": EventKind(
        "a kind of role call has a learned deadline (`train.deadlines`): after its first timed call, and whenever "
        "it has changed twofold",
        {"role": "the role",
         "step": "the step in progress",
         "call": "the kind of call, `role.method`",
         "seconds": "its deadline: `factor` times the slowest of its recent calls, at least `floor`"}),
    "hang": EventKind(
        "ranks of a role did not answer a call within its deadline: their Python stacks are in the role's logs and "
        "`hpcrl status`; they are rebuilt with their state and the call made again (a `rebuild` follows), or past "
        "`train.layout.restart_limit` the run stops at its last step, committed",
        {"role": "the role",
         "step": "the step in progress",
         "call": "the call, `role.method`",
         "ranks": "the ranks that had not answered",
         "deadline": "its deadline, seconds",
         "waited": "how long the driver waited, seconds"}),
    "resize": EventKind(
        "an elastic role took or lost nodes (`hpcrl scale`, a satellite job that joined or ended)",
        {"role": "the role",
         "step": "the step in progress",
         "from": "its ranks before",
         "to": "its ranks after",
         "why": "what changed: the nodes that joined or left",
         "seconds": "how long the resize took",
         "nodes": "its nodes now, each `name (origin)`: the job's component or a satellite"}),
    "resize_failed": EventKind(
        "an elastic role could not take its new nodes; it goes on with the nodes it has",
        {"step": "the step in progress",
         "error": "why"}),
    "weight_sync": EventKind(
        "the route the actor's weights take to a separate rollout role (`train.rollout.weight_transport`), chosen "
        "at the start and again after either role was rebuilt or resized",
        {"step": "the step in progress",
         "path": "`cuda_ipc` (every rollout rank on the GPU of the actor's rank 0), `collective` (a broadcast by a "
                 "torch.distributed group of the actor's rank 0 and the rollout's ranks) or `object_store` (Ray's)",
         "backend": "the collective's: `nccl` or `gloo` (null for the other paths)",
         "receivers": "the rollout's ranks",
         "seconds": "how long choosing the route and forming the group took"}),
    "stop": EventKind(
        "training stopped early at a committed checkpoint (Slurm's signal before the time limit or a preemption, "
        "the deadline, `hpcrl cancel`, a role that lost its state); the job requeues unless it was cancelled",
        {"step": "the last step done",
         "reason": "why it stopped"}),
    "finish": EventKind(
        "the run trained all its steps",
        {"step": "the last step, `train.total_steps`"}),
    "fail": EventKind(
        "the run failed with an error",
        {"step": "the step in progress",
         "error": "the error's type and last line, with the role, rank and method where a role raised it; or, "
                  "when the run directory refused a write (a full disk), why and how to go on",
         "origin": "where a role raised it: {role, rank, method} (absent when the driver raised it)",
         "traceback": "the traceback (its last 20000 characters)"}),
}
