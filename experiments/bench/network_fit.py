"""Per-step figures of the emulated-network runs and the fit of the model's gloo terms.

Pure functions over what the benchmark's workers wrote (metrics.jsonl rows, the ops each job
recorded), so they are tested without namespaces or root.

- `step_figures`: per timed step, from the trainer's cumulative metrics: exposed comm
  (`time/comm_s`), overlapped comm (`time/comm_overlapped_s`), busy = exposed + overlapped (the
  communication the step paid for, hidden or not: what a link model predicts), the trainer's
  modeled comm (`comm/modeled_s`), and the step time (`time/compute_s + time/comm_s`).
- `peer_wait`: per step, how long rank 0 waited inside its synchronous collectives for rank 1
  to arrive (both log each call's start on the host's shared monotonic clock): compute skew
  between the ranks, not network time.
- `fit_message_overhead`: the per-message host overhead o that makes modeled + o·messages
  closest to measured in relative terms over a set of cases (least squares on
  modeled/measured − 1).
- `fit_gloo_terms`: o and gloo's allgather factor together, the same way (o ≥ 0, factor ≥ 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from dpresearch.comm.ledger import CommOp
from dpresearch.comm.network import NetworkModel


def step_figures(rows: Sequence[dict], warmup: int, steps: int) -> list[dict[str, float]]:
    """Figures of steps warmup+1 … steps from metrics rows logged every step (row i is step
    i+1; cumulative values)."""
    out = []
    for s in range(warmup, steps):
        a, b = rows[s - 1], rows[s]

        def delta(key: str, a: dict = a, b: dict = b) -> float:
            return b.get(key, 0.0) - a.get(key, 0.0)

        exposed, overlapped = delta("time/comm_s"), delta("time/comm_overlapped_s")
        out.append(
            {
                "exposed": exposed,
                "overlapped": overlapped,
                "busy": exposed + overlapped,
                "modeled": delta("comm/modeled_s"),
                "step": delta("time/compute_s") + exposed,
                "bytes": delta("comm/bytes") + delta("comm/bytes_buffers"),
            }
        )
    return out


def peer_wait(
    mine: Sequence[Sequence], peer: Sequence[Sequence], warmup: int, steps: int
) -> list[float]:
    """Seconds per step (steps warmup+1 … steps) rank 0 had a collective started and waited
    for rank 1 to start it too: the length of the union of [start₀, max(start₀, start₁)] over
    the step's calls (background buckets overlap one another, so their waits are not added).
    `mine`, `peer`: each rank's log, entries ending in (start, end), the same calls in the
    same order."""
    if len(mine) != len(peer) or len(mine) % steps:
        raise ValueError("the ranks logged different collectives")
    per_step = len(mine) // steps
    waits = []
    for s in range(warmup, steps):
        calls = range(s * per_step, (s + 1) * per_step)
        intervals = sorted((mine[i][-2], max(mine[i][-2], peer[i][-2])) for i in calls)
        total, reach = 0.0, float("-inf")
        for start, end in intervals:
            total += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        waits.append(total)
    return waits


def ops_per_step(priced: Sequence[Sequence], steps: int) -> list[CommOp]:
    """The ops of one step from a job's ops [(kind, nbytes, group, peers), ...] over `steps`
    identical steps."""
    per_step, rest = divmod(len(priced), steps)
    if rest:
        raise ValueError(f"{len(priced)} ops do not split into {steps} equal steps")
    first = [CommOp(k, n, g, p) for k, n, g, p in priced[:per_step]]
    if any(
        CommOp(k, n, g, p) != op for (k, n, g, p), op in zip(priced, first * steps, strict=True)
    ):
        raise ValueError("the steps recorded different ops")
    return first


@dataclass(frozen=True)
class Case:
    """One compressor in one regime: mean measured comm per step, its ops per step."""

    name: str
    measured_s: float
    ops: tuple[CommOp, ...]


def modeled(model: NetworkModel, ops: Iterable[CommOp]) -> float:
    return sum(model.op_seconds(op) for op in ops)


def fit_message_overhead(cases: Sequence[Case], model: NetworkModel) -> float:
    """The o ≥ 0 minimising Σ ((modeled_c + o·messages_c) / measured_c − 1)² over `cases`,
    where modeled_c prices case c's ops with `model` as given (its allgather terms included),
    its own overhead_s ignored."""
    base = replace(model, overhead_s=0.0)
    msgs = [sum(base.messages(op) for op in c.ops) / c.measured_s for c in cases]
    target = [1.0 - modeled(base, c.ops) / c.measured_s for c in cases]
    (overhead,), _ = _relative_least_squares([msgs], target)
    return max(0.0, overhead)


def _relative_least_squares(
    columns: Sequence[Sequence[float]], target: Sequence[float]
) -> tuple[list[float], float]:
    """x minimising Σ_c (Σ_j x_j·columns[j][c] − target[c])² for one or two columns (normal
    equations); returns x and the sum of squares."""
    if len(columns) == 1:
        (a,) = columns
        den = sum(v * v for v in a)
        x = [sum(u * v for u, v in zip(a, target, strict=True)) / den if den else 0.0]
    else:
        a, b = columns
        aa = sum(v * v for v in a)
        bb = sum(v * v for v in b)
        ab = sum(u * v for u, v in zip(a, b, strict=True))
        ay = sum(u * v for u, v in zip(a, target, strict=True))
        by = sum(u * v for u, v in zip(b, target, strict=True))
        det = aa * bb - ab * ab
        x = [(ay * bb - by * ab) / det, (by * aa - ay * ab) / det] if det else [0.0, 0.0]
    residual = [
        sum(xj * col[c] for xj, col in zip(x, columns, strict=True)) - target[c]
        for c in range(len(target))
    ]
    return x, sum(r * r for r in residual)


def fit_gloo_terms(cases: Sequence[Case], model: NetworkModel) -> tuple[float, float]:
    """The (o ≥ 0, allgather factor ≥ 1) minimising Σ ((modeled_c + o·messages_c) / measured_c
    − 1)² over `cases`, where modeled_c prices case c's ops with `model`'s α, B and allgather
    latency and the factor on allgather's bandwidth term. Both enter linearly, so this is a
    bounded linear least squares: the best of the unconstrained solution and those with a
    bound held. Without any allgather bandwidth among the cases the factor keeps `model`'s
    value and only o is fitted."""
    plain = replace(model, overhead_s=0.0, allgather_factor=0.0)
    unit = replace(plain, allgather_factor=1.0)
    base = [modeled(plain, c.ops) / c.measured_s for c in cases]
    gather = [modeled(unit, c.ops) / c.measured_s - b for c, b in zip(cases, base, strict=True)]
    if not any(gather):
        return fit_message_overhead(cases, model), model.allgather_factor
    msgs = [sum(plain.messages(op) for op in c.ops) / c.measured_s for c in cases]
    target = [1.0 - b for b in base]
    candidates = []
    (factor, overhead), sse = _relative_least_squares([gather, msgs], target)
    if factor >= 1.0 and overhead >= 0.0:
        candidates.append((sse, overhead, factor))
    # factor held at 1: fit o on what is left
    rest = [t - g for t, g in zip(target, gather, strict=True)]
    (overhead,), sse = _relative_least_squares([msgs], rest)
    candidates.append(
        (sse, overhead, 1.0) if overhead >= 0.0 else (sum(r * r for r in rest), 0.0, 1.0)
    )
    # o held at 0: fit the factor alone
    (factor,), sse = _relative_least_squares([gather], target)
    if factor >= 1.0:
        candidates.append((sse, 0.0, factor))
    _, overhead, factor = min(candidates)
    return overhead, factor
