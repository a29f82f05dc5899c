"""The live cluster as Slurm reports it, and the check of a HetJob against it.

    scontrol show partition / node      partitions and their state and limits, nodes' CPUs, memory,
                                        GRES and features
    scontrol show reservation           reservations (an sbatch_extra --reservation names one)
    sacctmgr show assoc / qos           the accounts this user may charge and the QoS each allows;
                                        only where accounting (slurmdbd) is on, else not checked
"""
from __future__ import annotations

import getpass
import re
import subprocess
from dataclasses import dataclass, field

from hpcrl.slurm.job import Gres, HetJob, format_mem, format_minutes, parse_time_minutes


class SlurmCommandError(RuntimeError):
    pass


def slurm_cmd(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> str:
    """Run a Slurm client command; its stderr becomes the error message."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        raise SlurmCommandError(f"{args[0]} not found: is this a Slurm login node? "
                                "(use --offline to skip the live cluster check)") from None
    if out.returncode != 0:
        raise SlurmCommandError(f"`{' '.join(args)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def parse_records(text: str) -> list[dict[str, str]]:
    """`scontrol show ... -o` output: one record per line of space-separated Key=Value pairs."""
    records = []
    for line in text.splitlines():
        rec, key = {}, None
        for token in line.split(" "):
            if "=" in token:
                key, _, value = token.partition("=")
                rec[key] = value
            elif key is not None and token:  # a value with spaces (e.g. Reason=Not responding)
                rec[key] += " " + token
        if rec:
            records.append(rec)
    return records


@dataclass
class Node:
    name: str
    addr: str
    cpus: int
    memory_mb: int
    gres: list[Gres]
    partitions: list[str]
    state: str
    features: list[str] = field(default_factory=list)


@dataclass
class Accounting:
    """What sacctmgr says this user may use: account -> the QoS its association allows."""
    user: str
    qos_of: dict[str, set[str]]
    all_qos: set[str]
    default_account: str = ""       # what a job without --account is charged to

    @classmethod
    def live(cls) -> Accounting | None:
        """None where accounting is off (sacctmgr cannot reach slurmdbd)."""
        user = getpass.getuser()
        try:
            assoc = slurm_cmd("sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={user}", "format=account,qos")
            qos = slurm_cmd("sacctmgr", "-n", "-P", "show", "qos", "format=name")
            default = slurm_cmd("sacctmgr", "-n", "-P", "show", "user", user, "format=defaultaccount").strip()
        except SlurmCommandError:
            return None
        qos_of: dict[str, set[str]] = {}
        for line in assoc.splitlines():
            account, _, allowed = line.partition("|")
            if account:
                qos_of.setdefault(account, set()).update(q for q in allowed.split(",") if q)
        return cls(user, qos_of, {q for q in qos.split() if q}, default)


@dataclass
class Partition:
    name: str
    state: str
    max_time_min: int | None  # None: UNLIMITED
    nodes: list[Node] = field(default_factory=list)


def _gres_list(text: str) -> list[Gres]:
    if not text or text == "(null)":
        return []
    return [Gres.parse(g) for g in text.split(",") if g]


@dataclass
class ClusterInfo:
    partitions: dict[str, Partition]
    nodes: dict[str, Node]
    reservations: set[str] | None = None     # None: not read
    accounting: Accounting | None = None     # None: accounting is off

    @classmethod
    def from_records(cls, partition_recs: list[dict], node_recs: list[dict], reservation_recs: list[dict] | None = None,
                     accounting: Accounting | None = None) -> ClusterInfo:
        nodes = {r["NodeName"]: Node(name=r["NodeName"], addr=r.get("NodeAddr", r["NodeName"]),
                                     cpus=int(r.get("CPUTot", 0)), memory_mb=int(r.get("RealMemory", 0)),
                                     gres=_gres_list(r.get("Gres", "")),
                                     partitions=[p for p in r.get("Partitions", "").split(",") if p],
                                     state=r.get("State", "UNKNOWN"),
                                     features=[f for f in r.get("AvailableFeatures", "").split(",")
                                               if f and f != "(null)"]) for r in node_recs}
        parts = {}
        for r in partition_recs:
            mt = r.get("MaxTime", "UNLIMITED")
            parts[r["PartitionName"]] = Partition(
                name=r["PartitionName"], state=r.get("State", "UNKNOWN"),
                max_time_min=None if mt == "UNLIMITED" else parse_time_minutes(mt),
                nodes=[n for n in nodes.values() if r["PartitionName"] in n.partitions])
        reservations = None if reservation_recs is None else {r["ReservationName"] for r in reservation_recs
                                                               if "ReservationName" in r}
        return cls(parts, nodes, reservations, accounting)

    @classmethod
    def live(cls) -> ClusterInfo:
        return cls.from_records(parse_records(slurm_cmd("scontrol", "show", "partition", "-o")),
                                parse_records(slurm_cmd("scontrol", "show", "node", "-o")),
                                parse_records(slurm_cmd("scontrol", "show", "reservation", "-o")),
                                Accounting.live())

    def check(self, job: HetJob) -> list[str]:
        """Every reason Slurm would reject or never start this job, each naming the spec field."""
        problems = []
        used_nodes: dict[str, int] = {}
        for c in job.components:
            src = c.source
            part = self.partitions.get(c.partition)
            if part is None:
                problems.append(f"{src}.partition: no partition {c.partition!r} on this cluster "
                                f"(available: {', '.join(sorted(self.partitions))})")
                continue
            if part.state != "UP":
                problems.append(f"{src}.partition: partition {c.partition!r} is {part.state}, not UP")
            if c.nodes > len(part.nodes):
                problems.append(f"{src}.nodes: {c.nodes} nodes asked, partition {c.partition!r} has "
                                f"{len(part.nodes)}")
            used_nodes[c.partition] = used_nodes.get(c.partition, 0) + c.nodes
            if c.gres is not None:
                fitting = [n for n in part.nodes if any(
                    g.name == c.gres.name and (c.gres.type is None or g.type == c.gres.type)
                    and g.count >= c.gres.count for g in n.gres)]
                if len(fitting) < c.nodes:
                    have = sorted({str(g) for n in part.nodes for g in n.gres}) or ["none"]
                    problems.append(f"{src}: gres {c.gres} per node on {c.nodes} node(s) is not available on "
                                    f"partition {c.partition!r} (its nodes have: {', '.join(have)})")
            if c.time_min is not None and part.max_time_min is not None and c.time_min > part.max_time_min:
                problems.append(f"{src}.time: {format_minutes(c.time_min)} is over partition {c.partition!r} "
                                f"MaxTime {format_minutes(part.max_time_min)}")
            if part.nodes and c.mem_mb is not None:
                biggest = max(n.memory_mb for n in part.nodes)
                if c.mem_mb > biggest:
                    problems.append(f"{src}.mem: {c.mem_mb} MB per node, the largest node of {c.partition!r} "
                                    f"has {biggest} MB")
            if part.nodes and c.cpus_per_task > max(n.cpus for n in part.nodes):
                problems.append(f"{src}.cpus_per_task: {c.cpus_per_task}, the largest node of {c.partition!r} "
                                f"has {max(n.cpus for n in part.nodes)} CPUs")
            if c.constraint:
                have = {f for n in part.nodes for f in n.features}
                for feature in _features(c.constraint):
                    if feature not in have:
                        problems.append(f"{src}.constraint: no node of partition {c.partition!r} has feature "
                                        f"{feature!r} (its features: {', '.join(sorted(have)) or 'none'})")
            problems += self._reservation_problems(c) + self._accounting_problems(c)
        # Components of one hetjob never share a node.
        for pname, n in used_nodes.items():
            part = self.partitions[pname]
            if n > len(part.nodes) and sum(c.partition == pname for c in job.components) > 1:
                srcs = [c.source for c in job.components if c.partition == pname]
                problems.append(f"{', '.join(srcs)}: together ask {n} nodes of partition {pname!r}, which has "
                                f"{len(part.nodes)}; hetjob components cannot share a node")
        return problems

    def _reservation_problems(self, c) -> list[str]:
        found = []
        for k, flag in enumerate(c.extra):
            option, _, value = str(flag).partition("=")
            if option == "--reservation" and self.reservations is not None:
                found += [f"{c.source}.sbatch_extra[{k}]: no reservation {name!r} on this cluster (reservations: "
                          f"{', '.join(sorted(self.reservations)) or 'none'})"
                          for name in value.split(",") if name not in self.reservations]
        return found

    def _accounting_problems(self, c) -> list[str]:
        """Account and QoS against the user's associations (nothing to check without accounting)."""
        acct = self.accounting
        if acct is None:
            return []
        found = []
        if c.account and c.account not in acct.qos_of:
            found.append(f"{c.source}.account: user {acct.user} has no account {c.account!r} here (accounts: "
                         f"{', '.join(sorted(acct.qos_of)) or 'none'})")
        account = c.account or acct.default_account
        for qos in c.qos.split(",") if c.qos else []:
            if qos not in acct.all_qos:
                found.append(f"{c.source}.qos: no QoS {qos!r} on this cluster (QoS: {', '.join(sorted(acct.all_qos))})")
            elif account in acct.qos_of and qos not in acct.qos_of[account]:
                under = f"account {account}" if c.account else f"the default account {account} (set account:)"
                found.append(f"{c.source}.qos: QoS {qos!r} is not allowed for user {acct.user} under {under} "
                             f"(allowed: {', '.join(sorted(acct.qos_of[account])) or 'none'})")
        return found

    def summary(self, job: HetJob) -> list[list[str]]:
        rows = [["component", "roles", "partition", "nodes", "gres/node", "cpus", "mem/node", "time", "MaxTime"]]
        for i, c in enumerate(job.components):
            part = self.partitions.get(c.partition)
            rows.append([str(i), ",".join(c.members), c.partition, str(c.nodes), str(c.gres or "-"),
                         str(c.cpus_per_task), format_mem(c.mem_mb) if c.mem_mb else "default",
                         format_minutes(c.time_min) if c.time_min else "default",
                         "UNLIMITED" if part is None or part.max_time_min is None
                         else format_minutes(part.max_time_min)])
        return rows


def _features(expression: str) -> list[str]:
    """The feature names of a --constraint expression (its operators and counts left out)."""
    names = []
    for token in re.split(r"[&|,\[\]()!]+", expression):
        name = token.split("*")[0]          # `rack1*2`: two nodes with feature rack1
        if name:
            names.append(name)
    return names


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)
