"""Issue 32, item 4: the anchor code's conventions as named options of compressed Adam.

Each option against an independent re-statement of DeepSpeed's rule, written here per worker in
float64 (not by calling our code): `compress_per_parameter=true` (deepspeed/runtime/comm/nccl.py
`compressed_allreduce`, once per parameter as deepspeed/runtime/fp16/onebit/adam.py calls it)
and 0/1 Adam's `convention=deepspeed` (deepspeed/runtime/fp16/onebit/zoadam.py `step`, its
counters as DeepSpeed keeps them). Two workers, a tiny model, a few steps after the freeze.
The defaults (ours) are the existing tests' (tests/test_compressed_adam.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SMALL, TOL64, compose_config, gap
from torch import nn

from dpresearch.algorithms.compressed_adam import (
    OnebitAdam,
    OnebitAdamAlgorithm,
    ZeroOneAdam,
    ZeroOneAdamAlgorithm,
)
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.config.validate import ConfigError, validate
from dpresearch.replicas import Replicas

K = 2
F64 = torch.float64
BETAS, EPS = (0.9, 0.999), 1e-8
# Linear(3, 6), Tanh, Linear(6, 2): tensors of 18, 6, 12 and 2 entries; DeepSpeed pads each to
# a multiple of K·lcm(K, 8) = 16: 32, 16, 16, 16 (chunks of 16, 8, 8, 8 per server)
SIZES, PADDED = [18, 6, 12, 2], [32, 16, 16, 16]

pytestmark = pytest.mark.usefixtures("one_thread")


# -- DeepSpeed's rules, re-stated ------------------------------------------------------------------


def sign(x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's `x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)`: +1 where x >= 0."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def scale(x: torch.Tensor) -> torch.Tensor:
    """‖x‖₂/√len(x), as the float32 the message carries."""
    return (x.norm() / math.sqrt(x.numel())).float().double()


class DeepSpeedTensorAllreduce:
    """`NcclBackend.compressed_allreduce` of one parameter tensor over K workers: the tensor
    zero-padded to `padded` entries, worker_error of `padded`, server_error of padded/K."""

    def __init__(self, n: int, padded: int) -> None:
        self.n, self.padded, self.chunk = n, padded, padded // K
        self.worker_error = [torch.zeros(padded, dtype=F64) for _ in range(K)]
        self.server_error = [torch.zeros(self.chunk, dtype=F64) for _ in range(K)]

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        signs, scales = [], []
        for w in range(K):
            buffer = torch.cat([xs[w], torch.zeros(self.padded - self.n, dtype=F64)])
            buffer = buffer + self.worker_error[w]
            s = scale(buffer)
            self.worker_error[w] = buffer - s * sign(buffer)
            signs.append(sign(buffer))
            scales.append(s)
        result = []
        for server in range(K):  # server `server` gets chunk `server` of every worker's signs
            part = slice(server * self.chunk, (server + 1) * self.chunk)
            compensated = sum(signs[w][part] * (scales[w] / K) for w in range(K))
            compensated = compensated + self.server_error[server]
            s = scale(compensated)
            self.server_error[server] = compensated - s * sign(compensated)
            result.append(s * sign(compensated))
        return torch.cat(result)[: self.n]

    def reset(self) -> None:
        for e in self.worker_error + self.server_error:
            e.zero_()


class DeepSpeedAllreduce:
    """One `DeepSpeedTensorAllreduce` per parameter tensor of the flat row."""

    def __init__(self) -> None:
        self.tensors = [DeepSpeedTensorAllreduce(n, p) for n, p in zip(SIZES, PADDED, strict=True)]

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        out, offset = [], 0
        for tensor in self.tensors:
            out.append(tensor([x[offset : offset + tensor.n] for x in xs]))
            offset += tensor.n
        return torch.cat(out)

    def reset(self) -> None:
        for tensor in self.tensors:
            tensor.reset()


def deepspeed_onebit_adam(grads, x0, lr, freeze):
    """1-bit Adam with DeepSpeed's update m/(√v + ε) and its per-tensor compression; the
    warm-up on the mean gradient (the engine's allreduce) for `freeze` steps."""
    b1, b2 = BETAS
    x, m, v = x0.clone(), torch.zeros_like(x0), torch.zeros_like(x0)
    allreduce = DeepSpeedAllreduce()
    for t, g in enumerate(grads, start=1):
        if t <= freeze:
            mean = g.mean(0)
            m = b1 * m + (1 - b1) * mean
            v = b2 * v + (1 - b2) * mean**2
        else:
            m = allreduce([b1 * m + (1 - b1) * g[w] for w in range(K)])
        x = x - lr * m / (v.sqrt() + EPS)
    return x


def deepspeed_zero_one_adam(grads, x0, lr, var_freeze_step, var_update_scaler,
                            local_step_scaler, local_step_clipper):  # fmt: skip
    """DeepSpeed's `ZeroOneAdam.step`, one call per gradient, its state kept as it keeps it
    (weight decay 0, one parameter group); every worker's model."""
    b1, b2 = BETAS
    xs = [x0.clone() for _ in range(K)]
    ms = [torch.zeros_like(x0) for _ in range(K)]
    buffers = [torch.zeros_like(x0) for _ in range(K)]  # momentum_accumulator (the negated u)
    v = torch.zeros_like(x0)
    step, var_interval, var_counter = 0, 1, 0
    local_interval, local_counter, lrs = 1, 0, 0.0
    initialized = freeze_key = reinitialized = False
    allreduce = DeepSpeedAllreduce()
    for g in grads:
        step += 1
        if not initialized:  # the first call: buffers made, nothing updated
            initialized = True
            continue
        if not freeze_key:
            if step % var_interval == 0:  # the engine allreduced this gradient
                mean = g.mean(0)
                v = b2 * v + (1 - b2) * mean * mean
                ms = [b1 * m + (1 - b1) * mean for m in ms]
            else:
                onebit = allreduce([g[w] for w in range(K)])
                ms = [b1 * m + (1 - b1) * onebit for m in ms]
        else:
            ms = [b1 * ms[w] + (1 - b1) * g[w] for w in range(K)]
            lrs += lr
        for w in range(K):
            update = ms[w] / (v.sqrt() + EPS)
            xs[w] = xs[w] - lr * update
            if freeze_key:
                buffers[w] = buffers[w] - lr * update
        if freeze_key and step % local_interval == 0:
            sent = []
            for w in range(K):
                xs[w] = xs[w] - buffers[w]
                sent.append(buffers[w] * (v.sqrt() + EPS))
            average = allreduce(sent)
            for w in range(K):
                ms[w] = -average / lrs
                xs[w] = xs[w] + average / (v.sqrt() + EPS)
                buffers[w] = torch.zeros_like(x0)
            lrs = 0.0
        if not freeze_key:
            if step % var_interval == 0:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            local_counter += 1
            if local_counter == local_step_scaler:
                local_counter = 0
                local_interval = min(local_step_clipper, local_interval * 2)
        if step > var_freeze_step:
            freeze_key = True
        if freeze_key and not reinitialized:
            allreduce.reset()
            reinitialized = True
    return xs


# -- the harness: our algorithm on injected gradients ---------------------------------------------


def harness(optimizer_class, algorithm_class, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(F64)
    replicas = Replicas(model, K, torch.device("cpu"))
    comm = SimulatedCommunicator(K, NetworkModel.preset("10gbe"))
    optimizers = [optimizer_class(m.parameters(), **options) for m in replicas.models]
    return replicas, comm, algorithm_class(replicas, comm, optimizers)


def gradients(steps: int, d: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(K, d, generator=gen, dtype=F64) * (1 + t % 3) for t in range(steps)]


def run(replicas, algorithm, grads, start: int = 0) -> None:
    for step, g in enumerate(grads, start=start):
        replicas.grads.copy_(g)
        algorithm.after_backward(step)


def test_onebit_adam_per_parameter_is_deepspeeds_compressed_allreduce():
    lr, freeze, steps = 0.01, 3, 9
    options = dict(lr=lr, freeze_step=freeze, bias_correction=False)
    replicas, comm, algorithm = harness(
        OnebitAdam, OnebitAdamAlgorithm, compress_per_parameter=True, **options
    )
    x0 = replicas.params[0].clone()
    assert x0.numel() == sum(SIZES)
    grads = gradients(steps, x0.numel())
    run(replicas, algorithm, grads)
    expected = deepspeed_onebit_adam(grads, x0, lr, freeze)
    for w in range(K):
        assert gap(replicas.params[w], expected) <= TOL64, w
    # bytes per worker: 8·D per float64 warm-up step; per 1-bit step Σ (K + 1)·(4 + P/(8K))
    per_call = sum((K + 1) * (4 + p // (8 * K)) for p in PADDED)
    assert per_call == 63 and algorithm.onebit.bytes_per_call == per_call
    per_worker = freeze * 8 * x0.numel() + (steps - freeze) * per_call
    assert comm.ledger.bytes_by_worker == [per_worker] * K
    # the padding carries error: the worker errors past each tensor's entries are not zero
    assert any(part.worker_error[:, n:].abs().max() > 0
               for n, part in zip(SIZES, algorithm.onebit.parts, strict=True))  # fmt: skip
    # ours (one vector, the default) is another computation
    other, _, default = harness(OnebitAdam, OnebitAdamAlgorithm, **options)
    run(other, default, grads)
    assert gap(other.params[0], expected) > 1e-6


def test_per_parameter_state_dict_continues_bit_for_bit():
    options = dict(lr=0.01, freeze_step=2, compress_per_parameter=True)
    replicas, _, algorithm = harness(OnebitAdam, OnebitAdamAlgorithm, **options)
    grads = gradients(8, replicas.num_params)
    run(replicas, algorithm, grads[:5])
    onebit = {k: v.clone() for k, v in algorithm.onebit.state_dict().items()}
    saved = {"m": algorithm.m.clone(), "v": algorithm.v.clone(), "onebit": onebit}
    params = replicas.params.clone()
    run(replicas, algorithm, grads[5:], start=5)
    other, _, resumed = harness(OnebitAdam, OnebitAdamAlgorithm, **options)
    other.params.copy_(params)
    resumed.load_state_dict(saved)
    run(other, resumed, grads[5:], start=5)
    assert torch.equal(other.params, replicas.params)


def test_zero_one_adam_deepspeed_convention_is_deepspeeds_step():
    """F = 5, κ = 2, scaler 2, H = 4 over 16 steps (DeepSpeed's s = t + 1): s = 1 only
    initialises; variance at s = 2, 3, 4, 6, the 1-bit gradient average at s = 5; errors zeroed
    and the freeze after s = 6; synchronisations at s = 7, 8, 10, 12, 16."""
    lr, steps = 0.01, 16
    schedule = dict(var_freeze_step=5, var_update_scaler=2, local_step_scaler=2,
                    local_step_clipper=4)  # fmt: skip
    replicas, comm, algorithm = harness(
        ZeroOneAdam, ZeroOneAdamAlgorithm, lr=lr, bias_correction=False,
        compress_per_parameter=True, convention="deepspeed", **schedule,
    )  # fmt: skip
    x0 = replicas.params[0].clone()
    grads = gradients(steps, x0.numel())
    run(replicas, algorithm, grads)
    expected = deepspeed_zero_one_adam(grads, x0, lr, **schedule)
    for w in range(K):
        assert gap(replicas.params[w], expected[w]) <= TOL64, w
    assert algorithm.variance == {1, 2, 3, 5} and algorithm.freeze == 6
    # traffic: 4 variance allreduces; 1-bit: one gradient average and 5 synchronisations
    ops = comm.ledger.op_counts
    assert ops == {"allreduce": 4, "alltoall": 6 * len(SIZES), "allgather": 6 * len(SIZES)}
    # the paper's convention (ours) is another computation
    other, _, paper = harness(
        ZeroOneAdam, ZeroOneAdamAlgorithm, lr=lr, bias_correction=False,
        compress_per_parameter=True, **schedule,
    )  # fmt: skip
    run(other, paper, grads)
    assert gap(other.params[0], expected[0]) > 1e-6


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["optimizer=onebit_adam", "optimizer.compress_per_parameter=2"],
         "compress_per_parameter=2: must be true or false"),
        (["optimizer=zero_one_adam", "optimizer.compress_per_parameter=yes"],
         "compress_per_parameter=yes: must be true or false"),
        (["optimizer=zero_one_adam", "optimizer.convention=torch"],
         "convention='torch'; choose one of: paper, deepspeed"),
    ],
)  # fmt: skip
def test_bad_convention_values_are_refused_in_one_line(overrides, fragment):
    from dpresearch.config.preflight import preflight

    with pytest.raises(ConfigError, match=fragment) as caught:
        cfg = compose_config(*SMALL, *overrides)
        validate(cfg)
        preflight(cfg)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "options",
    [
        ["optimizer=onebit_adam", "optimizer.freeze_step=5",
         "optimizer.compress_per_parameter=true"],
        ["optimizer=zero_one_adam", "optimizer.var_freeze_step=6", "optimizer.var_update_scaler=2",
         "optimizer.local_step_scaler=2", "optimizer.local_step_clipper=4",
         "optimizer.convention=deepspeed", "optimizer.compress_per_parameter=true",
         "optimizer.bias_correction=false"],
    ],
)  # fmt: skip
def test_the_options_run_from_the_command_line_config(options):
    """The YAML's options reach the algorithm: 20 steps on 4 simulated workers (the run ends on
    a synchronisation: every worker the same model), another model than the defaults'."""
    from helpers import four_workers_rows64 as rows64

    rows = rows64(*options, "optimizer.lr=0.01")
    default = rows64(*options[:2], "optimizer.lr=0.01")
    assert torch.isfinite(rows).all()
    assert all(torch.equal(rows[w], rows[0]) for w in range(1, 4))
    assert gap(rows, default) > 1e-6
