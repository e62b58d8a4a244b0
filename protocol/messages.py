"""Every message deltafin processes and clients exchange: msgpack maps, validated on decode.

A message is a msgpack map with "type" (a name below) and the fields of that type. Decoding
checks the type, every required field and every field's kind; anything else raises
ProtocolError, which receivers answer with an `error` message instead of crashing.
No pickle, and no expert bytes: messages carry slot references, never weights.
docs/PROTOCOL.md documents the client-facing types for peers in any language.
The codec (protocol/codec.py) is used through this module, whose import registers every type
that `decode` reads: `M.encode`, `M.decode`, `M.ProtocolError` and the frame limits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum

from deltafin.protocol.codec import (MAX_ITEMS, MAX_MESSAGE_BYTES, MAX_STOP_STRINGS, REGISTRY,
                                     ProtocolError, decode, decode_request, encode, message, short)

PROTOCOL_VERSION = 1
# Room a bulk result leaves for the rest of its message and the supervisor-compute envelope, so
# a logits reply admitted by `check_request` always fits in one frame on every hop.
ENVELOPE_BYTES = 1 << 20
MAX_RESULT_BYTES = MAX_MESSAGE_BYTES - ENVELOPE_BYTES
# An error message longer than this is cut (an error never echoes a large request back).
MAX_ERROR_CHARS = 1024
MAX_TOP_LOGPROBS = 20  # the most likely tokens a token message may list (OpenAI's bound)
# A temperature below this samples greedily: dividing float32 logits by a smaller one overflows
# to infinities, and the draw among them is near random.
GREEDY_BELOW_TEMPERATURE = 1e-5


def greedy(temperature: float) -> bool:
    """Whether a request's temperature means greedy decoding (0, or below the floor)."""
    return temperature < GREEDY_BELOW_TEMPERATURE


class BadRequest(ValueError):
    """A well-formed request the runtime refuses (answered with code `bad_request`)."""


# --------------------------------------------------------------------------------------------
# Client <-> supervisor (documented in docs/PROTOCOL.md)
# --------------------------------------------------------------------------------------------
@message("hello")
class Hello:
    id: int
    version: int
    client: str = ""


@message("welcome")
class Welcome:
    id: int
    version: int
    model: str
    architecture: str
    vocab_size: int
    max_context: int
    max_request_bytes: int = 0  # the largest request frame the endpoint takes (0: not said)
    max_prompt_bytes: int = 0   # the longest prompt text in UTF-8 bytes (0: not said)
    lossy: str = ""             # the run's lossy setting ("exact", or its mode; "": not said)


@message("generate")
class Generate:
    """One of prompt, token_ids and messages ({role, content} maps, rendered with the chat
    template; an assistant's may carry `tool_calls`, a tool's `tool_call_id`). max_tokens nil:
    the rest of the context (max_context - prompt tokens). tools: OpenAI function tools
    ({type, function: {name, description, parameters}}) given to the chat template as `tools`.
    json_schema: a JSON Schema (its JSON text) the answer must match, enforced while decoding
    (`{"type": "object"}`: any JSON object); the answer stops once the JSON is complete.
    tool_choice "required" (chat requests with tools): the answer must call one of `tools`, in
    the model family's tool-call format with arguments matching the tool's parameters schema
    (exactly one call where parallel_tool_calls is false); the supervisor writes it as
    `grammar`, an llguidance Lark grammar the answer must match (compute takes json_schema or
    grammar, not both)."""
    id: int
    prompt: str | None = None
    token_ids: list | None = None
    max_tokens: int | None = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list | None = None
    chat: bool = False
    stream: bool = True
    messages: list | None = None
    tools: list | None = None
    logprobs: int | None = None
    top_k: int = 0                    # 0: off
    min_p: float = 0.0                # 0: off
    repetition_penalty: float = 1.0   # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    json_schema: str | None = None    # None: unconstrained
    tool_choice: str | None = None    # None: calls optional; "required"
    parallel_tool_calls: bool = True
    grammar: str | None = None        # None: unconstrained


