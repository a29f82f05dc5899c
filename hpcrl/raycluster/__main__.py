"""python -m hpcrl.raycluster prepare|node|wait|stop RUN_DIR  (steps of the batch script)
   python -m hpcrl.raycluster satellite RUN_DIR ROLE RUN_ID  (the step of a satellite job: hpcrl scale)

prepare prints the bootstrap it chose (mpi or poll) on stdout, for the script to start the node step
accordingly; the job's bootstrap and srun --mpi plugin select it (hpcrl.env_vars.JobEnv)."""
import sys
import time
from pathlib import Path

from hpcrl.env_vars import JobEnv
from hpcrl.raycluster.node import run_node, run_satellite
from hpcrl.raycluster.session import prepare, request_stop, wait_ready


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "satellite":
        return run_satellite(Path(argv[1]), argv[2], argv[3])
    if len(argv) != 2 or argv[0] not in ("prepare", "node", "wait", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    cmd, run_dir = argv[0], Path(argv[1])
    if cmd == "prepare":
        try:
            env = JobEnv.read()
            c = prepare(run_dir, env.ray_start_timeout, env.bootstrap, env.mpi)
        except RuntimeError as e:
            print(f"[hpcrl] error: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"[hpcrl] ray: head {c['head']['name']} at {c['address']}, {len(c['nodes'])} nodes expected; "
              f"{c['bootstrap_why']}", file=sys.stderr, flush=True)
        print(c["bootstrap"], flush=True)
    elif cmd == "node":
        return run_node(run_dir)
    elif cmd == "wait":
        try:
            waited = wait_ready(run_dir)
        except RuntimeError as e:
            print(f"[hpcrl] error: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"[hpcrl] ray: all nodes joined after {waited:.2f}s (at {time.time():.3f})", flush=True)
    else:
        request_stop(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
