"""What the supervisor needs to know of an mx.distributed group without importing MLX: the
exit codes compute ends with when its group is lost (workers/distributed.py), and this tree's
rank from the environment mlx.launch sets."""
from __future__ import annotations

import json
import os

RANK_LOST_EXIT = 75     # compute's exit code when a peer rank died or stopped answering
OUT_OF_STEP_EXIT = 76   # compute's exit code when its own error left the group out of step


def peer_note(rank: int, size: int) -> str:
    peers = [r for r in range(size) if r != rank]
    return f"rank {rank} of {size} lost its distributed group: peer rank(s) {peers} died or stopped answering"


def launch_rank() -> tuple[int, int] | None:
    """(rank, size) from the environment mlx.launch sets (MLX_RANK, and MLX_HOSTFILE for ring),
    for the supervisor's messages; None where it is not set."""
    rank = os.environ.get("MLX_RANK")
    if rank is None:
        return None
    size = 0
    try:
        with open(os.environ.get("MLX_HOSTFILE", "")) as f:
            size = len(json.load(f))
    except (OSError, ValueError):
        size = int(os.environ.get("MLX_WORLD_SIZE", 0) or 0)
    return int(rank), size
