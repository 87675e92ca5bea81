"""A TCP forwarder in front of PostgreSQL (or anything) for one process under test.

``refuse_new()`` closes every new connection as soon as it is accepted while the open
ones keep flowing - what a full ``max_connections``, a PgBouncer pool limit or a DNS
failure look like to a process that still holds pooled connections. Only the process
given the proxy's address is affected; the shared server is never touched.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

CHUNK_BYTES = 65536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._refusing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.refused = 0  # connections closed at once while refusing
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def refuse_new(self) -> None:
        self._refusing.set()

    def accept_new(self) -> None:
        self._refusing.clear()

    def cut(self) -> None:
        """Refuse new connections and break the open ones (a server gone mid-exchange)."""
        self._refusing.set()
        with self._lock:
            for sock in self._sockets:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._sockets.clear()

    def close(self) -> None:
        with suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with suppress(OSError):
                    sock.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if self._refusing.is_set():
                with self._lock:
                    self.refused += 1
                client.close()
                continue
            self._forward(client)

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            self._sockets += [client, upstream]
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy until either side closes, then close both."""
    try:
        while data := source.recv(CHUNK_BYTES):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@contextmanager
def tcp_proxy(target_host: str, target_port: int) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target_host, target_port).start()
    try:
        yield proxy
    finally:
        proxy.close()
