"""A TCP port reserved for the life of a service (TorchRL's ``get_master_port()``)."""

from __future__ import annotations

import socket


class PortReservation:
    """Holds a free TCP port bound (not listening) until :meth:`close`, so nothing else on
    this host takes it meanwhile.

    Examples:
        >>> port = PortReservation()
        >>> port.port > 0
        True
        >>> port.close()
    """

    def __init__(self, host: str = "127.0.0.1"):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        """Release the port (idempotent)."""
        self._sock.close()


__all__ = ["PortReservation"]
