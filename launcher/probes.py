"""HTTP probes of the engine: its health URL and its liveness request (a real request, e.g. a
one-token completion, that an engine whose /health lies cannot answer).

A probe answers "" when the engine replied 2xx within the deadline, else a few words saying
what went wrong (`HTTP 503`, `timed out after 10 s`, `connection refused`), for the log line.
Blocking (urllib, the standard library's client): the executor runs it in a thread and bounds
it with the same deadline, so a server that trickles its reply cannot hold a probe longer.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from vlaunch.cache.contract.errors import UsageError

METHODS = ("GET", "POST", "PUT", "HEAD")
MAX_BODY = 64 << 10
"""The largest liveness request body (a one-token completion is a few hundred bytes)."""
MAX_REPLY = 1 << 20
"""Bytes of a reply read before it counts as answered (the rest is not waited for)."""
HEALTH_TIMEOUT = 2.0
"""Seconds a health URL probe may take (polled every second)."""


@dataclass(frozen=True)
class HttpProbe:
    """One request the launcher sends to the engine, with the deadline for its 2xx reply."""

    method: str
    url: str
    body: bytes = b""
    timeout: float = HEALTH_TIMEOUT

    @classmethod
    def parse(cls, text: str, timeout: float) -> HttpProbe:
        """`METHOD URL [BODY]` (--engine-liveness-request); UsageError naming what is wrong."""
        words = text.split(None, 2)  # the body is the rest of the text, spaces and all
        if len(words) < 2:
            raise _bad(text, "it needs a method and a URL")
        method, url, body = words[0].upper(), words[1], (words[2] if len(words) > 2 else "")
        if method not in METHODS:
            raise _bad(text, f"the method {words[0]!r} is not one of {', '.join(METHODS)}")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _bad(text, f"{url!r} is not an http:// or https:// URL")
        data = body.encode()
        if data and method in ("GET", "HEAD"):
            raise _bad(text, f"a {method} request carries no body; use POST")
        if len(data) > MAX_BODY:
            raise _bad(text, f"the body is {len(data)} bytes, more than {MAX_BODY}")
        return cls(method, url, data, timeout)

    def run(self) -> str:
        """Send the request; "" if the engine answered 2xx in time, else what went wrong."""
        headers = {"Content-Type": "application/json"} if self.body else {}
        req = urllib.request.Request(self.url, self.body or None, headers, method=self.method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                resp.read(MAX_REPLY)
                return "" if 200 <= resp.status < 300 else f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            return f"HTTP {exc.code}"
        except TimeoutError:
            return f"timed out after {self.timeout:g} s"
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                return f"timed out after {self.timeout:g} s"
            return _reason(exc.reason)
        except OSError as exc:  # a reset or a broken pipe mid-reply
            return _reason(exc)

    def describe(self) -> str:
        """`POST http://...` for log lines (the body is not logged)."""
        return f"{self.method} {self.url}"


def _reason(exc: object) -> str:
    """An OSError's cause in a few words (`connection refused`)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or exc.__class__.__name__


def _bad(text: str, why: str) -> UsageError:
    """The usage error of a malformed --engine-liveness-request."""
    return UsageError(f"--engine-liveness-request {text!r}: {why}; give METHOD URL [BODY], e.g. "
                      "'POST http://127.0.0.1:8000/v1/completions {\"prompt\": \"hi\", "
                      "\"max_tokens\": 1}'")
