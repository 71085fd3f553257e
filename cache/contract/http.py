"""One way to answer an HTTP request with a body, for the launcher's and the engine's servers."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


def reply(handler: BaseHTTPRequestHandler, status: int, body: bytes,
          content_type: str) -> None:
    """Send status, Content-Type, Content-Length and the body."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def reply_json(handler: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
    """Send `obj` as JSON (anything JSON cannot encode as its str())."""
    reply(handler, status, json.dumps(obj, default=str).encode(), "application/json")
