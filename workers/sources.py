"""compute's side of the data plane: where a layer's missing experts come from.

An `ExpertSource` answers a layer's `need` (the experts it lacks, read into staging slots and
copied into resident slots by `apply`, as the fills arrive), takes the uses compute served alone
(`used`), the gate's lookahead (`hint`) and, where it `takes_leases`, a later layer's experts asked
ahead (`leases`). A need or lease may carry the hints and uses compute would have sent just before
it (`hints`, `uses`) and the leases it would have sent right after (`Need.leases`), and the fills
applied together are acknowledged in one message (`Filled.more`): fewer messages, taken in the
same order. `RouterClient` is the process's source, over the data-plane socket;
`LocalExpertSource` calls the router and loader directly (tests and tools).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from deltafin.protocol import messages as M
from deltafin.runtime.metrics import Counter
from deltafin.runtime.store import Store
from deltafin.runtime.tiers import layer_groups


class RequestError(ValueError):
    """The request itself is wrong (empty prompt, too long, bad token id)."""

    code = M.ErrorCode.BAD_REQUEST


class ExpertUnavailable(RuntimeError):
    """A layer's experts could not be had (a read failed, the router refused, a wait timed out)."""

    def __init__(self, message: str, code: str = M.ErrorCode.EXPERT_UNAVAILABLE):
        super().__init__(message)
        self.code = code


@dataclass
class Granted:
    slots: list          # [(expert, slot)]
    hits: int
    wait_s: float
    pending: int = 0     # the early answer (`need` with early): the request whose fills `finish` waits for


class ExpertSource(Protocol):
    """What `SlotExperts` asks of a source. apply: called with each `M.Fill` / `M.FillFailed`
    the source receives, in compute's thread."""

    takes_leases: bool  # whether `need` is ever given leases (and `leases` called)
    messages: Counter

    def resident_slots(self, store: Store) -> dict | None:
        """{group: resident slots}, or None where the process learns them later (attach_pool)."""

    def need(self, layer: int, experts: list[int], apply: Callable, prefetch: bool = False,
             leases: list = (), hints: list | None = None, uses: list | None = None,
             early: bool = False) -> Granted: ...

    def finish(self, req: int, layer: int, missing: list[int], apply: Callable) -> Granted:
        """The rest of a need answered early (Granted.pending = req): applies its fills as they
        come, holds the others back until its final answer, then applies them."""

    def leases(self, items: list, hints: list | None = None) -> None:
        """Later layers' experts asked ahead, [(layer, experts, sure)], in one message."""

    def poll(self, apply: Callable) -> int: ...

    def used(self, uses: list, ahead: bool = False) -> None: ...

    def hint(self, hints: list) -> None: ...

    def release(self) -> None: ...


class LocalExpertSource:
    """Router and loader called directly: the in-process wiring used by tests and tools. Counts
    the messages compute would send (`messages`), as `RouterClient` does over the socket.

    It takes no leases (`need` never gets one): a lease's fills would land at once, while the
    layer that asked has not run (a victim could be one of its experts, used without a need);
    over the socket they are applied only at a later wait, after what the pass built is evaluated."""

    takes_leases = False

    def __init__(self, router, loader):
        self.router, self.loader, self.req = router, loader, 0
        self.messages = Counter()

    def resident_slots(self, store: Store) -> dict:
        """{group: resident slots} of the router's tables, named by the store's record layouts."""
        groups = set(layer_groups(store).values())
        if self.router.only is not None:
            if len(groups) != 1:
                raise ValueError("the store has several record layouts: give the router one slot "
                                 "group per layout (Router(groups=...))")
            return {groups.pop(): self.router.table.n_slots}
        return {g: t.n_slots for g, t in self.router.tables.items()}

    def need(self, layer: int, experts: list[int], apply, prefetch: bool = False, leases=(),
             hints: list | None = None, uses: list | None = None, early: bool = False) -> Granted:
        """Served whole, fills included (early or not: in-process nothing is read meanwhile)."""
        from deltafin.workers.router import RouterError
        self._notes(hints, uses)
        self.req += 1
        self.messages.add("need")
        t0 = time.perf_counter()

        def fill(msg):
            apply(msg)
            if isinstance(msg, M.Fill):
                self.messages.add("filled")
        try:
            reply = drive_need(self.router, self.req, layer, experts, self.loader.read, fill, prefetch)
        except RouterError as e:
            raise ExpertUnavailable(str(e), code=e.code) from None
        wait = time.perf_counter() - t0 if reply.hits < len(reply.slots) else 0.0
        return Granted([(e, s) for e, s, _ in reply.slots], reply.hits, wait)

    def finish(self, req: int, layer: int, missing: list[int], apply) -> Granted:
        raise NotImplementedError("the in-process source answers no need early")

    def leases(self, items: list, hints: list | None = None) -> None:
        raise NotImplementedError("the in-process source takes no leases (takes_leases is False)")

    def _notes(self, hints: list | None, uses: list | None) -> None:
        """What a need carries, taken first, as the router process takes it."""
        count_folded(self.messages, hints, uses)
        self.router.notes(hints, uses)

    def poll(self, apply) -> int:
        """In-process every fill is applied inside its need: nothing ever waits."""
        return 0

    def used(self, uses: list, ahead: bool = False) -> None:
        self.messages.add("used")
        self.router.used(uses)

    def hint(self, hints: list) -> None:
        self.messages.add("hint")
        self.router.notes(hints, None)

    def release(self) -> None:
        self.router.release()



