"""A tiny JSON-over-HTTP caller for the REST API (used by the CLI, the demo and the tests)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request


class RestError(RuntimeError):
    def __init__(self, status: int, body: dict):
        super().__init__(f"HTTP {status}: {body.get('error', body)}")
        self.status, self.body = status, body


def call(method: str, url: str, body=None, token: str | None = None, timeout: float = 120.0,
         raw: bytes | None = None, content_type: str = "application/json") -> dict:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", content_type)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = {"error": payload.decode(errors="replace")[:500], "not_json": True}
        raise RestError(exc.code, parsed) from None
