"""Counters of what happened on one client's connections."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ClientStats"]


@dataclass
class ClientStats:
    """What happened on this client's connections (also shown by the CLI's ``--json``)."""

    connections: int = 0
    reconnects: int = 0
    tickets_offered: int = 0
    early_data_accepted: int = 0