@message("cancel")
class Cancel:
    """Stops the request `id` of the same peer: a queued one leaves the queue, a running one stops
    within one token; either ends with its own final message (`done` with finish_reason
    "cancelled", or `error` `cancelled` for logits). No reply of its own, except `error`
    `unknown_request` when no request `id` of this peer is in flight."""
    id: int


@message("token")
class Token:
    """logprobs (requests that ask): entries {token_id, logprob, top: [[id, logprob], ...]} of
    the tokens whose text this message carries (the supervisor adds each token's text as
    `token`, and the top tokens' as a third item)."""
    id: int
    index: int
    token_id: int
    text: str
    logprobs: list | None = None


@message("done")
class Done:
    id: int
    text: str
    token_ids: list
    finish_reason: str
    stats: dict
    logprobs: list | None = None  # every generated token's entry (as in `token`), when asked


@message("logits")
class Logits:
    id: int
    token_ids: list


@message("logits_result")
class LogitsResult:
    id: int
    shape: list
    dtype: str
    data: bytes


@message("stats")
class Stats:
    id: int


@message("stats_result")
class StatsResult:
    id: int
    stats: dict


@message("health")
class Health:
    id: int


@message("health_result")
class HealthResult:
    id: int
    ok: bool
    workers: dict
    state: str = "serving"  # or "restarting" (workers being replaced after a death)
    restarts: int = 0       # worker restarts since the supervisor started


class ErrorCode(StrEnum):
    """Every `code` of an `error` the runtime sends (docs/PROTOCOL.md, "Errors"). Members are
    strings, so the wire carries the plain name; the client maps each to its exception class
    (deltafin.client.ERRORS)."""

    BAD_MESSAGE = "bad_message"
    VERSION_MISMATCH = "version_mismatch"
    BAD_REQUEST = "bad_request"
    QUEUE_FULL = "queue_full"
    CANCELLED = "cancelled"
    UNKNOWN_REQUEST = "unknown_request"
    EXPERT_READ_FAILED = "expert_read_failed"
    EXPERT_UNAVAILABLE = "expert_unavailable"
    BUDGET_TOO_SMALL = "budget_too_small"
    BAD_CONFIG = "bad_config"
    WORKER_DIED = "worker_died"
    RANK_LOST = "rank_lost"
    NOT_LEADER = "not_leader"
    RESTARTING = "restarting"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"


@message("error")
class Error:
    id: int | None
    code: str  # an ErrorCode
    message: str


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this runtime: `check_request` refuses the rest up front."""
    vocab_size: int
    max_context: int
    max_result_bytes: int = MAX_RESULT_BYTES
    max_prompt_bytes: int = 0  # prompt text beyond this many UTF-8 bytes is refused (0: unchecked)


def prompt_too_long(prompt: str, max_bytes: int) -> str | None:
    """Why a prompt text is longer than max_bytes UTF-8 bytes, else None. Measured without
    encoding a text that is surely too long or surely short enough (1 to 4 bytes a character)."""
    if not max_bytes or len(prompt) * 4 <= max_bytes:
        return None
    if len(prompt) > max_bytes or prompt.isascii():  # isascii: O(1) on CPython's compact strings
        n = len(prompt)
    else:
        n = len(prompt.encode("utf-8", "surrogatepass"))
    if n <= max_bytes:
        return None
    return (f"prompt of {'at least ' if len(prompt) > max_bytes else ''}{n} bytes exceeds the "
            f"{max_bytes} bytes that max_context tokens can hold (welcome: max_prompt_bytes)")


def _messages_text(messages: list) -> str:
    """The contents of a generate's chat messages together (what bounds their size); raises
    BadRequest unless each is a map whose role and content are strings."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise BadRequest("messages must be a non-empty list of maps with string role and content")
    return "".join(m["content"] for m in messages)


def _check_token_ids(ids: list, limits: RequestLimits, what: str) -> None:
    if not ids:
        raise BadRequest("empty prompt")
    # bool is an int subclass in Python (and msgpack has its own true/false): refused by type
    if any(type(i) is not int or not 0 <= i < limits.vocab_size for i in ids):
        raise BadRequest(f"{what}: token ids must be integers in [0, {limits.vocab_size})")
    if len(ids) > limits.max_context:
        raise BadRequest(f"{what}: {len(ids)} tokens exceed max_context={limits.max_context}")


