"""A component's container: how each step the batch script starts for it runs in its image.

    pyxis         srun --container-image=IMAGE --container-mounts=RUN_DIR:RUN_DIR,... --container-workdir=RUN_DIR CMD
    apptainer     srun ... apptainer exec [--nv] --bind RUN_DIR,... --pwd RUN_DIR [--env K=V] IMAGE CMD
    charliecloud  srun ... ch-run -b RUN_DIR ... -c RUN_DIR [--set-env=K=V] IMAGE -- CMD

The run directory is always mounted, at its own path; `mounts` adds more (SRC or SRC:DST).
`python` is hpcrl's interpreter inside the image. The steps that talk to Slurm (the allocation, the
deadline, the requeue, the satellites' end) stay on the host: an image carries no Slurm client.
Knows nothing about RL.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

RUNTIMES = {"pyxis": None, "apptainer": "apptainer", "charliecloud": "ch-run"}
"""runtime -> the command that runs an image (pyxis is srun's own plugin: srun runs it)."""


@dataclass(frozen=True)
class Container:
    runtime: str
    image: str
    python: str = "python3"
    mounts: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    flags: tuple[str, ...] = ()
    source: str = "container"      # the spec field it comes from, for messages

    @property
    def command(self) -> str | None:
        return RUNTIMES[self.runtime]

    @property
    def image_is_path(self) -> bool:
        """A file or folder, not a registry reference (pyxis: nvcr.io#nvidia/pytorch:24.05-py3,
        apptainer: docker://...); charliecloud runs folders only."""
        return self.runtime == "charliecloud" or self.image.startswith(("/", "./", "../"))

    def binds(self, run_dir: str) -> list[tuple[str, str]]:
        """(host path, path in the image): `mounts`, and the run directory unless one of them holds
        it. Charliecloud binds the host's /tmp itself (and refuses another bind under it)."""
        pairs = [tuple(m.split(":", 1)) if ":" in m else (m, m) for m in self.mounts]
        if not any(run_dir == d or run_dir.startswith(d.rstrip("/") + "/") for s, d in pairs if s == d):
            pairs.insert(0, (run_dir, run_dir))
        if self.runtime == "charliecloud":
            pairs = [(s, d) for s, d in pairs if not (d == "/tmp" or d.startswith("/tmp/"))]
        return pairs

    def srun_options(self, run_dir: str) -> list[str]:
        """What srun itself takes for this container (pyxis), as shell words."""
        if self.runtime != "pyxis":
            return []
        mounts = ",".join(f"{s}:{d}" for s, d in self.binds(run_dir))
        names = ",".join(k for k, _ in self.env)
        return [f"--container-image={self.image}", f"--container-mounts={mounts}", f"--container-workdir={run_dir}",
                *([f"--container-env={names}"] if names else []), *self.flags]

    def prefix(self, run_dir: str, gpus: bool) -> list[str]:
        """The words before a step's command: the runtime's command line up to the image (nothing
        for pyxis, whose image srun opens)."""
        binds = self.binds(run_dir)
        if self.runtime == "apptainer":
            return ["apptainer", "exec", *(["--nv"] if gpus else []), "--bind", ",".join(f"{s}:{d}" for s, d in binds),
                    "--pwd", run_dir, *[f"--env={k}={v}" for k, v in self.env], *self.flags, self.image]
        if self.runtime == "charliecloud":
            return ["ch-run", *[w for s, d in binds for w in ("-b", f"{s}:{d}")], "-c", run_dir,
                    *[f"--set-env={k}={v}" for k, v in self.env], *self.flags, self.image, "--"]
        return []

    def exports(self) -> list[tuple[str, str]]:
        """Variables the script exports before a pyxis step (--container-env passes them by name)."""
        return list(self.env) if self.runtime == "pyxis" else []

    def problems_here(self, run_dir: str) -> list[str]:
        """What keeps it from running, as far as this login node can tell (it usually sees the
        compute nodes' software and shared storage): a runtime command that is missing, an image
        path that does not exist, a Charliecloud folder image without the folder a bind needs
        (ch-run cannot make one in a read-only image), a mount whose host folder does not exist."""
        src, found = self.source, []
        if self.command and shutil.which(self.command) is None:
            found.append(f"{src}.runtime: {self.runtime} needs `{self.command}`, which is not on this node's PATH "
                         f"(install it, load its module in `setup:`, or choose another runtime)")
        for host, _ in self.binds(run_dir):     # the run directory (made at submission) and what holds it exist then
            if not (Path(host).exists() or Path(run_dir).is_relative_to(host)):
                found.append(f"{src}.mounts: {host} does not exist on this node (create it, or leave it out of mounts)")
        if self.image_is_path and not Path(self.image).exists():
            found.append(f"{src}.image: {self.image} does not exist (give the path of the "
                         f"{'image folder' if self.runtime == 'charliecloud' else 'image file'} on shared storage)")
        elif self.runtime == "charliecloud" and Path(self.image).is_dir():
            for host, inside in self.binds(run_dir):
                if not (Path(self.image) / inside.lstrip("/")).is_dir():
                    found.append(f"{src}: Charliecloud binds {host} at {inside}, which the image {self.image} lacks and "
                                 f"cannot make (read-only): mkdir -p {self.image}{inside}, or mount under /tmp")
        return found
