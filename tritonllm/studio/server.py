"""The Studio web server: the standard library's threading HTTP server, one static page, a JSON API.

``GET /``                          the page (``static/index.html``); ``/?key=<key>`` (the address printed
                                   at start) sets the session cookie that lets the page read run tokens
``GET /static/<file>``             the page's script, styles and the vendored uPlot
``GET /api/runs``                  every run's summary (:meth:`Run.summary`)
``GET /api/run?id=<run>``          one run in full; with the session cookie also its control token
``GET /api/metrics?id=&since=<n>`` the run's ``metrics.jsonl`` records from the n-th on (the page polls)
``POST /api/control?id=<run>``     ``{"action": "stop" | "checkpoint" | "lr_scale", "value": x}`` with
                                   the run's token in the ``X-Studio-Token`` header (else 403)

It binds to 127.0.0.1 by default and answers only requests whose ``Host`` is that address,
``localhost`` or the bound name (a page on another site that rebinds its own name to this machine
gets nothing). A control request must carry the token the trainer wrote into the run folder
(readable by the run's owner only); the page gets it only with the session cookie, which is
``SameSite=Strict`` and ``HttpOnly``, so neither a page of another origin nor another local user
without the printed key can control a run.
"""

from __future__ import annotations

import hmac
import json
import logging
import mimetypes
import os
import secrets
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from tritonllm.studio.runs import ControlError, RunIndex

log = logging.getLogger("tritonllm.studio")

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
COOKIE = "tritonllm_studio"
LOCAL_NAMES = {"127.0.0.1", "localhost", "::1"}
MAX_BODY = 4096
HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:"}


class StudioServer(ThreadingHTTPServer):
    """Serves the runs of ``index``; ``key`` unlocks the controls (the page's session cookie)."""

    daemon_threads = True

    def __init__(self, index: RunIndex, host: str = "127.0.0.1", port: int = 8600, key: str | None = None):
        self.index = index
        self.key = key or secrets.token_urlsafe(24)
        self.allowed_hosts = LOCAL_NAMES | {host.strip("[]")}
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]  # server_address, typed for any socket family
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"

    @property
    def login_url(self) -> str:
        return f"{self.url}?key={self.key}"


class Handler(BaseHTTPRequestHandler):
    server: StudioServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # the console stays quiet; --verbose shows each request
        log.debug("%s %s", self.address_string(), fmt % args)

    # ------------------------------------------------------------------ plumbing
    def _send(self, code: int, body: bytes, ctype: str, extra: dict | None = None) -> None:
        self.send_response(code)
        for k, v in {**HEADERS, "Content-Type": ctype, "Content-Length": str(len(body)), "Cache-Control": "no-store",
                     **(extra or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, code: int = 200) -> None:
        self._send(code, json.dumps(obj).encode(), "application/json")

    def _error(self, code: int, message: str) -> None:
        self._json({"error": message}, code)

    def _host_ok(self) -> bool:
        host = urlsplit(f"//{self.headers.get('Host', '')}").hostname or ""
        return host in self.server.allowed_hosts

    def _authorized(self) -> bool:
        try:
            morsel = SimpleCookie(self.headers.get("Cookie", "")).get(COOKIE)
        except CookieError:
            return False
        return morsel is not None and hmac.compare_digest(morsel.value.encode(), self.server.key.encode())

    def _run(self, query: dict):
        run = self.server.index.get(query.get("id", [""])[0])
        if run is None:
            self._error(404, f"no run with id {query.get('id', [''])[0]!r}")
        return run

    # ------------------------------------------------------------------ routes
    def do_GET(self):  # noqa: N802 (http.server's naming)
        if not self._host_ok():
            return self._error(HTTPStatus.MISDIRECTED_REQUEST, "unknown Host: open the address the server printed")
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/":
            key = query.get("key", [None])[0]
            if key is not None:
                if not hmac.compare_digest(key.encode(), self.server.key.encode()):
                    return self._error(403, "wrong key: open the address the server printed")
                cookie = f"{COOKIE}={self.server.key}; Path=/; HttpOnly; SameSite=Strict"
                return self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": cookie})
            return self._static("index.html")
        if url.path.startswith("/static/"):
            return self._static(url.path[len("/static/"):])
        if url.path == "/api/runs":
            runs = sorted((r.summary() for r in self.server.index.runs()), key=lambda s: -(s["updated"] or 0))
            return self._json({"roots": self.server.index.roots, "authorized": self._authorized(), "runs": runs})
        if url.path == "/api/run":
            run = self._run(query)
            return run and self._json(run.detail(with_token=self._authorized()))
        if url.path == "/api/metrics":
            run = self._run(query)
            if run is None:
                return None
            try:
                since = int(query.get("since", ["0"])[0])
            except ValueError:
                return self._error(400, "since must be an integer")
            records = run.records(since)
            return self._json({"since": since, "count": since + len(records), "records": records})
        return self._error(404, f"no such page: {url.path}")

    do_HEAD = do_GET

    def do_POST(self):  # noqa: N802
        if not self._host_ok():
            return self._error(HTTPStatus.MISDIRECTED_REQUEST, "unknown Host")
        url = urlsplit(self.path)
        if url.path != "/api/control":
            return self._error(404, f"no such endpoint: {url.path}")
        if self.headers.get_content_type() != "application/json":
            return self._error(415, "send the request as application/json")
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            return self._error(400, f"the request body must be 1 to {MAX_BODY} bytes")
        try:
            request = json.loads(self.rfile.read(length))
            if not isinstance(request, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return self._error(400, f"the request body is not a JSON object: {e}")
        run = self._run(parse_qs(url.query))
        if run is None:
            return None
        try:
            state = run.control(self.headers.get("X-Studio-Token"), request)
        except ControlError as e:
            log.warning("control request for %s refused: %s", run.id, e)
            return self._error(e.code, str(e))
        log.info("control request for %s: %s", run.id, request)
        return self._json({"ok": True, "control": state})

    def _static(self, name: str) -> None:
        path = os.path.realpath(os.path.join(STATIC, name))
        if not path.startswith(os.path.realpath(STATIC) + os.sep) or not os.path.isfile(path):
            return self._error(404, f"no such file: {name}")
        ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        with open(path, "rb") as f:
            self._send(200, f.read(), ctype)
