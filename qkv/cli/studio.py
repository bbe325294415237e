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
                   help="a local checkpoint folder to offer (repeatable; the page opens on the first); the bundled "
                   "all-MiniLM-L6-v2 and the tutorial's toy model are always offered")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on (default 127.0.0.1, this machine only; ::1 for IPv6); another one "
                   "exposes the studio to the network")
    p.add_argument("--allow-host", metavar="NAME", action="append", default=[],
                   help="another name the studio may be reached by, as the browser's address bar spells it "
                   "(repeatable); it always answers to localhost, the --host address and, off loopback, this "
                   "machine's own names and addresses; any other Host header is refused (DNS rebinding)")
    p.add_argument("--no-browser", action="store_true", help="print the address without opening a browser")
    p.add_argument("--lang", choices=("en", "zh"), default="en", help="the page's first language (switchable on it)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    uvicorn = require("uvicorn", "qkv studio")
    from ..studio import Studio
    from ..studio.server import create_app, host_name, is_loopback, reachable_hosts

    host = args.host.strip().strip("[]")  # "[::1]" as a URL spells it: the address ::1
    for name in args.allow_host:
        if not host_name(name) or any(c in host_name(name) for c in "/ *?#@"):
            raise UsageError(f"--allow-host {name!r} is not a host name or address; give one as the address bar "
                             "spells it, e.g. --allow-host mybox.local")
    hosts = reachable_hosts(host, args.allow_host)
    if not is_loopback(host):
        print(f"qkv studio: warning: listening on {host} lets other machines reach this studio and run its models; "
              f"use it only on a network you trust. It answers to these names only: {', '.join(hosts)} "
              "(add one with --allow-host NAME); any other Host header is refused.", file=sys.stderr)
    # bind here, so a taken port is one clear line (and port 0's choice is known before serving)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, args.port))
    except OSError as e:  # the port is taken, the interface does not exist
        sock.close()
        shown_host = f"[{host}]" if ":" in host else host
        raise UsageError(f"cannot listen on {shown_host}:{args.port}: {e.strerror or e}; pick another --port "
                         "(0: any free one)") from None
    port = sock.getsockname()[1]
    app = create_app(Studio(args.model), hosts=hosts, lang=args.lang)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    url = _url(host, port)

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


def _url(host: str, port: int) -> str:
    """The address to open: a wildcard bind's loopback address of the same family, IPv6 in brackets."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{shown}]:{port}/" if ":" in shown else f"http://{shown}:{port}/"
