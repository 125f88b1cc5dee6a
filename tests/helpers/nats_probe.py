"""A bare NATS protocol client over a socket, to ask a real nats-server what it lets a user do:
no client library between the test and the server's answer.

    with NatsProbe(host, port, user="tokenizer", password=pw) as probe:
        probe.can_subscribe("llm.v1.stream.*")   # False: the server answered -ERR 'Permissions ...'
        probe.can_publish("llm.v1.abort")        # True

Each question is the command then a PING; the server answers in order, so an error for the command
comes before the PONG, and no error before it means the server took the command.
"""

from __future__ import annotations

import json
import socket


class ConnectRefused(Exception):
    """The server refused the connection itself (its -ERR line is the message)."""


class NatsProbe:
    def __init__(
        self, host: str, port: int, user: str | None = None, password: str | None = None
    ) -> None:
        self._sock = socket.create_connection((host, port), timeout=5)
        self._buf = b""
        self._sid = 0
        info = self._line()
        assert info.startswith("INFO "), info
        connect: dict[str, object] = {"verbose": False, "pedantic": False, "headers": True}
        if user is not None:
            connect.update(user=user, **{"pass": password})
        self._send(f"CONNECT {json.dumps(connect)}\r\nPING\r\n")
        errors = self._until_pong()
        if errors:
            self.close()
            raise ConnectRefused(errors[0])

    def can_subscribe(self, subject: str) -> bool:
        self._sid += 1
        self._send(f"SUB {subject} {self._sid}\r\nPING\r\n")
        return not self._until_pong()

    def can_publish(self, subject: str) -> bool:
        self._send(f"PUB {subject} 0\r\n\r\nPING\r\n")
        return not self._until_pong()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> NatsProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, text: str) -> None:
        self._sock.sendall(text.encode())

    def _line(self) -> str:
        while b"\r\n" not in self._buf:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"the server closed the connection (after {self._buf!r})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line.decode()

    def _until_pong(self) -> list[str]:
        """The -ERR lines before the next PONG (a closed connection counts as its last error)."""
        errors: list[str] = []
        while True:
            try:
                line = self._line()
            except ConnectionError as e:
                return [*errors, str(e)]
            if line == "PONG":
                return errors
            if line.startswith("-ERR"):
                errors.append(line)
            elif line == "PING":
                self._send("PONG\r\n")
            elif line.startswith("MSG "):  # a message on a granted subscription: skip its payload
                size = int(line.split()[-1])
                while len(self._buf) < size + 2:
                    self._buf += self._sock.recv(65536)
                self._buf = self._buf[size + 2 :]
