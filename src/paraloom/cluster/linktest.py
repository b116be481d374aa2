"""Raw TCP throughput between two endpoints: one stream, bytes counted at the receiver.

    python -m paraloom.cluster.linktest recv HOST PORT NBYTES   (prints MB/s as JSON)
    python -m paraloom.cluster.linktest send HOST PORT NBYTES
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def receive(host: str, port: int, nbytes: int, timeout: float = 60.0) -> float:
    with socket.create_server((host, port)) as server:
        server.settimeout(timeout)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            buf = bytearray(CHUNK)
            got, start = 0, None
            while got < nbytes:
                n = conn.recv_into(buf)
                if not n:
                    break
                if start is None:
                    start = time.perf_counter()
                got += n
            seconds = time.perf_counter() - start
            conn.sendall(b"k")
    return got / seconds / 1e6


def transmit(host: str, port: int, nbytes: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:  # the receiver may still be starting
        try:
            conn = socket.create_connection((host, port), timeout=timeout)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        data = bytes(CHUNK)
        sent = 0
        while sent < nbytes:
            conn.sendall(data[: min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)
        conn.recv(1)


def main(argv: list[str]) -> int:
    mode, host, port, nbytes = argv[0], argv[1], int(argv[2]), int(argv[3])
    if mode == "recv":
        print(json.dumps({"MBps": receive(host, port, nbytes)}), flush=True)
    else:
        transmit(host, port, nbytes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
