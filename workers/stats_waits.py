"""Stats requests the supervisor holds until every worker's snapshot includes the last request.

A `stats` answer is built from the workers' latest metrics snapshots. Right after a request
finished, those may predate it: the supervisor then asks each worker for a snapshot tagged with
a new sync id (queued behind all the worker did for the request) and holds the stats requests
made since until every worker's snapshot carries that id, or their deadline passes.
"""
from __future__ import annotations

import itertools
import time

STATS_SYNC_S = 5.0  # longest a stats reply waits for the snapshots that include the last request


class StatsWaits:
    """The held stats requests: (client identity, request id, sync id needed, deadline, the
    requests a stop string ended that the answer also waits for)."""

    def __init__(self, ask):
        self.ask = ask  # ask(sync_id): every worker is asked for a snapshot tagged sync_id
        self.pending: list[tuple] = []
        self.ids = itertools.count(1)
        self.sync = 0

    def synchronize(self) -> None:
        """A request finished (or workers started): stats requests from now on wait for the
        snapshots that include it."""
        self.sync = next(self.ids)
        self.ask(self.sync)

    def add(self, ident: bytes, rid: int, wait_s: float, stopping: frozenset) -> None:
        self.pending.append((ident, rid, self.sync, time.monotonic() + wait_s, stopping))

    def finished(self, key: tuple, stopped: bool) -> None:
        """Compute ended a request; one a stop string had ended for the client releases the
        stats requests waiting on it to wait for the new sync id instead."""
        self.synchronize()
        if stopped:
            self.pending = [(i, r, self.sync if key in w else s, d, w) for i, r, s, d, w in self.pending]

    def due(self, synced_all, stopping) -> list[tuple[bytes, int]]:
        """Removes and returns (identity, request id) of each request whose snapshots are in
        (synced_all(sync id)) and whose stopped requests all ended, or whose deadline passed."""
        now, due, waiting = time.monotonic(), [], []
        for ident, rid, sync, deadline, stops in self.pending:
            if (synced_all(sync) and not stops & stopping) or now > deadline:
                due.append((ident, rid))
            else:
                waiting.append((ident, rid, sync, deadline, stops))
        self.pending = waiting
        return due

    def take_all(self) -> list[tuple[bytes, int]]:
        """Removes and returns every held request (a restart or a stop answers them now)."""
        held, self.pending = [(ident, rid) for ident, rid, *_ in self.pending], []
        return held
