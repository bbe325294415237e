"""``qkv studio``: start the live page on this machine and open it in the browser."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import webbrowser
from typing import Any

from ..extras import require
from .args import UsageError, int_at_least


def _model_dir(s: str) -> str:
    if not os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s} is not a directory; pass a local model checkpoint folder")
    return s


def add_parser(sub: Any) -> None:
    """Add ``studio`` to the ``qkv`` command's subparsers."""
    p = sub.add_parser(
        "studio", help="a live page: type a sentence, see every head, step through one, knock heads out",
        description="Start a local web app on 127.0.0.1 and open it: type a sentence and watch a real model's "
        "attention, open one head in the float64 glass box, knock heads out or patch them, compare two texts.",
    )
    p.add_argument("--model", metavar="DIR", action="append", type=_model_dir, default=[],
                   help="a local checkpoint folder to offer (repeatable); the toy model and the bundled "
                   "all-MiniLM-L6-v2 are always offered")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1, this machine only); another one exposes "
                   "the studio to the network")
    p.add_argument("--no-browser", action="store_true", help="print the address without opening a browser")
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="the page's first language (switchable on it)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    uvicorn = require("uvicorn", "qkv studio")
    from ..studio import Studio
    from ..studio.server import LOCAL_HOSTS, create_app

    hosts = tuple(LOCAL_HOSTS)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"qkv studio: warning: listening on {args.host} lets other machines reach this studio and run "
              "its models; use it only on a network you trust", file=sys.stderr)
        hosts += (args.host,) if args.host not in ("0.0.0.0", "::") else ("*",)
    # bind here, so a taken port is one clear line (and port 0's choice is known before serving)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:  # the port is taken, the interface does not exist
        sock.close()
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}; pick another --port "
                         "(0: any free one)") from None
    port = sock.getsockname()[1]
    app = create_app(Studio(args.model), hosts=hosts, lang=args.lang)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{port}/"

    def announce() -> None:  # once uvicorn serves: print the address, open it
        while not server.started and not server.should_exit:
            threading.Event().wait(0.05)
        if server.started:
            print(f"qkv studio: serving on {url} (Ctrl-C stops it)", flush=True)
            if not args.no_browser:
                webbrowser.open(url)

    threading.Thread(target=announce, daemon=True).start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully, then re-raises the signal
        print("qkv studio: stopped", flush=True)
    finally:
        sock.close()
    return 0
