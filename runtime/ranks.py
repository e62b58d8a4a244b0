"""What the supervisor needs to know of an mx.distributed group without importing MLX: the
exit codes compute ends with when its group is lost (workers/distributed.py), and this tree's
rank from the environment mlx.launch sets."""
from __future__ import annotations

import json
import os

RANK_LOST_EXIT = 75     # compute's exit code when a peer rank died or stopped answering
OUT_OF_STEP_EXIT = 76   # compute's exit code when its own error left the group out of step


def peer_note(rank: int | None, size: int) -> str:
    if rank is None or size < 2:
        return "this rank lost its distributed group: a peer rank died or stopped answering"
    peers = [r for r in range(size) if r != rank]
    return f"rank {rank} of {size} lost its distributed group: peer rank(s) {peers} died or stopped answering"


def launch_rank() -> tuple[int, int] | None:
    """(rank, size) from the environment mlx.launch sets (MLX_RANK, and MLX_HOSTFILE for ring and
    JACCL) or mpirun sets (OMPI_COMM_WORLD_*, PMI_*), for the supervisor's messages; None where
    none is set."""
    for rank_key, size_key in (("MLX_RANK", None), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank = os.environ.get(rank_key)
        if rank is None:
            continue
        if size_key is not None:
            return int(rank), int(os.environ.get(size_key, 0) or 0)
        try:
            with open(os.environ.get("MLX_HOSTFILE", "")) as f:
                return int(rank), len(json.load(f))
        except (OSError, ValueError):
            return int(rank), int(os.environ.get("MLX_WORLD_SIZE", 0) or 0)
    return None
