"""A TCP proxy in front of PostgreSQL that lets a connection log in, then goes mute: what a
server that froze (or a network that dropped) just after the connect looks like to the
client. Once the server has said ``ReadyForQuery`` on a connection, nothing the client
sends on it is forwarded any more, so no answer ever comes; the proxy's own kernel still
acknowledges every byte, as a frozen server's does, so no TCP timeout ends the wait.
Closing the proxy closes every connection. The shared server on 5432 is never touched.

The connection must not use TLS (``sslmode=disable``, or a server without it): the proxy
looks for ``ReadyForQuery`` in the clear."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import make_url

CHUNK_BYTES = 65_536
# ReadyForQuery: type 'Z', length 5, then the transaction status (idle, in a transaction,
# failed); the first one ends a login.
READY_FOR_QUERY = tuple(b"Z\x00\x00\x00\x05" + status for status in (b"I", b"T", b"E"))


class MuteProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.muted = 0  # connections that logged in and went mute
        self._acceptor = threading.Thread(target=self._accept, name="mute-proxy", daemon=True)
        self._acceptor.start()

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
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            mute = threading.Event()
            threading.Thread(
                target=self._to_server, args=(client, server, mute), daemon=True
            ).start()
            threading.Thread(
                target=self._to_client, args=(server, client, mute), daemon=True
            ).start()

    def _to_server(
        self, client: socket.socket, server: socket.socket, mute: threading.Event
    ) -> None:
        with contextlib.suppress(OSError):
            while chunk := client.recv(CHUNK_BYTES):
                if not mute.is_set():
                    server.sendall(chunk)

    def _to_client(
        self, server: socket.socket, client: socket.socket, mute: threading.Event
    ) -> None:
        seen = b""
        with contextlib.suppress(OSError):
            while chunk := server.recv(CHUNK_BYTES):
                seen = (seen + chunk)[-CHUNK_BYTES:]
                if not mute.is_set() and any(ready in seen for ready in READY_FOR_QUERY):
                    mute.set()  # before the client can have the ReadyForQuery and answer it
                    with self._lock:
                        self.muted += 1
                client.sendall(chunk)


@contextmanager
def mute_proxy(database_url: str) -> Iterator[MuteProxy]:
    """A proxy in front of the server ``database_url`` names, closed afterwards."""
    url = make_url(database_url)
    proxy = MuteProxy((url.host or "127.0.0.1", url.port or 5432))
    try:
        yield proxy
    finally:
        proxy.close()
