"""Experts sharded across hosts: the compute processes of N supervisor trees as one MLX
distributed group (`mx.distributed`, ring backend over TCP/Thunderbolt, or MPI), each rank
owning a disjoint share of every MoE layer's experts. docs/DISTRIBUTED.md has the launch commands.

Who owns what (`ExpertShare`): expert e of a layer belongs to rank e % N, or, given a routing
trace (distributed.balance_trace), each layer's experts are dealt out by their use in the trace,
most used first, each to the rank with the least use so far (ties to the lower rank), so every
rank reads and computes about the same share. A rank's router and loader only ever see its own
experts: its compute asks for nothing else, so its slot tables, its reads and its budget hold
only that share.

One MoE layer (`ShardedExperts`): every rank computes the gate (dense layers are replicated), then
only the (token, k) pairs whose expert it owns, into an [N, k, D] tensor that is zero elsewhere;
`all_sum` over the group gives every rank the same full [N, k, D] tensor the single-host run
computes. Exact, not approximately: each (token, k) entry is computed by exactly one rank with
the same kernels and the same rows as on one host (the chunked path's `run_pairs`, bit-identical
to the all-resident path), and every other rank contributes +0.0, and x + 0.0 == x in every
float format whatever order the ring adds in. The weighting by the router's scores and the sum
over k then run on identical inputs, so logits and tokens equal the single-host run bit for bit.
(Summing the already weighted [N, D] outputs instead would send k times fewer bytes but change
the summation order, and so the last bits.)

Lockstep (`Lockstep`): rank 0 serves clients; the others follow its steps by running the same
requests through the same code. Every exchange is an `all_sum` on the group, never a transport of
our own: rank 0 contributes the values, the others zeros. When idle, every loop turn of every
rank's compute runs one header exchange ([command, payload bytes]); a request is announced by a
header and its msgpack bytes (with rank 0's seed filled in), then every rank runs it; between
tokens one more exchange carries rank 0's stop (a cancel). All ranks see identical logits, so
they pick identical tokens and stop at the same place. Launching a pass ahead of need
(`can_overlap`) is off: it depends on each rank's own cache.

Faults (fail-stop): a collective that raises (the ring reports a closed peer within about a
second) or that does not finish within distributed.timeout_s (a peer that hangs; a watchdog
thread sees it) ends the compute process with RANK_LOST_EXIT. Its supervisor answers every
request in flight with `rank_lost` naming the peer ranks, and restarts its workers, which join
the group again; the peers, whose next collective fails the same way, do the same. An error
on one rank after a request's collectives began (its own disk failed) also ends it that way:
the group is out of step and cannot go on.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import zlib

import mlx.core as mx
import numpy as np

from deltafin.protocol import messages as M
from deltafin.runtime.config import Config
from deltafin.runtime.models.switch import run_pairs
from deltafin.runtime.ranks import OUT_OF_STEP_EXIT, RANK_LOST_EXIT
from deltafin.runtime.store import Store
from deltafin.workers.slot_experts import SlotExperts
from deltafin.workers.sources import ExpertUnavailable, RequestError


IDLE, REQUEST, STOP = 0, 1, 2


class NotLeader(RequestError):
    code = M.ErrorCode.NOT_LEADER


# -- who owns which expert -----------------------------------------------------------------------------
@dataclasses.dataclass
class ExpertShare:
    """owner[layer][expert] -> rank, for every MoE layer."""
    rank: int
    size: int
    owner: dict

    @classmethod
    def modulo(cls, store: Store, rank: int, size: int) -> "ExpertShare":
        table = np.arange(store.n_experts) % size
        return cls(rank, size, {layer: table for layer in store.moe_layers})

    @classmethod
    def balanced(cls, store: Store, rank: int, size: int, counts: np.ndarray) -> "ExpertShare":
        """counts[moe layer index, expert]: uses in a routing trace. Per layer, experts in order
        of use (most first, then by id), each to the rank with the least use so far."""
        owner = {}
        for i, layer in enumerate(store.moe_layers):
            load = np.zeros(size, dtype=np.int64)
            table = np.empty(store.n_experts, dtype=np.int64)
            for e in sorted(range(store.n_experts), key=lambda e: (-int(counts[i, e]), e)):
                r = int(np.argmin(load))  # the first of the least loaded
                table[e] = r
                load[r] += int(counts[i, e])
            owner[layer] = table
        return cls(rank, size, owner)

    @classmethod
    def from_trace(cls, store: Store, rank: int, size: int, path) -> "ExpertShare":
        from deltafin.runtime.traces import load_trace
        ids = load_trace(path).ids
        if ids.shape[1] != len(store.moe_layers) or int(ids.max()) >= store.n_experts:
            raise ValueError(f"trace {path}: {ids.shape[1]} MoE layers / expert ids up to {int(ids.max())} "
                             f"do not fit the store ({len(store.moe_layers)} layers, {store.n_experts} experts)")
        counts = np.stack([np.bincount(ids[:, i].reshape(-1).astype(np.int64), minlength=store.n_experts)
                           for i in range(ids.shape[1])])
        return cls.balanced(store, rank, size, counts)

    def digest(self) -> str:
        """CRC-32 of the owner tables in layer order: equal on every rank of a group (stats)."""
        crc = 0
        for layer in sorted(self.owner):
            crc = zlib.crc32(self.owner[layer].astype(np.int64).tobytes(), crc)
        return f"{crc:08x}"

    def mine(self, layer: int) -> list[int]:
        return np.nonzero(self.owner[layer] == self.rank)[0].tolist()

    def of(self, layer: int, rank: int) -> list[int]:
        return np.nonzero(self.owner[layer] == rank)[0].tolist()


# -- the group: collectives under a watchdog --------------------------------------------------------------
class Group:
    """The MLX distributed group and a watchdog: a collective that raises or outlasts timeout_s
    ends the process (fail-stop, RANK_LOST_EXIT), naming the peers."""

    def __init__(self, timeout_s: float, backend: str = "ring", join_timeout_s: float = 180.0):
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s
        self.limit = join_timeout_s  # the running collective's; joining waits for every rank to start
        self.since: float | None = None
        self.what = ""
        self.count = 0  # collectives run, so a caller can tell whether a request began its exchanges
        self.bytes = 0  # bytes this rank contributed to them
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="distributed-watchdog", daemon=True)
        self._thread.start()
        self._enter("joining the group", join_timeout_s)
        try:
            self.group = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as e:
            self.fail(f"cannot join the group: {e}")
        finally:
            self.since = None
        self.rank, self.size = self.group.rank(), self.group.size()

    def peers(self) -> list[int]:
        return [r for r in range(getattr(self, "size", 0)) if r != getattr(self, "rank", -1)]

    def _enter(self, what: str, limit: float | None = None) -> None:
        self.what, self.limit = what, limit or self.timeout_s
        self.since = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            since = self.since
            if since is not None and time.monotonic() - since > self.limit:
                self.fail(f"{self.what}: no answer from the group within {self.limit:g} s")

    def fail(self, why: str, code: int = RANK_LOST_EXIT) -> None:
        """Ends the process at once: a broken group cannot be joined again from inside it."""
        rank = getattr(self, "rank", os.environ.get("MLX_RANK", "?"))
        print(f"deltafin compute: rank {rank}: distributed group lost (peer rank(s) "
              f"{self.peers() or 'unknown'}): {why}", file=sys.stderr, flush=True)
        os._exit(code)

    def all_sum(self, x: mx.array, what: str, limit: float | None = None) -> mx.array:
        """all_sum over the group, evaluated now, under the watchdog: `limit` seconds
        (default distributed.timeout_s)."""
        self._enter(what, limit)
        try:
            y = mx.distributed.all_sum(x, group=self.group)
            mx.eval(y)
        except RuntimeError as e:  # the ring's "connection to a peer was lost"
            self.fail(f"{what}: {e}")
        finally:
            self.since = None
        self.count += 1
        self.bytes += x.nbytes
        return y

    def close(self) -> None:
        self._stop.set()


# -- the provider ----------------------------------------------------------------------------------------
class ShardedExperts(SlotExperts):
    """SlotExperts for one rank's share: computes only its own experts' (token, k) pairs, zeros
    elsewhere, and sums the partial [N, k, D] over the group. Built by `sharded_class`."""

    share: ExpertShare
    group: Group

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exchange_bytes = 0
        self.exchanges = 0
        self.route_crc = 0  # CRC-32 of every routing this rank computed, compared between tokens
        self.group.provider = self

    def _route(self, ids: np.ndarray) -> None:
        self.route_crc = zlib.crc32(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), self.route_crc)

    def can_overlap(self) -> bool:
        return False  # each rank's cache differs: every rank must launch the same passes

    def _own_per_group(self) -> dict:
        n = dict.fromkeys(self.tier.n_slots, 0)
        for layer in self.store.moe_layers:
            n[self.tier.group_of[layer]] += len(self.share.mine(layer))
        return n

    def preload_step(self) -> bool:
        """As SlotExperts.preload_step, for the rank's own share: where its slots hold the share."""
        if self.tier is None:
            return False
        own = self._own_per_group()
        for layer in self.store.moe_layers:
            g = self.tier.group_of[layer]
            mine = self.share.mine(layer)
            missing = self.tier.missing(layer, mine)
            if self.tier.n_slots[g] < own[g] or not missing:
                continue
            self.counters.add("preloaded", len(missing))
            self.flush()
            self.source.need(layer, mine, self.apply, prefetch=True)
            self.tier.settle_writes()
            return True
        return False

    def _exchange(self, partial: mx.array, layer: int) -> mx.array:
        y = self.group.all_sum(partial, f"layer {layer} expert exchange")
        self.exchanges += 1
        self.exchange_bytes += partial.nbytes
        return y

    def fetch(self, layer: int) -> None:
        """The stand-in: own experts read and filled, and the exchange a real layer makes."""
        ids = self.routing.choose(layer, None)
        self._route(ids)
        own = ids[self.share.owner[layer][ids] == self.share.rank]
        experts = np.unique(own).tolist()
        cap = self.tier.n_slots[self.tier.group_of[layer]]
        reported = False
        for i in range(0, len(experts), cap):
            reported = self.ensure(layer, experts[i:i + cap]) or reported
            self.tier.settle_writes()  # no graph reads the pools here
        self._note(layer, ids, report=False, count=False)
        if not reported and own.size:
            self.unreported.append((self.pass_no, layer, own, False))
        hidden = int(self.store.config.get("hidden_size", 1))
        self._exchange(mx.zeros((*ids.shape, hidden), dtype=self.dtype), layer)

    def __call__(self, layer: int, x, inds):
        ids = self.routing.choose(layer, inds)
        if isinstance(ids, mx.array):
            self.counters.add("gate_syncs")
        flat = self._host(ids).reshape(-1, ids.shape[-1])  # every rank reads the same ids
        self._route(flat)
        tier = self.tier
        w, quant = tier.weights(layer), tier.quant(layer)
        lead, k, d = inds.shape[:-1], flat.shape[-1], x.shape[-1]
        x2, ids1 = x.reshape(-1, d), flat.reshape(-1)
        mine = np.nonzero(self.share.owner[layer][ids1] == self.share.rank)[0]
        experts = np.unique(ids1[mine]).tolist()
        cap = tier.n_slots[tier.group_of[layer]]
        reported = False
        pieces, order = [], []
        for i in range(0, len(experts), cap):
            chunk = experts[i:i + cap]
            reported = self.ensure(layer, chunk) or reported
            pairs = mine[np.isin(ids1[mine], chunk)]
            pairs = pairs[np.argsort(ids1[pairs], kind="stable")]  # grouped by expert
            pieces.append(run_pairs(x2, k, pairs, tier.slots(layer, ids1[pairs]), w, quant, ids1.size))
            order.append(pairs)
        # The router hears only of its own experts' uses.
        self._note(layer, flat, report=False, count=False)
        if not reported and mine.size:
            self.unreported.append((self.pass_no, layer, ids1[mine], False))
        n = ids1.size
        if pieces:
            # every (token, k) not ours points at one extra zero row: +0.0 in the sum
            y = mx.concatenate(pieces + [mx.zeros((1, d), dtype=pieces[0].dtype)], axis=0)
            where = np.full(n, len(mine), dtype=np.int64)
            where[np.concatenate(order)] = np.arange(len(mine))
            partial = y[mx.array(where)]
        else:
            partial = mx.zeros((n, d), dtype=x.dtype)
        if partial.dtype != x.dtype:  # every rank must send the same dtype, whatever it computed
            raise ExpertUnavailable(f"layer {layer}: experts gave {partial.dtype}, activations are {x.dtype}")
        return self._exchange(partial, layer).reshape(*lead, k, d)


