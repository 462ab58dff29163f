"""Collectives over workers, their byte accounting and the network cost model."""

from dpresearch.comm.base import Communicator
from dpresearch.comm.ledger import CommLedger, CommOp
from dpresearch.comm.network import NetworkModel

__all__ = ["CommLedger", "CommOp", "Communicator", "NetworkModel"]
