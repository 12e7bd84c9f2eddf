"""`hybridflow dashboard`'s HTTP server: the page at /, its view as JSON at /api/view (stdlib only)."""

from __future__ import annotations

import errno
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from hybridflow.dashboard.feed import Feed
from hybridflow.dashboard.page import render_page

log = logging.getLogger(__name__)
VIEW_PATH = "/api/view"
LIVE_URL = VIEW_PATH.lstrip("/")
"""What the page fetches: relative, so the page also works behind a path prefix (the API server's service
proxy, /api/v1/namespaces/NS/services/SVC:PORT/proxy/)."""
PORT_TRIES = 10


class DashboardError(RuntimeError):
    """The dashboard cannot serve; the message says why."""


def make_handler(feed: Feed, refresh_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", render_page(feed.view(), LIVE_URL, refresh_s))
            elif path == VIEW_PATH:
                self._send(200, "application/json", json.dumps(feed.view(), allow_nan=False))
            elif path == "/healthz":
                self._send(200, "text/plain", "ok\n")
            else:
                self._send(404, "text/plain", "not found\n")

        def _send(self, code: int, kind: str, text: str) -> None:
            data = text.encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def bind(feed: Feed, host: str, port: int, refresh_s: float = 2.0, tries: int = PORT_TRIES) -> ThreadingHTTPServer:
    """A server on `port`, or the next free one of `tries` ports (0: the OS picks)."""
    handler = make_handler(feed, refresh_s)
    last: OSError | None = None
    for candidate in [0] if port == 0 else range(port, port + tries):
        try:
            server = ThreadingHTTPServer((host, candidate), handler)
        except OSError as e:
            if e.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise DashboardError(f"cannot serve on {host}:{candidate}: {e.strerror or e}") from None
            last = e
            continue
        server.daemon_threads = True
        return server
    raise DashboardError(f"ports {port}-{port + tries - 1} on {host} are all in use ({last and last.strerror}); "
                         "pass another --port, or --port 0 for any free one")


def serve_in_background(feed: Feed, host: str, port: int, refresh_s: float = 2.0,
                        tries: int = PORT_TRIES) -> ThreadingHTTPServer:
    """`bind`, then serve from a daemon thread: the server lives as long as the process, or until `shutdown()`."""
    server = bind(feed, host, port, refresh_s, tries)
    threading.Thread(target=server.serve_forever, name="hybridflow-dashboard", daemon=True).start()
    return server


def url_of(server: ThreadingHTTPServer) -> str:
    host, port = str(server.server_address[0]), int(server.server_address[1])
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{shown}:{port}/"