def check_request(msg, limits: RequestLimits) -> None:
    """Raises BadRequest for a generate or logits request that cannot be served as asked, before
    any work starts: mixed or missing prompt, token ids of the wrong type or range, lengths past
    max_context, prompt text longer in bytes than max_context tokens can be, sampling parameters
    that are not finite numbers in range, a logits reply that would not fit in one message.
    (Prompt text within the byte bound is measured in tokens by the supervisor's tokenizer.)"""
    if isinstance(msg, Generate):
        if sum(x is not None for x in (msg.prompt, msg.token_ids, msg.messages)) != 1:
            raise BadRequest("generate takes exactly one of prompt, token_ids and messages")
        if msg.prompt == "":
            raise BadRequest("empty prompt")
        if msg.tools is not None and (msg.messages is None
                                      or not all(isinstance(t, dict) for t in msg.tools)):
            raise BadRequest("tools go with chat messages, as a list of maps")
        text = msg.prompt if msg.messages is None else _messages_text(msg.messages)
        if text is not None and (why := prompt_too_long(text, limits.max_prompt_bytes)):
            raise BadRequest(why)
        if msg.max_tokens is not None and not 0 <= msg.max_tokens < limits.max_context:
            raise BadRequest(f"max_tokens must be within [0, {limits.max_context}) "
                             f"(max_context={limits.max_context} holds the prompt too)")
        if msg.token_ids is not None:
            _check_token_ids(msg.token_ids, limits, "generate")
            if len(msg.token_ids) + (msg.max_tokens if msg.max_tokens is not None else 1) > limits.max_context:
                raise BadRequest(f"prompt ({len(msg.token_ids)} tokens) + max_tokens ({msg.max_tokens}) "
                                 f"exceeds max_context={limits.max_context}")
        if not (math.isfinite(msg.temperature) and msg.temperature >= 0):
            raise BadRequest(f"temperature must be a finite number >= 0, got {msg.temperature}")
        if not (math.isfinite(msg.top_p) and 0 < msg.top_p <= 1):
            raise BadRequest(f"top_p must be within (0, 1], got {msg.top_p}")
        if msg.logprobs is not None and not 0 <= msg.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be within [0, {MAX_TOP_LOGPROBS}], got {msg.logprobs}")
        if msg.seed is not None and msg.seed < 0:
            raise BadRequest(f"seed must be an integer >= 0, got {msg.seed}")
        _check_sampling(msg)
        if msg.stop is not None:
            if len(msg.stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in msg.stop):
                raise BadRequest(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
    elif isinstance(msg, Logits):
        _check_token_ids(msg.token_ids, limits, "logits")
        need = len(msg.token_ids) * limits.vocab_size * 4
        if need > limits.max_result_bytes:
            most = limits.max_result_bytes // (limits.vocab_size * 4)
            raise BadRequest(f"logits of {len(msg.token_ids)} tokens x {limits.vocab_size} vocabulary "
                             f"would be a {need} byte reply, over the {limits.max_result_bytes} byte "
                             f"limit (the message limit, or the memory budget's reserve for replies); "
                             f"ask for at most {most} tokens per request")


SAMPLING_OPTIONS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "json_schema", "tool_choice", "parallel_tool_calls", "grammar")