def sharded_class(share: ExpertShare, group: Group) -> type:
    """ShardedExperts bound to one rank's share and group, for Compute(experts_cls=...)."""
    return type("ShardedExperts", (ShardedExperts,), {"share": share, "group": group})


# -- lockstep of the ranks' requests ---------------------------------------------------------------------
class Lockstep:
    """Rank 0 leads, the others follow: every request, every between-token decision, every idle
    turn is one exchange on the group (module docstring)."""

    def __init__(self, group: Group, share: ExpertShare):
        self.group, self.share = group, share
        self.leader = group.rank == 0
        self.began = None  # group.count when the running request was announced

    @classmethod
    def from_config(cls, config: Config, store: Store) -> "Lockstep | None":
        dc = config.distributed
        if not dc.enabled:
            return None
        group = Group(dc.timeout_s, dc.backend, config.runtime.startup_timeout_s)
        trace = dc.balance_trace
        share = (ExpertShare.from_trace(store, group.rank, group.size, trace) if trace
                 else ExpertShare.modulo(store, group.rank, group.size))
        print(f"deltafin compute: rank {group.rank} of {group.size}, owns "
              f"{sum(len(share.mine(l)) for l in store.moe_layers)} of "
              f"{store.n_experts * len(store.moe_layers)} experts "
              f"({'balanced by ' + trace if trace else 'expert % ranks'})", file=sys.stderr, flush=True)
        return cls(group, share)

    @property
    def experts_cls(self) -> type:
        return sharded_class(self.share, self.group)

    def info(self) -> dict:
        return {"rank": self.group.rank, "size": self.group.size, "leader": self.leader,
                "share": self.share.digest(),
                "owned": sum(len(self.share.mine(l)) for l in self.share.owner),
                "collectives": self.group.count, "sent_bytes": self.group.bytes}

    # -- exchanges --
    def _header(self, cmd: int, nbytes: int, limit: float | None = None) -> tuple[int, int]:
        h = mx.array([cmd, nbytes] if self.leader else [0, 0], dtype=mx.int32)
        out = np.array(self.group.all_sum(h, "idle turn" if cmd == IDLE else "request header", limit))
        return int(out[0]), int(out[1])

    def _payload(self, data: bytes | None, nbytes: int) -> bytes:
        arr = np.zeros(nbytes, dtype=np.int32)
        if self.leader:
            arr[:] = np.frombuffer(data, dtype=np.uint8)
        out = np.array(self.group.all_sum(mx.array(arr), "request"))
        return out.astype(np.uint8).tobytes()

    def agree_stop(self, stop: bool) -> bool:
        """Between tokens: rank 0's stop (a cancel) for every rank, and rank 0's routing digest,
        which each follower checks against its own: ranks whose dense math differs (other
        hardware or MLX versions) would pick other experts and tokens and fall out of step, so
        such a follower stops at once, saying why, instead of computing wrong outputs."""
        provider = getattr(self.group, "provider", None)
        crc = (provider.route_crc if provider is not None else 0) & 0x7FFFFFFF
        h = mx.array([1 if stop else 0, crc] if self.leader else [0, 0], dtype=mx.int32)
        out = np.array(self.group.all_sum(h, "between tokens"))
        if not self.leader and int(out[1]) != crc:
            self.group.fail("routing diverged from rank 0's (every rank needs the same hardware class "
                            "and the same MLX and deltafin versions)", code=OUT_OF_STEP_EXIT)
        return bool(out[0])

    # -- rank 0 --
    def lead(self, req, between_tokens):
        """Announces the request (with its seed fixed) to the followers; returns the request to
        run and the between-tokens hook that carries rank 0's stop to them."""
        if not self.leader:
            raise NotLeader(f"rank {self.group.rank} follows rank 0: send requests to rank 0's endpoint")
        if isinstance(req, M.Generate) and req.seed is None:
            req = dataclasses.replace(req, seed=int.from_bytes(os.urandom(4), "little"))
        data = M.encode(req)
        self.began = self.group.count
        self._header(REQUEST, len(data))
        self._payload(data, len(data))

        def between() -> bool:
            return self.agree_stop(bool(between_tokens()) if between_tokens else False)
        return req, between

    def after_error(self, error: BaseException) -> None:
        """A request failed on this rank: where its exchanges had begun past the announcement,
        the peers wait in a collective this rank will never run: fail-stop."""
        if self.began is not None and self.group.count > self.began + 2:
            self.group.fail(f"this rank failed mid-request ({error}); the group is out of step",
                            code=OUT_OF_STEP_EXIT)
        self.began = None

    def done(self) -> None:
        self.began = None

    # -- every rank, every idle loop turn --
    def idle(self, compute) -> bool:
        """One header exchange; a follower runs the request it announces. False once rank 0
        said stop (the follower's compute should end)."""
        # Idle ranks meet here once per loop turn; start-up (dense weights, the supervisor's
        # measurement) can keep one rank from its loop for long, so the start-up timeout applies.
        cmd, nbytes = self._header(IDLE, 0, self.group.join_timeout_s)
        if cmd == STOP:
            return False
        if cmd != REQUEST or self.leader:
            return True
        req = M.decode(self._payload(None, nbytes))
        before = self.group.count
        try:
            if isinstance(req, M.Generate):
                done = compute.generate(req, between_tokens=lambda: self.agree_stop(False))
                if done.finish_reason == "cancelled":
                    compute.abandon()  # as rank 0 does after a cancel
            else:
                compute.logits(list(req.token_ids), name=str(req.id))
        except RequestError as e:
            # refused before any exchange, the same way on every rank
            compute.abandon()
            if self.group.count != before:
                self.group.fail(f"request {req.id} failed mid-way on this rank: {e}", code=OUT_OF_STEP_EXIT)
        except (ExpertUnavailable, Exception) as e:  # noqa: B014 - named for the reader
            self.group.fail(f"request {req.id} failed on this rank: {type(e).__name__}: {e}",
                            code=OUT_OF_STEP_EXIT)
        return True

    def stop(self) -> None:
        """Rank 0 leaving: tells the followers (best effort)."""
        if self.leader:
            try:
                self._header(STOP, 0)
            except Exception:
                pass
        self.group.close()
