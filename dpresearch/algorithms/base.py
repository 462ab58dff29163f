"""The algorithm contract.

An algorithm receives the local replicas (gradients already in `replicas.grads` after each
worker's backward), the communicator and one optimizer per local worker. The trainer calls
`before_forward(step)` and `after_backward(step)` every step and `consensus()` whenever it needs
the single model the run stands for (evaluation, the final checkpoint). An algorithm never
asks which process a worker lives on: it only uses the communicator's stacked collectives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

from dpresearch.comm.base import Communicator
from dpresearch.replicas import Replicas


class Algorithm(ABC):
    """Base class; subclasses implement `after_backward` and may override the rest.

    `evaluates_local_models`: the workers' models differ (gossip, local SGD between averages),
    so evaluation also reports each worker's own model (`test/acc_local_mean`, `_min`).
    """

    evaluates_local_models: bool = False

    def __init__(
        self, replicas: Replicas, comm: Communicator, optimizers: list[torch.optim.Optimizer]
    ) -> None:
        if len(optimizers) != replicas.num_local:
            raise ValueError("one optimizer per local worker is required")
        self.replicas = replicas
        self.comm = comm
        self.optimizers = optimizers

    def before_forward(self, step: int) -> None:
        """Called before the workers' forward passes of `step`."""

    @abstractmethod
    def after_backward(self, step: int) -> None:
        """Called once every local worker's gradient of `step` is in `replicas.grads`;
        must leave every replica ready for the next forward (normally: optimizer stepped)."""

    def consensus(self) -> tuple[Tensor, Tensor]:
        """The (flat params, flat float buffers) of the model the run stands for, identical on
        every process: by default the average over all workers (unrecorded traffic)."""
        params = self.replicas.params.clone()
        buffers = self.replicas.buffers.clone()
        self.comm.all_reduce(params, op="mean", record=False)
        self.comm.all_reduce(buffers, op="mean", record=False)
        return params[0], buffers[0]

    def metrics(self) -> dict[str, float]:
        """Extra metrics logged at every log step (same value on every process); may use
        unrecorded collectives."""
        return {}

    def describe(self) -> dict[str, Any]:
        """Facts about the run's set-up printed at the start and stored in summary.json
        (e.g. the topology's spectral gap)."""
        return {}

    def state_dict(self) -> dict:
        """Algorithm state to checkpoint (beyond replicas and optimizers)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
