"""An HTTP object server on this host's 127.0.0.1, for measuring what tasks download.

``GET /N`` answers N bytes, ``PUT`` swallows its body: the 10 MB object
workload of the network-performance seed without a store behind it, and what
the accounting tests and ``bench/netvis.py`` download through curl and child
processes (bytes that no Python socket of the task sees).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["object_server"]

_BLOCK = 65536


class _Objects(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        size = int(self.path.strip("/"))
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.end_headers()
        block = b"n" * _BLOCK
        while size > 0:
            self.wfile.write(block[: min(size, _BLOCK)])
            size -= _BLOCK

    def do_PUT(self) -> None:
        left = int(self.headers["Content-Length"])
        while left > 0:
            left -= len(self.rfile.read(min(left, _BLOCK)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def object_server(host: str = "127.0.0.1") -> Iterator[int]:
    """Serve objects on ``host`` (a free port, returned) until the block ends."""
    srv = http.server.ThreadingHTTPServer((host, 0), _Objects)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()
