"""The HTTP API's bearer token: with a key set (deltafin-http --api-key, deltafin-supervisor
--api-key, or DELTAFIN_API_KEY), every request but /health carries `Authorization: Bearer KEY`,
compared in constant time; others get 401 in OpenAI's error shape."""
from __future__ import annotations

import hmac
import json

API_KEY_ENV = "DELTAFIN_API_KEY"
OPEN_PATHS = frozenset({"/health"})
_REFUSED = json.dumps({"error": {"message": "missing or wrong API key (Authorization: Bearer KEY)",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}).encode()


def bearer_token(headers) -> bytes:
    """The token of an ASGI request's `Authorization: Bearer TOKEN` header (b"" if none)."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return b""


class BearerAuth:
    """ASGI middleware admitting requests that carry the key."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if hmac.compare_digest(bearer_token(scope["headers"]), self.key):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(_REFUSED)).encode())]})
        await send({"type": "http.response.body", "body": _REFUSED})
