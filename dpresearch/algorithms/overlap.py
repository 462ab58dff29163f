"""Averaging uncompressed gradients while the backward pass is still running (W = 1).

The flat gradient row is cut into buckets of consecutive parameters taken in reverse
registration order — roughly the order in which backward finishes them — with a small first
bucket (as DDP) so communication starts early. A bucket's allreduce starts as soon as every
parameter in it has its gradient (a post-accumulate-grad hook). Each bucket is a contiguous
slice of the row, so the result is the whole-row allreduce cut into pieces: the same
element-wise sums and the same bytes.

Every rank must finish its buckets in the same order, which holds when all ranks run the same
model without data-dependent control flow (parameters unused in a step are reduced at the end,
in bucket order). Set `algorithm.overlap=false` otherwise.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor

from dpresearch.comm.base import Communicator, PendingOp
from dpresearch.replicas import Replicas

MB = 2**20


class OverlappedGradientAverage:
    """Starts bucketed sum-allreduces from gradient hooks; `finish()` waits and averages."""

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
    ) -> None:
        if replicas.num_local != 1:
            raise ValueError("overlapping needs one worker per process")
        self.grads, self.comm = replicas.grads, comm
        params = [p for p in replicas.models[0].parameters() if p.requires_grad]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        itemsize = self.grads.element_size()
        self.ranges: list[tuple[int, int]] = []
        self.sizes: list[int] = []
        members: list[int] = []
        cap = first_bucket_mb * MB
        for i in reversed(range(len(params))):
            members.append(i)
            if (offsets[members[0] + 1] - offsets[i]) * itemsize >= cap or i == 0:
                self.ranges.append((offsets[i], offsets[members[0] + 1]))
                self.sizes.append(len(members))
                for j in members:
                    params[j].register_post_accumulate_grad_hook(
                        partial(self._ready, len(self.ranges) - 1)
                    )
                members, cap = [], bucket_mb * MB
        self._reset()

    def _reset(self) -> None:
        self.remaining = list(self.sizes)
        self.pending: dict[int, PendingOp] = {}

    def _start(self, bucket: int) -> None:
        start, end = self.ranges[bucket]
        self.pending[bucket] = self.comm.start_all_reduce_sum(self.grads[:, start:end])

    def _ready(self, bucket: int, _param: Tensor) -> None:
        self.remaining[bucket] -= 1
        if self.remaining[bucket] == 0:
            self._start(bucket)

    def finish(self) -> None:
        """Start any bucket whose parameters got no gradient, wait for all, divide by K."""
        for bucket in range(len(self.ranges)):
            if bucket not in self.pending:
                self._start(bucket)
        for bucket in range(len(self.ranges)):
            self.pending[bucket].wait()
        self.grads.div_(self.comm.world_size)
        self._reset()
