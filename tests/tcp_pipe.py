"""A ProxyCommand for the tests: `python tcp_pipe.py HOST PORT [LOG]` connects to
HOST:PORT and copies stdin to the socket and the socket to stdout, like `nc` or
`ssh -W` would. With LOG it first appends "HOST PORT" there, so a test can see it ran."""

from __future__ import annotations

import os
import socket
import sys
import threading


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        with open(sys.argv[3], "a") as log:
            log.write(f"{host} {port}\n")
    sock = socket.create_connection((host, port))

    def upstream() -> None:
        while data := os.read(0, 65536):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while data := sock.recv(65536):
        os.write(1, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