class RouterClient:
    """compute's side of the data plane over the socket: `need` waits (applying the fills that
    arrive meanwhile), `used` does not."""

    takes_leases = True

    def __init__(self, sock, timeout_s: float, alive, fold: bool = True):
        self.sock, self.timeout_s, self.alive, self.req = sock, timeout_s, alive, 0
        self.fold = fold  # leases together in one message, acknowledgements together (bench.fold_sends)
        self.spin_s = 0.0  # polled without sleeping first, in a need's wait (bench.spin_ms, set at attach)
        self.messages = Counter()
        self.stash: deque = deque()  # messages `poll` read that only a need handles
        self.acks: list = []  # [staging, generation] of fills applied, not yet acknowledged (`_ack`)
        self.before_ack = None  # called before an acknowledgement is sent (the driver's copies waited for)

    def resident_slots(self, store: Store) -> None:
        """Not known at start: the supervisor tells the process when it attaches the pool."""
        return None

    def _fill(self, msg, apply) -> None:
        apply(msg)
        self.acks.append([msg.staging, msg.generation])
        if not self.fold:
            self._ack()

    def _ack(self) -> None:
        """The fills applied since the last acknowledgement, acknowledged in one `filled`: sent
        before any wait and before a poll or a need returns, so a staging slot is never held
        while compute waits for the router."""
        if not self.acks:
            return
        from deltafin.runtime.sockets import send
        if self.before_ack is not None:
            self.before_ack()
        (staging, generation), *more = self.acks
        self.acks = []
        send(self.sock, M.Filled(staging=staging, generation=generation, more=more or None))
        self.messages.add("filled")
        if more:
            self.messages.add("folded_filled", len(more))

    def poll(self, apply) -> int:
        """Applies, without waiting, the fills that arrived since the last need (prefetch reads
        that landed while compute was busy), so a layer counts them resident before it decides
        what to ask; returns how many. Anything else is kept for the next need."""
        from deltafin.runtime.sockets import recv
        n = 0
        try:
            while self.sock.poll(0):
                msg = recv(self.sock)
                if isinstance(msg, M.Fill):
                    self._fill(msg, apply)
                    n += 1
                elif isinstance(msg, M.FillFailed):
                    apply(msg)  # a read no need waits for failed: its slot is empty
                else:
                    self.stash.append(msg)
        finally:
            self._ack()
        return n

    def need(self, layer: int, experts: list[int], apply, prefetch: bool = False,
             leases: list = (), hints: list | None = None, uses: list | None = None,
             early: bool = False) -> Granted:
        """Sends the need (carrying hints and uses, if given), then `leases` ((layer, experts,
        sure) of later layers; or a callable giving them, called once the need is out), so the
        router reads them behind this need's reads (a list rides the need: `Need.leases`); waits
        for this need's `slots`. early: the router's early answer returns at once
        (Granted.pending: `finish` waits for the rest)."""
        from deltafin.runtime.sockets import send
        self.req += 1
        req = self.req
        folded = [] if callable(leases) or not self.fold else list(leases)
        send(self.sock, M.Need(req=req, layer=layer, experts=experts, prefetch=prefetch,
                               hints=hints or None, uses=uses or None, early=early,
                               leases=wire_leases(folded)))
        self.req += len(folded)
        self.messages.add("need")
        count_folded(self.messages, hints, uses)
        if folded:
            self.messages.add("folded_lease", len(folded))
        if not folded:
            self.leases(leases() if callable(leases) else leases)
        return self._answer(req, layer, lambda msg: self._fill(msg, apply), apply)

    def finish(self, req: int, layer: int, missing: list[int], apply) -> Granted:
        """The rest of a need answered early: its own fills are applied as they come; the
        others (leases' and prefetches') are held back, unacknowledged, until its final answer
        (compute has built on slots they may overwrite), then applied. No deadlock: the router
        answers early only where every read of the need already holds its staging slot."""
        held, mine = [], set(missing)

        def fill(msg) -> None:
            if msg.layer == layer and msg.expert in mine:
                self._fill(msg, apply)
            else:
                held.append(msg)
        try:
            return self._answer(req, layer, fill, apply, final=True)
        finally:
            for msg in held:
                self._fill(msg, apply)
            self._ack()

    def _answer(self, req: int, layer: int, fill, apply, final: bool = False) -> Granted:
        """Waits for need req's `slots` (with final, not an early one), fills going to fill(msg)."""
        try:
            return self._wait_answer(req, layer, fill, apply, final)
        finally:
            self._ack()

    def _wait_answer(self, req: int, layer: int, fill, apply, final: bool) -> Granted:
        from deltafin.runtime.sockets import recv, wait_readable
        while True:
            if self.stash:
                msg = self.stash.popleft()
            else:
                if self.acks and not self.sock.poll(0):
                    self._ack()  # nothing more to apply now: acknowledged before waiting
                try:
                    wait_readable(self.sock, self.timeout_s, self.alive, what=f"experts of layer {layer}",
                                  spin_s=self.spin_s)
                except (TimeoutError, ConnectionError) as e:
                    raise ExpertUnavailable(str(e)) from None
                msg = recv(self.sock)
            if isinstance(msg, M.Fill):
                fill(msg)
            elif isinstance(msg, M.FillFailed):
                apply(msg)
                if msg.req == req:
                    raise ExpertUnavailable(msg.error, code=M.ErrorCode.EXPERT_READ_FAILED)
            elif isinstance(msg, M.Error):  # the router's own code (budget_too_small)
                raise ExpertUnavailable(msg.message, code=msg.code)
            elif isinstance(msg, M.Slots) and msg.req == req and not (final and msg.pending):
                return Granted([(e, s) for e, s, _ in msg.slots], msg.hits, msg.wait_us / 1e6,
                               pending=req if msg.pending else 0)
            # else an older need's answer (one a timeout gave up on): dropped

    def leases(self, items: list, hints: list | None = None) -> None:
        """Asks ahead for later layers' experts, [(layer, experts, sure)] (no wait): one `need`
        with lease, the first's, carrying the rest (`Need.leases`; without fold, a message each)
        and the hints if given; sure: foreseen (Need.sure). Their fills are applied as they
        arrive, by a need's wait or `poll`."""
        from deltafin.runtime.sockets import send
        for i, group in enumerate([items] if self.fold else [[item] for item in items]):
            if not group:
                continue
            (layer, experts, sure), *rest = group
            self.req += 1
            send(self.sock, M.Need(req=self.req, layer=layer, experts=experts, lease=True, sure=sure,
                                   hints=(hints or None) if i == 0 else None, leases=wire_leases(rest)))
            self.req += len(rest)
            self.messages.add("foreseen" if sure else "lease")
            if rest:
                self.messages.add("folded_lease", len(rest))
        if items:
            count_folded(self.messages, hints, None)

    def used(self, uses: list, ahead: bool = False) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Used(uses=uses, ahead=ahead))
        self.messages.add("used")

    def hint(self, hints: list) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Hint(hints=hints))
        self.messages.add("hint")

    def release(self) -> None:
        from deltafin.runtime.sockets import send
        send(self.sock, M.Release(req=self.req))


