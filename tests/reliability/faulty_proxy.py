"""A TCP proxy on a loopback port that the tests put in front of the S3 server, and switch between faults.

Modes (``proxy.mode = ...``, takes effect at once, also on open connections):

- ``"up"``: bytes are relayed both ways (optionally each client->server chunk after ``delay_s``: a slow S3);
- ``"refuse"``: connections are reset as soon as they are accepted (as if the server were stopped);
- ``"blackhole"``: connections are accepted and what they send is read and dropped, nothing ever answers
  (a hung server: the nastiest case, only a client-side timeout ends a request).

Switching away from ``"up"`` resets every relayed connection, so pooled keep-alive connections of the
client see the fault too.
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultyProxy:
    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = 0.0
        self._mode = "up"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stopped = False
        threading.Thread(target=self._accept_loop, name="faulty-proxy", daemon=True).start()

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        assert value in ("up", "refuse", "blackhole"), value
        with self._lock:
            self._mode = value
            conns, self._conns = self._conns, set()
        if value != "up":
            for s in conns:
                _reset(s)

    def stop(self) -> None:
        self._stopped = True
        self.mode = "refuse"
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            mode = self._mode
            if mode == "refuse":
                _reset(client)
            elif mode == "blackhole":
                threading.Thread(target=_swallow, args=(client,), daemon=True).start()
            else:
                threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            if self._mode != "up":
                _reset(client)
                _reset(server)
                return
            self._conns.update((client, server))
        threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
        self._pump(server, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream and self.delay_s:
                    time.sleep(self.delay_s)
                if self._mode != "up":
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._conns.discard(s)
                _reset(s)


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def _swallow(s: socket.socket) -> None:
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    finally:
        _reset(s)
