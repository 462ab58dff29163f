"""SPARTA: sparse parameter averaging (Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema,
Vrabie; "Improving the Efficiency of Distributed Training using Sparse Parameter Averaging",
OpenReview stFPf3gzq1, 2025; shipped by EXO Gym, `exogym/strategy/sparta.py`).

Every step t, every worker i first steps its own inner optimizer on its own gradient, then the
workers average a random subset S_t of the parameter entries, the same on every worker:

    x_i ← InnerOpt_i(x_i, g_i)                      (local step; AdamW in EXO Gym)
    x_i[S_t] ← (1/K) Σ_j x_j[S_t]   for every i       (one allreduce of |S_t| values)

Entries outside S_t stay each worker's own, so the workers drift apart and are pulled together
a fraction p of their entries at a time.

Conventions (each an explicit choice; where EXO Gym differs, its way is an option):

- p (`p`, default 0.005: EXO Gym's `p_sparta` default in `SPARTAStrategy`,
  `SPARTADiLoCoStrategy` and its nanoGPT example; summaries of the paper report p of about
  0.05%–0.5%, i.e. 0.0005–0.005).
  The configuration accepts p in (0, 1]; p = 1 averages every entry every step, which is local
  SGD with period 1 (parameter averaging after every local step). The class itself also takes
  p = 0 (nothing is ever averaged: K independent workers), a limit for ablations and tests.
- The index set is drawn over the flat parameter vector of D entries (`replicas.params`' row),
  fresh every step, from a generator seeded by (run seed, step) alone
  (`compress.rng.stream_seed("sparta", seed, step)`): every worker, simulated or on another
  process, draws the same S_t with no message, and a resumed run draws what the uninterrupted
  one would (nothing of it is checkpointed).
  `selection="fixed"` (default): exactly k = max(1, round(p·D)) distinct entries (at most D;
  k = 0 for p = 0), uniformly without replacement: draw batches of need + ⌊need/4⌋ + 16
  uniform positions (`torch.randint`), keep each new position in draw order until k are
  chosen (the first k distinct draws of a uniform stream are a uniform k-subset); where
  3k > D the first k entries of one `torch.randperm(D)` instead; k = D is every entry. The
  set is sorted. Every step then sends exactly k values.
  `selection="bernoulli"` (EXO Gym's `RandomIndexSelector`): every entry independently with
  probability p, so |S_t| ~ Binomial(D, p) varies by step. Drawn as n ~ Binomial(D, p)
  (`torch.binomial`), then a uniform n-subset as above from the same generator: the same law
  as a per-entry coin and, since the coins are independent, as EXO Gym's per-tensor masks, but
  O(n) work instead of O(D).
- Only parameters are averaged. Optimizer state (AdamW's moments, momentum) stays local, as in
  EXO Gym (it averages `param.data` only); float buffers (BatchNorm statistics) stay local too
  and are averaged only in the evaluated consensus model.
- Order within a step: optimizer step, then averaging (EXO Gym's
  `CommunicateOptimizeStrategy.step`).

Bytes. One allreduce of a `[W, |S_t|]` tensor of the parameters' dtype per step: the ledger
charges each worker |S_t|·4 bytes (fp32; what it hands to the collective) and the network
model prices a ring allreduce, 2(K−1)α + 2(K−1)/K·|S_t|·4/B. The indices cost nothing: they
come from the shared seed. (EXO Gym draws a mask on every rank and broadcasts rank 0's: a
one-byte-per-entry tensor per parameter each step; with a shared seed that message is not
needed, and is not charged here.) A step with an empty set sends nothing.

Under an outer optimizer (DiLoCo: `algorithm=sparta outer=nesterov outer.period=H`, EXO Gym's
`SPARTADiLoCoStrategy`): SPARTA has no exact averaging period of its own to hand over, so
`outer.period` must be given; it keeps averaging its subsets every step, and every H steps the
outer step takes the exact average of the models (`model_rows()`: the parameters) into its
pseudo-gradient and restarts every worker from the anchor. EXO Gym runs the sparse average
first and the outer step after it in the same step, as here.

Evaluation: `consensus()` is the average model x̄ (as in EXO Gym's global evaluation);
`eval_local_models=true` also evaluates every worker's own model (EXO Gym logs rank 0's).
Metric: `sparta/consensus_distance` Ξ² = (1/K) Σ_i ‖x_i − x̄‖² (float64, "metrics" traffic),
`sparta/entries` the number of entries averaged at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dpresearch.algorithms.base import Algorithm, Traits
from dpresearch.algorithms.gossip import consensus_distance
from dpresearch.comm.base import Communicator
from dpresearch.compress.rng import generator, stream_seed
from dpresearch.options import Options
from dpresearch.replicas import Replicas

SELECTIONS = ("fixed", "bernoulli")
# Where 3k > D a permutation of D is cheaper than rejecting repeated draws.
DENSE = 3


@dataclass(frozen=True)
class SPARTAOptions(Options):
    """SPARTA's keys (`algorithm=sparta`; its `seed` is the run's)."""

    p: float = 0.005
    """fraction of the parameter entries averaged every step, in (0, 1] (EXO Gym's 0.005; 1:
    parameter averaging every step)"""
    selection: str = "fixed"
    """fixed (exactly max(1, round(p·D)) entries) | bernoulli (each entry with probability p,
    EXO Gym's RandomIndexSelector)"""
    eval_local_models: bool = True
    """also evaluate every worker's own model"""

    def check(self) -> None:
        check_options(self.p, self.selection, allow_zero=False)


class SPARTA(Algorithm):
    """Local inner steps, then the average of a shared random fraction p of the parameter
    entries, every step (see the module docstring).

    p: fraction of the D entries averaged per step. selection: "fixed" (exactly
    max(1, round(p·D)) entries) or "bernoulli" (each entry with probability p, EXO Gym's).
    seed: the run seed the subsets are drawn from. eval_local_models: also evaluate every
    worker's own model."""

    traits = Traits(drifts=True)
    OPTIONS = SPARTAOptions

    def __init__(
        self,
        replicas: Replicas,
        comm: Communicator,
        optimizers: list[torch.optim.Optimizer],
        p: float = SPARTAOptions.p,
        selection: str = SPARTAOptions.selection,
        seed: int = 0,
        eval_local_models: bool = SPARTAOptions.eval_local_models,
    ) -> None:
        super().__init__(replicas, comm, optimizers)
        check_options(p, selection, allow_zero=True)
        self.p, self.selection, self.seed = float(p), selection, int(seed)
        self.evaluates_local_models = bool(eval_local_models)
        self.last_entries = 0

    # -- the subsets ------------------------------------------------------------------------------
    def indices(self, step: int) -> Tensor:
        """S_t: the sorted flat positions (int64, on the CPU) all workers average after `step`
        (0-based), a pure function of (seed, step, p, selection, D)."""
        return subset_of(self.replicas.num_params, self.p, self.selection, self.seed, step)

    # -- the step ---------------------------------------------------------------------------------
    def after_backward(self, step: int) -> None:
        self.step_optimizers()
        params = self.replicas.params
        cols = self.indices(step)
        self.last_entries = cols.numel()
        if cols.numel() == params.shape[1]:  # every entry: average the rows in place
            self.comm.all_reduce(params, op="mean")
        elif cols.numel():
            cols = cols.to(params.device)
            values = params.index_select(1, cols)
            self.comm.all_reduce(values, op="mean")
            params.index_copy_(1, cols, values)

    # -- reporting --------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        d = self.replicas.num_params
        expected = entries_per_step(d, self.p) if self.selection == "fixed" else self.p * d
        return {"sparta/entries_per_step": expected, "sparta/selection": self.selection}

    def metrics(self) -> dict[str, float]:
        """`sparta/consensus_distance` Ξ² = (1/K) Σ_i ‖x_i − x̄‖² (float64; "metrics" traffic:
        the sum of the rows, then the K squared distances) and `sparta/entries`."""
        return {
            "sparta/consensus_distance": consensus_distance(self.comm, self.replicas.params),
            "sparta/entries": float(self.last_entries),
        }


def entries_per_step(numel: int, p: float) -> int:
    """k of `selection="fixed"`: max(1, round(p·D)), at most D; 0 for p = 0."""
    return 0 if p == 0 else min(numel, max(1, round(p * numel)))


def subset_of(numel: int, p: float, selection: str, seed: int, step: int) -> Tensor:
    """The sorted positions averaged after `step` (see the module docstring)."""
    gen = generator(stream_seed("sparta", seed, step))
    if selection == "fixed":
        k = entries_per_step(numel, p)
    else:
        trials = torch.tensor([float(numel)], dtype=torch.float64)
        k = int(torch.binomial(trials, torch.tensor([p], dtype=torch.float64), generator=gen))
    return distinct(numel, k, gen)


def distinct(numel: int, k: int, gen: torch.Generator) -> Tensor:
    """k distinct positions of 0 … numel−1, uniformly without replacement, sorted: the first k
    distinct values of batches of uniform draws (or, where 3k > numel, of one permutation)."""
    if k >= numel:
        return torch.arange(numel)
    if k <= 0:
        return torch.zeros(0, dtype=torch.long)
    if DENSE * k > numel:
        return torch.randperm(numel, generator=gen)[:k].sort().values
    chosen = torch.zeros(0, dtype=torch.long)
    while chosen.numel() < k:
        need = k - chosen.numel()
        draws = torch.randint(0, numel, (need + need // 4 + 16,), generator=gen)
        pool = torch.cat([chosen, draws])
        values, inverse = torch.unique(pool, return_inverse=True)
        first = torch.full_like(values, pool.numel())
        first.scatter_reduce_(0, inverse, torch.arange(pool.numel()), "amin")
        # the earlier choices come first (distinct, at the front), then new values in draw order
        chosen = pool[first.sort().values[:k]]
    return chosen.sort().values


def check_options(p: Any, selection: Any, allow_zero: bool = False) -> None:
    """Raise ValueError (one line) for p outside (0, 1] ([0, 1] with `allow_zero`) or an
    unknown selection."""
    number = isinstance(p, (int, float)) and not isinstance(p, bool)
    low_ok = number and (p >= 0 if allow_zero else p > 0)
    if not (number and low_ok and p <= 1):
        raise ValueError(
            f"algorithm.p={p}: the fraction of parameter entries averaged every step must be "
            "in (0, 1] (EXO Gym's default 0.005; 1 averages every entry, local SGD with "
            "period 1)"
        )
    if selection not in SELECTIONS:
        raise ValueError(f"algorithm.selection={selection}; choose one of: {', '.join(SELECTIONS)}")