def wire_leases(items: list) -> list | None:
    """[(layer, experts, sure)] as `Need.leases` carries them (None: none)."""
    return [[layer, experts, sure] for layer, experts, sure in items] or None


def count_folded(messages: Counter, hints, uses) -> None:
    """A need or lease that carried hints or uses: counted as `folded_hint` / `folded_used`."""
    if hints:
        messages.add("folded_hint")
    if uses:
        messages.add("folded_used")


def drive_need(router, req: int, layer: int, experts: list[int], read, fill,
               prefetch: bool = False, lease: bool = False) -> M.Slots | None:
    """One need (or lease) served in-process: read(order) -> Loaded | LoadFailed (the loader),
    fill(Fill) (compute applies it). Returns the `slots` answer (None for a lease: none is
    answered); raises RouterError for a failed read or a need that cannot be met."""
    from deltafin.workers.router import RouterError
    todo = deque(router.need(req, layer, experts, prefetch, lease))
    reply, failure = None, None
    while todo:
        _, msg = todo.popleft()
        if isinstance(msg, M.Read):
            got = read(msg)
            todo += router.load_failed(got) if isinstance(got, M.LoadFailed) else router.loaded(got)
        elif isinstance(msg, M.Fill):
            fill(msg)
            todo += router.filled(M.Filled(staging=msg.staging, generation=msg.generation))
        elif isinstance(msg, M.FillFailed):
            fill(msg)
            if msg.req == req:
                failure = msg
        elif isinstance(msg, M.Slots) and msg.req == req:
            reply = msg
    if failure is not None:
        raise RouterError(failure.error, code=M.ErrorCode.EXPERT_READ_FAILED)
    if reply is None and not lease:
        raise RouterError(f"need {req} of layer {layer} ended without an answer")
    return reply
