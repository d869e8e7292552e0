"""Helpers of the Studio tests: a server on a free port, HTTP requests to it, a training run in a thread."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from contextlib import contextmanager

from tritonllm.studio.runs import RunIndex
from tritonllm.studio.server import StudioServer

KEY = "test-key-0123456789"


@contextmanager
def serving(*roots, stale_after: float = 600.0):
    """A Studio server for ``roots`` on 127.0.0.1 (a free port), serving from a thread."""
    server = StudioServer(RunIndex(list(roots), stale_after=stale_after, rescan_s=0.0), "127.0.0.1", 0, key=KEY)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def request(server, method: str, path: str, body=None, headers: dict | None = None):
    """``(status, headers, decoded JSON or raw bytes)`` of one request to ``server``."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    data = json.dumps(body).encode() if body is not None and not isinstance(body, bytes) else body
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, path, body=data, headers={**hdrs, **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type") or ""
    return resp.status, dict(resp.getheaders()), json.loads(raw) if ctype.startswith("application/json") else raw


def read_records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_for(condition, timeout: float, what: str):
    """Poll ``condition()`` until it returns something true (returned) or ``timeout`` seconds pass (an error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_training(cfg) -> tuple[threading.Thread, dict]:
    """``train(cfg)`` in a thread; the returned dict gets ``val`` or ``error`` when it ends."""
    from tritonllm.train import train

    result: dict = {}

    def target():
        try:
            result["val"] = train(cfg)
        except BaseException as e:  # handed to the test, which re-raises it
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result
