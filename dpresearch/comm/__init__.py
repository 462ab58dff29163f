"""Collectives over workers, their byte accounting and the network cost model.

Names are imported on first use, so the network model (`dpresearch.comm.network`, pure
Python) can be used — e.g. to re-price finished runs in the analysis — without importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dpresearch.comm.base import Communicator
    from dpresearch.comm.ledger import CommLedger, CommOp
    from dpresearch.comm.network import NetworkModel

_WHERE = {
    "Communicator": "dpresearch.comm.base",
    "CommLedger": "dpresearch.comm.ledger",
    "CommOp": "dpresearch.comm.ledger",
    "NetworkModel": "dpresearch.comm.network",
}

__all__ = ["CommLedger", "CommOp", "Communicator", "NetworkModel"]


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
