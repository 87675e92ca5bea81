"""A TCP proxy in front of PostgreSQL that a test can freeze, to play a frozen database.

While frozen it accepts connections and never answers them (what a PostgreSQL under
SIGSTOP does), without stopping the shared server on 5432 that other tests use. Thawed,
new connections are relayed to the real server again; connections accepted while frozen
stay silent until the proxy closes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url

RELAY_CHUNK_BYTES = 65_536


class FreezableProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._frozen = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.held = 0  # connections accepted while frozen (each one a check that reached it)
        self._acceptor = threading.Thread(target=self._accept, name="test-proxy", daemon=True)
        self._acceptor.start()

    def freeze(self) -> None:
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def url_for(self, database_url: str) -> str:
        """``database_url`` pointed at this proxy instead of the real server."""
        moved = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return moved.render_as_string(hide_password=False)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self._acceptor.join(5)
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._keep(client)
            if self._frozen.is_set():
                with self._lock:
                    self.held += 1
            else:
                self._relay(client)

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _relay(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self._upstream, timeout=5)
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self._keep(server)
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(RELAY_CHUNK_BYTES):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextmanager
def freezable_proxy(database_url: str) -> Iterator[FreezableProxy]:
    """A proxy in front of the server ``database_url`` names, closed afterwards."""
    url = make_url(database_url)
    proxy = FreezableProxy((url.host or "127.0.0.1", url.port or 5432))
    try:
        yield proxy
    finally:
        proxy.close()
