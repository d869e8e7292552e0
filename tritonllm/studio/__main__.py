"""``python -m tritonllm.studio [outputs/ multirun/ ...] [--host 127.0.0.1] [--port 8600]``

Serves tritonllm Studio for the runs under the given folders (default: ``outputs`` and ``multirun``
of the current folder) and prints the address to open, which carries the key that enables the
controls. On a remote GPU machine, forward the port: ``ssh -L 8600:127.0.0.1:8600 gpu-host``.
Ctrl-C or SIGTERM closes the server (exit status 130 or 143); it starts no other process.
"""

from __future__ import annotations

import logging
import os
import sys

from tritonllm.runtime import ArgumentParser, exit_on_user_error
from tritonllm.studio.runs import RunIndex
from tritonllm.studio.server import StudioServer


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m tritonllm.studio", description=__doc__.split("\n\n")[1])
    p.add_argument("folders", nargs="*", help="folders searched for runs (default: outputs multirun)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8600, help="port (default 8600; 0 picks a free one)")
    p.add_argument("--stale-after", type=float, default=600.0,
                   help="seconds without a new record after which a run with no live trainer is 'stale'")
    p.add_argument("--verbose", action="store_true", help="log every request")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port must be 0 (any free port) to 65535, got {args.port}")
    if args.stale_after <= 0:
        p.error(f"--stale-after must be > 0 seconds, got {args.stale_after}")
    return args


@exit_on_user_error
def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s")
    folders = args.folders or [f for f in ("outputs", "multirun") if os.path.isdir(f)]
    if not folders:
        sys.exit("tritonllm: error: no run folders: name them (python -m tritonllm.studio outputs/ multirun/) "
                 "or start from the folder that holds outputs/")
    missing = [f for f in folders if not os.path.isdir(f)]
    if missing:
        sys.exit(f"tritonllm: error: not a folder: {', '.join(missing)}")
    try:
        server = StudioServer(RunIndex(folders, stale_after=args.stale_after), args.host, args.port)
    except OSError as e:
        sys.exit(f"tritonllm: error: cannot listen on {args.host}:{args.port}: {e.strerror} (try --port 0)")
    print(f"tritonllm Studio: {len(server.index.runs())} runs under {', '.join(server.index.roots)}\n"
          f"open {server.login_url}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
