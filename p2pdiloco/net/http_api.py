"""Health, state and metrics over HTTP for bootstrap servers (and, later, nodes).

``GET /healthz`` → 200 ``ok`` while the DHT is alive, 503 otherwise; ``GET /api/v1/state`` →
JSON from the state callback; ``GET /metrics`` → Prometheus text; ``GET /`` → the HTML page of
the page callback, when one is given (the bootstrap's, ``net/web_page.py``). Anything else is 404; only GET
and HEAD are served, requests are small and handled on their own threads.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class HTTPApi:
    """Serve the three endpoints on (host, port) from a daemon thread; port 0 picks one."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        healthy: Callable[[], bool],
        state: Callable[[], dict[str, Any]],
        registry: CollectorRegistry,
        page: Callable[[dict[str, Any]], str] | None = None,
    ) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "p2pdiloco"

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                api._handle(self)

            def do_HEAD(self) -> None:  # noqa: N802
                api._handle(self, head=True)

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http %s %s", self.address_string(), fmt % args)

        self._healthy, self._state, self._registry = healthy, state, registry
        self._page = page
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="http")

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, req: BaseHTTPRequestHandler, head: bool = False) -> None:
        path = req.path.split("?", 1)[0]
        try:
            if path == "/healthz":
                ok = self._healthy()
                self._send(
                    req, 200 if ok else 503, b"ok\n" if ok else b"unhealthy\n", "text/plain", head
                )
            elif path == "/api/v1/state":
                body = json.dumps(self._state(), indent=2).encode() + b"\n"
                self._send(req, 200, body, "application/json", head)
            elif path == "/" and self._page is not None:
                page = self._page(self._state()).encode()
                self._send(req, 200, page, "text/html; charset=utf-8", head)
            elif path == "/metrics":
                self._send(req, 200, generate_latest(self._registry), CONTENT_TYPE_LATEST, head)
            else:
                self._send(req, 404, b"not found\n", "text/plain", head)
        except Exception as e:  # a failing callback must not kill the server thread
            log.exception("http %s failed", path)
            self._send(req, 500, f"error: {e}\n".encode(), "text/plain", head)

    @staticmethod
    def _send(req: BaseHTTPRequestHandler, code: int, body: bytes, ctype: str, head: bool) -> None:
        req.send_response(code)
        req.send_header("Content-Type", ctype)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if not head:
            req.wfile.write(body)
