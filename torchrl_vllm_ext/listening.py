"""What of ours listens on the network binds the host it was given, never every interface.

torch's ``TCPStore`` master listens on every interface (``*:PORT``) whatever host it is
told; handed a socket already bound to the host (``master_listen_fd``), it serves there
only. gloo's pairs listen on the address the machine's host name resolves to unless a
device names the host. Every store and gloo group the package creates goes through here.
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to ``host`` only (``port`` 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def free_port(host: str) -> int:
    """A port on ``host`` that was free a moment ago: for tools and tests (a listener of
    ours binds first, :func:`listen`, so no other process can take its port meanwhile)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_store(
    host: str,
    timeout: timedelta,
    *,
    world_size: int | None = None,
    wait_for_workers: bool = False,
    listener: socket.socket | None = None,
):
    """A ``TCPStore`` master listening on ``host`` only (``listener``: a socket bound to
    it already, taken over; else one on a free port). ``store.port`` says where;
    ``wait_for_workers``: return once ``world_size`` members joined.

    Examples:
        >>> from datetime import timedelta
        >>> store = serve_store("127.0.0.1", timedelta(seconds=5))
        >>> store.set("k", "v"); store.get("k")
        b'v'
    """
    import torch.distributed as dist

    listener = listener if listener is not None else listen(host)
    port = listener.getsockname()[1]
    # The store closes the descriptor when it goes: hand it over.
    fd = listener.detach()
    return dist.TCPStore(
        host,
        port,
        world_size,
        True,
        timeout,
        wait_for_workers=wait_for_workers,
        master_listen_fd=fd,
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback.

    >>> is_loopback("127.0.0.2"), is_loopback("localhost"), is_loopback("10.0.0.1")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gloo_options(host: str, timeout: timedelta):
    """Options of a gloo process group whose members all reach ``host``: on a loopback
    host its pairs listen on that address, not on what the machine's name resolves to
    (a routable address on most hosts); elsewhere gloo's default device."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    if is_loopback(host):
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    else:
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return options
