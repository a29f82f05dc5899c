"""Reward functions that hang (tests/test_restart.py): the copy task's score, until a given call
of the process, from which on they are stuck; HANG_FLAG (a file) says the hang happened."""
import os
import time

from hpcrl.ppo.tasks.copy_digits import score

SAFE_CALLS = 200       # the samples of about three steps of 64
calls = 0


def stuck_in_the_reward():
    while True:
        time.sleep(0.05)


def hangs_once(prompt: str, response: str, **fields) -> float:
    """Stuck at a call of step 4 or so, once in the run (a rebuilt process does not hang again)."""
    global calls
    calls += 1
    if calls > SAFE_CALLS and not os.path.exists(os.environ["HANG_FLAG"]):
        open(os.environ["HANG_FLAG"], "w").close()
        stuck_in_the_reward()
    return score(prompt, response)


def hangs_for_good(prompt: str, response: str, **fields) -> float:
    """Stuck at a call of step 4 or so, and at the first call of every process after that."""
    global calls
    calls += 1
    if calls > SAFE_CALLS or os.path.exists(os.environ["HANG_FLAG"]):
        open(os.environ["HANG_FLAG"], "w").close()
        stuck_in_the_reward()
    return score(prompt, response)
