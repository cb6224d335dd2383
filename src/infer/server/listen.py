"""The server's listening socket, bound before the model loads (a port in use fails early)."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port); ValueError naming --host / --port if that fails."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address of this machine ({exc}): give an IP or a "
                         "resolvable name") from None
    family, _, _, _, address = infos[0]
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (with proto 0
    # every response's body waits for the client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): another process uses the "
                         "port, or the address is not this machine's; pick another --port or --host") from None
    return sock
