"""A loopback HTTP proxy in front of a real tracker server that injects failures (fault injection only)."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultProxy:
    """Forwards to ``upstream`` (``http://127.0.0.1:PORT``), failing chosen requests to ``fail_path``.

    Attributes:
        faults: statuses for the next matching requests (None passes one through), consumed in order.
        storm: while set (a ``threading.Event``), every matching request gets 429 with ``Retry-After``.
        rejected / forwarded: counts of matching requests answered with an error / passed on.
        paths: the path of every request, in order.
    """

    def __init__(self, upstream: str, fail_path: str = "runs/log-batch", retry_after: str = "30"):
        host, port = upstream.removeprefix("http://").split(":")
        self.faults: list[int | None] = []
        self.storm = threading.Event()
        self.rejected = 0
        self.forwarded = 0
        self.paths: list[str] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int) -> None:
                payload = json.dumps({"error_code": "REQUEST_LIMIT_EXCEEDED", "message": "injected"}).encode()
                self.send_response(status)
                self.send_header("Retry-After", retry_after)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                matching = fail_path in self.path
                with proxy.lock:
                    proxy.paths.append(self.path.split("?")[0])
                    status = (
                        429 if matching and proxy.storm.is_set() else (proxy.faults.pop(0) if matching and proxy.faults else None)
                    )
                    if matching:
                        if status is None:
                            proxy.forwarded += 1
                        else:
                            proxy.rejected += 1
                if status is not None:
                    return self._reply(status)
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _forward

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def log_batches(self) -> int:
        return self.forwarded

    def close(self):
        self.server.shutdown()
        self.server.server_close()
