"""Bulk TCP goodput across one shaped link: does the link deliver its rate?

    ip netns exec <ns of rank 1> python -m benchmarks.netem.linkcheck serve 10.77.0.2 5201
    ip netns exec <ns of rank 0> python -m benchmarks.netem.linkcheck send 10.77.0.2 5201 N

The sender writes N bytes and waits for a one-byte reply sent after the last
byte arrived; it prints the goodput in bits per second. At MTU 1500 TCP
carries at most 1448 payload bytes per 1514-byte frame, so a perfect link
shaped at R shows about 0.956 R.
"""

from __future__ import annotations

import socket
import sys
import time

CHUNK = 1 << 20


def serve(host: str, port: int, timeout_s: float = 60.0) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(timeout_s)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(timeout_s)
            expected = int.from_bytes(connection.recv(8, socket.MSG_WAITALL), "big")
            received = 0
            while received < expected:
                data = connection.recv(CHUNK)
                if not data:
                    break
                received += len(data)
            connection.sendall(b"k")


def send(host: str, port: int, nbytes: int, timeout_s: float = 60.0) -> float:
    """Goodput in bits per second of sending ``nbytes`` to ``host:port``."""
    deadline = time.monotonic() + 10.0
    while True:  # the server may still be starting
        try:
            connection = socket.create_connection((host, port), timeout=timeout_s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with connection:
        connection.sendall(nbytes.to_bytes(8, "big"))
        payload = bytes(min(CHUNK, nbytes))
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            left -= connection.send(payload[: min(left, len(payload))])
        connection.recv(1)
        return 8.0 * nbytes / (time.perf_counter() - start)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "serve":
        serve(argv[1], int(argv[2]))
        return 0
    if len(argv) >= 4 and argv[0] == "send":
        print(f"{send(argv[1], int(argv[2]), int(argv[3])):.0f}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
