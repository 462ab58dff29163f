"""DES-LOC (Iacob et al. 2025, "DES-LOC: Desynced Low Communication Adaptive Optimizers",
arXiv 2505.22549): local Adam whose parameters and optimizer states are averaged over the
workers each at its own period.

Every worker steps its own optimizer on its own gradient (clipped by `train.grad_clip` where
set). After step t (1-based), a quantity whose period divides t is replaced by its mean over
all K workers: the parameters every K_x = `period` steps (local SGD's averaging, inherited),
each optimizer state named in `state_periods` every K of its own (Adam's first moment
`exp_avg` every K_u, its second `exp_avg_sq` every K_v). A state not named stays local.
Averaging after step t is the paper's averaging before step t + 1 (its "t mod K = 0" with a
0-based t); the one difference is that a period dividing the run's length averages once more
after the last step.

- K_u = K_v = K_x is Local Adam (local SGD with `average_optimizer_state=true`), exactly.
- Bytes: each sync is one allreduce of its kind's rows, the algorithm's traffic
  (`comm/bytes`); `desloc/bytes_<kind>` (kind: `params`, then each state name) splits it per
  local worker, measured at the ledger.
- An outer optimizer (`outer=...`) takes over the parameter sync as it does local SGD's (its
  period is K_x); the states stay this algorithm's, at their own periods, so `outer.inner_state`
  must be `keep`. Outer SGD with lr 1 and no momentum (`outer=sgd`) is DES-LOC itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpresearch.algorithms.local_sgd import LocalSGD, LocalSGDOptions, average_optimizer_state
from dpresearch.algorithms.outer.optimizer import OuterOptions
from dpresearch.comm.base import Communicator
from dpresearch.replicas import Replicas

PARAMS = "params"


# The paper's recommendation for K_x = 8: K_u = 3·K_x, K_v = 6·K_x (read-only: a default).
PAPER_PERIODS: Mapping[str, int] = MappingProxyType({"exp_avg": 24, "exp_avg_sq": 48})


def paper_periods() -> dict[str, int]:
    """`PAPER_PERIODS`, a fresh dict."""
    return dict(PAPER_PERIODS)


@dataclass(frozen=True)
class DeslocOptions(LocalSGDOptions):
    """DES-LOC's keys (`algorithm=desloc`): local SGD's (`period` is K_x) and the states'
    periods."""

    state_periods: dict[str, int] = field(default_factory=paper_periods)
    """Optimizer state name → its averaging period in steps (torch's names: Adam's first
    moment `exp_avg` is K_u, its second `exp_avg_sq` K_v; SGD's `momentum_buffer`). A state
    not named stays local."""

    @classmethod
    def from_node(cls, node: Mapping[str, Any] | None) -> DeslocOptions:
        """The options from an `algorithm` node (its local SGD keys ignored); a missing key
        takes its default. Raise ValueError (one line) for a period that is not a whole
        number >= 1."""
        node = node or {}
        local = {f.name: node[f.name] for f in fields(LocalSGDOptions) if f.name in node}
        raw = node.get("state_periods")
        if raw is None:
            return cls(**local)
        if isinstance(raw, DictConfig):
            raw = OmegaConf.to_container(raw, resolve=True)
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"algorithm.state_periods={raw}: give a mapping of state name to period, e.g. "
                "'algorithm.state_periods={exp_avg:24,exp_avg_sq:48}'"
            )
        for key, period in raw.items():
            if isinstance(period, bool) or not isinstance(period, int) or period < 1:
                raise ValueError(
                    f"algorithm.state_periods.{key}={period}: average every N >= 1 steps"
                )
        return cls(**local, state_periods={str(k): int(v) for k, v in raw.items()})


class DesLoc(LocalSGD):
    """Local SGD whose optimizer states are averaged at their own periods (see the module
    docstring). `state_periods`: `DeslocOptions.state_periods`; every other argument is
    `LocalSGD`'s (named here so that the configuration check knows every key)."""

    OPTIONS = DeslocOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        period: int = DeslocOptions.period,
        average_buffers: bool = DeslocOptions.average_buffers,
        average_optimizer_state: bool = DeslocOptions.average_optimizer_state,
        sync_epochs: float = DeslocOptions.sync_epochs,
        state_periods: Mapping[str, int] = PAPER_PERIODS,
    ) -> None:
        super().__init__(
            replicas,
            comm,
            optimizers,
            period,
            average_buffers,
            average_optimizer_state,
            sync_epochs,
        )
        options = DeslocOptions.from_node({"state_periods": state_periods})
        check_combination(self.average_optimizer_state, self.sync_epochs)
        self.state_periods = dict(options.state_periods)
        self.bytes_by_kind = {PARAMS: 0, **{key: 0 for key in self.state_periods}}

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Local SGD's checks, the state periods, the pairing with local SGD's own options, the
        optimizer's state names and an outer optimizer's inner state, before any worker
        starts."""
        super().check_config(cfg)
        alg = cfg.algorithm
        options = DeslocOptions.from_node(alg)
        check_combination(bool(options.average_optimizer_state), options.sync_epochs)
        states = optimizer_states(cfg.optimizer)
        if states is not None:
            for key in options.state_periods:
                if key not in states:
                    target = cfg.optimizer.get("_target_", "?").rsplit(".", 1)[-1]
                    raise ValueError(
                        f"algorithm.state_periods.{key}: the optimizer ({target}) keeps no "
                        f"state '{key}' (its states: {', '.join(sorted(states)) or 'none'}); "
                        "use optimizer=adamw (DES-LOC is local Adam) or name its states"
                    )
        outer = cfg.get("outer")
        if outer and outer.get("_target_") and OuterOptions.from_node(outer).inner_state != "keep":
            raise ValueError(
                f"outer.inner_state={outer.inner_state}: DES-LOC averages the optimizer states "
                "at algorithm.state_periods itself; set outer.inner_state=keep"
            )

    def after_backward(self, step: int) -> None:
        ledger = self.comm.ledger
        before = ledger.bytes_sent
        super().after_backward(step)  # local steps; parameters averaged every K_x
        self.bytes_by_kind[PARAMS] += ledger.bytes_sent - before
        for key, period in self.state_periods.items():
            if (step + 1) % period == 0:
                before = ledger.bytes_sent
                average_optimizer_state(self.optimizers, self.comm, keys=(key,))
                self.bytes_by_kind[key] += ledger.bytes_sent - before

    def metrics(self) -> dict[str, float]:
        return {
            **super().metrics(),
            **{f"desloc/bytes_{kind}": float(n) for kind, n in self.bytes_by_kind.items()},
        }

    def describe(self) -> dict[str, Any]:
        periods = {f"desloc/period_{key}": k for key, k in self.state_periods.items()}
        return {**super().describe(), **periods}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "bytes_by_kind": dict(self.bytes_by_kind)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.bytes_by_kind.update({k: int(v) for k, v in state["bytes_by_kind"].items()})


def check_combination(average_optimizer_state: bool, sync_epochs: Any) -> None:
    """Raise ValueError (one line) for local SGD options DES-LOC replaces or does not have."""
    if average_optimizer_state:
        raise ValueError(
            "algorithm.average_optimizer_state=true averages every state at K_x; with DES-LOC "
            "name each state's period instead (Local Adam: algorithm.state_periods.exp_avg="
            "K_x and .exp_avg_sq=K_x) and set it false"
        )
    if float(sync_epochs or 0.0) > 0:
        raise ValueError(
            f"algorithm.sync_epochs={sync_epochs}: DES-LOC has no dense start (post-local SGD's);"
            " set algorithm.sync_epochs=0"
        )


def optimizer_states(node: Any) -> set[str] | None:
    """The floating-point state names the `optimizer` node's class keeps per parameter, found
    by one step on a scratch model with an embedding, a matrix and a bias (None where it
    cannot be built on it: that optimizer node's own checks report why)."""
    from dpresearch.optim import make_optimizer

    state = torch.random.get_rng_state()  # a scratch model: the caller's stream is restored
    try:
        model = nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 2))
        opt = make_optimizer(node, model)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    except Exception:  # the node's own checks name its fault
        return None
    finally:
        torch.random.set_rng_state(state)
    return {
        key
        for per_param in opt.state.values()
        for key, value in per_param.items()
        if torch.is_tensor(value) and value.is_floating_point() and value.dim() > 0
    }