def _check_sampling(msg: Generate) -> None:
    if msg.json_schema is not None and (msg.grammar is not None or msg.tool_choice is not None):
        raise BadRequest("json_schema and grammar (or tool_choice) cannot be asked together")
    if msg.tool_choice not in (None, "required"):
        raise BadRequest(f"tool_choice must be nil or 'required', got {msg.tool_choice!r}")
    if msg.tool_choice is not None and not (msg.tools and msg.messages is not None):
        raise BadRequest("tool_choice 'required' needs chat messages and tools")
    if msg.top_k < 0:
        raise BadRequest(f"top_k must be an integer >= 0 (0: off), got {msg.top_k}")
    if not (math.isfinite(msg.min_p) and 0 <= msg.min_p <= 1):
        raise BadRequest(f"min_p must be within [0, 1], got {msg.min_p}")
    if not (math.isfinite(msg.repetition_penalty) and msg.repetition_penalty > 0):
        raise BadRequest(f"repetition_penalty must be a finite number > 0, got {msg.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(msg, name)
        if not (math.isfinite(value) and -2 <= value <= 2):
            raise BadRequest(f"{name} must be within [-2, 2], got {value}")


# --------------------------------------------------------------------------------------------
# Supervisor <-> workers (control channel)
# --------------------------------------------------------------------------------------------
@message("worker_ready")
class WorkerReady:
    role: str
    pid: int
    info: dict = field(default_factory=dict)


@message("worker_progress")
class WorkerProgress:
    """worker -> supervisor, before `worker_ready`: a long start-up step begins (compute's warm-up on
    a GPU, whose kernels a fresh machine compiles: minutes). From the first one the supervisor
    waits runtime.warmup_timeout_s more for ready, and names the step if that runs out."""
    role: str
    step: str
    index: int
    steps: int


@message("attach_pool")
class AttachPool:
    """The staging segment (`n_slots` slots of `slot_bytes`, where the loader reads records) and the
    resident tier: expert slots per record-layout group, MLX memory that compute owns. spin_ms:
    how long each worker polls without sleeping after a message (bench.spin_ms as resolved)."""
    segment: str
    n_slots: int
    slot_bytes: int
    resident: dict = field(default_factory=dict)
    spin_ms: float = 0.0


@message("pool_attached")
class PoolAttached:
    role: str


@message("shutdown")
class Shutdown:
    reason: str = ""


@message("forward")
class Forward:
    """A client request or reply relayed between supervisor and compute; `client` is the envelope."""
    client: bytes
    payload: bytes


@message("worker_stats")
class WorkerStats:
    """supervisor -> worker: send a snapshot now, on the control channel, answering `id`."""
    id: int


# --------------------------------------------------------------------------------------------
# Metrics stream (runtime/telemetry.py; the supervisor's is documented in docs/PROTOCOL.md)
# --------------------------------------------------------------------------------------------
@message("metrics")
class Metrics:
    """A full snapshot of one process's counters, never a delta, so a late or lossy subscriber is
    right with the next one. Workers publish theirs to the supervisor (and answer `worker_stats`
    with one, `sync` = its id); the supervisor publishes the merged one as source "supervisor"."""
    source: str
    pid: int
    seq: int
    time: float
    stats: dict
    sync: int = 0


# --------------------------------------------------------------------------------------------
# Data plane: compute <-> router <-> loader
# --------------------------------------------------------------------------------------------
@message("peer_hello")
class PeerHello:
    """loader/compute -> router on connect, echoed back: both ends know the route exists."""
    role: str


@message("need")
class Need:
    """compute -> router: experts of one layer needed now, some not resident in compute's tier.
    The router pins their resident slots (never victims of this need), has the missing ones read
    and filled, then answers `slots`. Releases the pins of the previous need. `prefetch`: asked
    ahead of any use (the preload of a tier that holds every expert), so not a use for the policy.
    `lease`: a later layer's experts asked ahead (compute's gate lookahead) while an earlier need
    may still wait: held and read behind the demand reads (their `fill`s come as they land),
    never answered (compute waits for no lease: the need of that layer answers for what it uses),
    released by the need or `used` of its layer; it releases nothing and is not a use. Best
    effort: an expert that finds no slot is left out. `hints` and `uses`: a `hint` and a `used`
    that compute would have sent just before, folded in; the router takes them first, in that
    order (its predictor may learn from them after this need's reads have gone out). `sure`
    (with `lease`): compute foresaw these experts (a layer that ran ahead on a wrong input chose
    them), so the missing ones are read whatever the router's predictor expects of them.
    `early` (a demand need): where some experts must be read and every read has a staging slot
    (none queued), the router answers at once with `slots` marked `pending` (the resident slot
    each expert will hold), then the fills, then the final `slots`; compute builds the rest of its
    pass meanwhile and evaluates nothing before the final answer (bench.defer_needs).
    `leases`: further leases, [[layer, [expert, ...], sure], ...], that compute would have sent
    right behind this message: the router takes them after it (its answer and reads sent first),
    in order, the i-th as a `lease` of its own with req `req + i` (i from 1), so one message
    carries a layer's need and the leases behind it, or a pass's leases (`unfold`)."""
    req: int
    layer: int
    experts: list
    prefetch: bool = False
    lease: bool = False
    hints: list | None = None
    uses: list | None = None
    sure: bool = False
    early: bool = False
    leases: list | None = None


@message("used")
class Used:
    """compute -> router, no answer: experts compute used from its resident tier without asking,
    [[layer, [expert, ...]], ...] in the order used, so the policy sees every hit. Sent before
    each `need` and once per forward pass; releases the pins of the previous need. `ahead`: the
    last layer was completed by prefetch fills compute took early and sent no need, so the
    router plans its next prefetch now, as it does after answering a need."""
    uses: list
    ahead: bool = False


@message("hint")
class Hint:
    """compute -> router, no answer: gate lookahead, [[layer, [expert, ...]], ...], the experts a
    layer's gate picks when applied to the previous MoE layer's input. The router's predictor
    weighs them by their measured precision; sent only where compute reads a gate back anyway."""
    hints: list


@message("fill")
class Fill:
    """router -> compute: copy staging slot `staging` (read by the loader) into resident slot
    `slot` of the layer's group; it now holds (layer, expert), fill number `generation`."""
    req: int
    slot: int
    staging: int
    layer: int
    expert: int
    generation: int


@message("filled")
class Filled:
    """compute -> router: the fill is applied; its staging slot may take the next read. `more`:
    [[staging, generation], ...], further fills applied together, acknowledged in this one
    message (`unfold`)."""
    staging: int
    generation: int
    more: list | None = None


def unfold(msg) -> list:
    """The messages one data-plane message carries, in the order the router takes them: a `need`
    or `lease` and then each lease in its `leases`; a `filled` and then each fill in its `more`;
    any other message alone. Every part is checked before any is returned (a malformed one
    drops the whole message as a bad one: ProtocolError)."""
    if isinstance(msg, Need) and msg.leases:
        out = [replace(msg, leases=None)]
        for i, item in enumerate(msg.leases, 1):
            try:
                layer, experts, sure = item
                if not isinstance(sure, bool):
                    raise TypeError(f"{sure!r} is not a boolean")
                out.append(Need(req=msg.req + i, layer=_int(layer), experts=[_int(e) for e in experts],
                                lease=True, sure=sure))
            except (TypeError, ValueError):
                raise ProtocolError("need.leases must be [[layer, [expert, ...], sure], ...]") from None
        return out
    if isinstance(msg, Filled) and msg.more:
        out = [replace(msg, more=None)]
        for item in msg.more:
            try:
                staging, generation = item
                out.append(Filled(staging=_int(staging), generation=_int(generation)))
            except (TypeError, ValueError):
                raise ProtocolError("filled.more must be [[staging, generation], ...]") from None
        return out
    return [msg]


def _int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


@message("fill_failed")
class FillFailed:
    """router -> compute: the read for resident slot `slot` failed; the slot is empty now (its
    previous expert was evicted for it). `req` is the need that waited for it."""
    req: int
    slot: int
    layer: int
    expert: int
    error: str


@message("slots")
class Slots:
    """router -> compute: every expert of the need is resident, after the fills sent before this.
    [[expert, slot, generation]] (compute checks its own map against it). `pending` (the early
    answer to a need with `early`): the slots are assigned and their reads under way; the fills
    and the final answer follow."""
    req: int
    layer: int
    slots: list
    hits: int
    wait_us: int
    pending: bool = False


@message("read")
class Read:
    """router -> loader: read the record of (layer, expert) into staging slot `slot`; generation
    names the fill of the resident slot it is for. prefetch: a read ahead of need, which the
    loader serves after every demand read it holds."""
    slot: int
    generation: int
    layer: int
    expert: int
    prefetch: bool = False


@message("loaded")
class Loaded:
    """loader -> router: the staging slot holds the record now (checksum verified)."""
    slot: int
    generation: int
    layer: int
    expert: int
    read_us: int
    nbytes: int


@message("load_failed")
class LoadFailed:
    slot: int
    generation: int
    layer: int
    expert: int
    error: str


@message("release")
class Release:
    """compute -> router: the pins of the last `need` can go (after a failed request)."""
    req: int
