"""Per-episode API keys: an episode's key is the HMAC of the run's endpoint secret and the episode's
name, so a key opens one episode of one run and nothing else, and the agent's process never holds
the secret it was derived from (only the driver and the serving ranks do)."""
from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path


def endpoint_secret(token_file: Path | None) -> bytes:
    """The run's endpoint secret: derived from the job's token where it has one (RUN_DIR/ray/token),
    else random (a local run)."""
    if token_file is not None and token_file.exists():
        return hmac.new(token_file.read_bytes().strip(), b"hpcrl openai endpoint", hashlib.sha256).digest()
    return secrets.token_bytes(32)


def episode_key(secret: bytes, episode: str) -> str:
    """The API key of one episode (what its agent's client sends as `Authorization: Bearer ...`)."""
    return "hpcrl-" + hmac.new(secret, episode.encode(), hashlib.sha256).hexdigest()
