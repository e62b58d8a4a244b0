"""The wire format of deltafin's messages: msgpack maps checked against registered dataclasses.

`message` registers a dataclass as a message type (protocol/messages.py declares them all);
`encode` writes one, `decode` and `decode_request` read one back, bounded in size and nesting,
and raise ProtocolError for anything that does not match its type's schema.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

import msgpack

# The largest frame any deltafin socket takes (zmq.MAXMSGSIZE, runtime/sockets.py) and decode
# accepts. The client endpoint takes less (runtime.max_request_bytes): requests are small.
MAX_MESSAGE_BYTES = 256 << 20
# Elements of one msgpack array or map: token ids are bounded by max_context long before this,
# and without a bound a small frame of one-byte elements becomes a huge Python list.
MAX_ITEMS = 1 << 20
# A client's request is bounded tighter, before it is decoded: a map has at most this many keys
# (a request's fields, a chat message's), an array at most max_context or MAX_STOP_STRINGS
# elements (decode_request), nesting at most MAX_REQUEST_DEPTH levels (a chat needs 4).
MAX_REQUEST_KEYS = 64
MAX_REQUEST_DEPTH = 16
MAX_STOP_STRINGS = 64


class ProtocolError(ValueError):
    """A message that cannot be decoded or does not match its schema. id: the message's own id
    where it could be read (an int), so the error answers that request; else None."""

    def __init__(self, message: str, id: int | None = None):
        super().__init__(message)
        self.id = id


_KINDS = {int: (int,), float: (int, float), str: (str,), bytes: (bytes,), bool: (bool,),
          list: (list, tuple), dict: (dict,), Any: (object,)}
REGISTRY: dict[str, type] = {}


def message(name: str):
    """Registers a dataclass as message type `name`."""
    def wrap(cls):
        cls = dataclass(cls)
        cls.TYPE = name
        REGISTRY[name] = cls
        return cls
    return wrap


def short(value, n: int = 64) -> str:
    """repr(value) cut to about n characters: what an error may echo of a client's input."""
    text = repr(value) if not isinstance(value, str) or len(value) <= n else repr(value[:n])
    return text if len(text) <= n + 2 else text[:n] + "..."


def _check(cls, data: dict):
    kwargs = {}
    schema, names = _schema(cls)
    for name, required, kinds, number, optional, kind_name in schema:
        if name not in data:
            if required:
                raise ProtocolError(f"{cls.TYPE}: missing field {name!r}")
            continue
        value = data[name]
        if value is None and optional:
            kwargs[name] = None
            continue
        if not isinstance(value, kinds) or (number and isinstance(value, bool)):
            raise ProtocolError(f"{cls.TYPE}: field {name!r} must be {kind_name}, got {type(value).__name__}")
        kwargs[name] = value
    unknown = data.keys() - names
    if unknown:
        listed = sorted(map(short, unknown))
        more = f" and {len(listed) - 8} more" if len(listed) > 8 else ""
        raise ProtocolError(f"{cls.TYPE}: unknown field(s) {', '.join(listed[:8])}{more}")
    return cls(**kwargs)


_SCHEMAS: dict[type, tuple] = {}


def _schema(cls) -> tuple:
    """Per field (name, required, accepted types, numeric, optional, type name), and the keys a
    message of the type may have ("type" and the field names): read off the dataclass once."""
    got = _SCHEMAS.get(cls)
    if got is None:
        rows = []
        for f in fields(cls):
            kind, optional = _kind(f.type)
            required = f.default is MISSING and f.default_factory is MISSING
            rows.append((f.name, required, _KINDS[kind], kind in (int, float), optional, kind.__name__))
        got = _SCHEMAS[cls] = (tuple(rows), frozenset([row[0] for row in rows] + ["type"]))
    return got


_TYPE_NAMES = {"int": int, "float": float, "str": str, "bytes": bytes, "bool": bool,
               "list": list, "dict": dict, "Any": Any}


def _kind(annotation) -> tuple[type, bool]:
    text = str(annotation).replace(" ", "")
    optional = text.endswith("|None")
    base = text.removesuffix("|None").split("[")[0]
    return _TYPE_NAMES[base], optional


def encode(msg) -> bytes:
    data = {"type": msg.TYPE}
    for name, *_ in _schema(type(msg))[0]:
        data[name] = getattr(msg, name)
    try:
        return msgpack.packb(data, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as e:  # e.g. an integer beyond 64 bits
        raise ProtocolError(f"cannot encode a {msg.TYPE} message: {e}") from None


def decode(raw: bytes, limit: int = MAX_MESSAGE_BYTES):
    """A message between deltafin's own processes (or a reply), bounded by the frame limit."""
    return _message(_unpack(raw, limit, MAX_ITEMS, MAX_ITEMS))


def decode_request(raw: bytes, limit: int, max_items: int):
    """A client's message: every map, array and string bounded before it is built (max_items:
    the longest array a request may hold), nesting checked, errors echoing nothing large."""
    most = max(max_items, MAX_STOP_STRINGS)
    try:
        data = _unpack(raw, limit, most, MAX_REQUEST_KEYS)
    except ProtocolError as e:
        if "exceeds max_" not in str(e):
            raise
        raise ProtocolError(f"{e}: a request's arrays hold at most {most} elements (max_context), "
                            f"its maps at most {MAX_REQUEST_KEYS} keys") from None
    level, depth = [data] if isinstance(data, (dict, list)) else [], 0
    while level:
        depth += 1
        if depth > MAX_REQUEST_DEPTH:
            raise ProtocolError(f"a request nests deeper than {MAX_REQUEST_DEPTH} levels")
        level = [x for v in level for x in (v.values() if isinstance(v, dict) else v)
                 if isinstance(x, (dict, list))]
    return _message(data)


def _unpack(raw: bytes, limit: int, max_items: int, max_keys: int):
    if len(raw) > limit:
        raise ProtocolError(f"message of {len(raw)} bytes exceeds the {limit} byte limit")
    try:
        # Explicit limits, checked as each header is read: msgpack's defaults scale with the
        # frame, so a frame of one-byte elements would become millions of objects. Ext types
        # are never used.
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, max_str_len=limit,
                               max_bin_len=limit, max_array_len=max_items, max_map_len=max_keys,
                               max_ext_len=0)
    except msgpack.StackError:
        raise ProtocolError("not a msgpack message: nested deeper than msgpack's 1024 levels") from None
    except Exception as e:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"not a msgpack message: {str(e)[:200]}") from None


def _message(data):
    if not isinstance(data, dict):
        raise ProtocolError("a message must be a msgpack map")
    name = data.get("type")
    cls = REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {short(name)}")
    try:
        return _check(cls, data)
    except ProtocolError as e:  # the schema's error names the request it answers, where it can
        rid = data.get("id")
        e.id = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        raise
