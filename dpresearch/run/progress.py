"""The terminal progress line printed by the writing process at every log step."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _duration(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on."""
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# The first progress line comes this long after the loop starts even when the first logged
# step is far off (a large model's first `train.log_every` steps can take minutes); after it, a
# line whenever none came for QUIET_S.
FIRST_LINE_S = 10.0
QUIET_S = 60.0


class Pacer:
    """When a progress line is due between logged rows (time-based): `first_s` seconds after
    `begin` while no line came yet, then `every_s` after the last line. `clock`: seconds, a
    monotonic clock (a test's fake one)."""

    def __init__(
        self,
        first_s: float = FIRST_LINE_S,
        every_s: float = QUIET_S,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.first_s, self.every_s, self.clock = first_s, every_s, clock
        self.begin()

    def begin(self) -> None:
        """Start waiting for the first line now."""
        self.last, self.wait = self.clock(), self.first_s

    def due(self) -> bool:
        return self.clock() - self.last >= self.wait

    def printed(self) -> None:
        """A line was printed now."""
        self.last, self.wait = self.clock(), self.every_s


def format_start(
    total_steps: int, steps_per_epoch: int, log_every: int, eval_every: int, text: bool
) -> str:
    """The line before the first step: the run's length, when it prints and evaluates, and the
    units its progress lines use."""
    epochs = total_steps / steps_per_epoch if steps_per_epoch else math.nan
    units = "losses in nats (cross-entropy, natural log)"
    if text:
        units += "; bpc: bits per character (nats / ln 2 per character)"
    evaluation = f"every {eval_every} steps and " if eval_every < total_steps else ""
    return (
        f"training {total_steps} steps ({epochs:.3g} epochs of {steps_per_epoch}): a progress "
        f"line every {log_every} steps (the first within {FIRST_LINE_S:g} s), evaluation "
        f"{evaluation}at the end; {units}"
    )


def format_progress(m: dict[str, Any], total_steps: int) -> str:
    """One line: step, epoch, losses (nats), accuracy (a language model: bits per character),
    lr, bytes sent per worker, modeled comm time, throughput (steps/s and training images or
    tokens/s, averaged over the run's wall time so far) and the time left at that rate (ETA).
    A line between logged rows (no bytes; the loss of this process's workers since the last
    row) leaves out what `m` does not hold."""
    parts = [f"step {m['step']}/{total_steps}", f"ep {m['epoch']:.2f}"]
    parts.append(f"loss {m['train/loss']:.4f} nats")
    if "test/bpc" in m:
        parts.append(f"test loss {m['test/loss']:.4f} nats = {m['test/bpc']:.4f} bpc")
    elif "test/acc" in m:
        parts.append(f"test loss {m['test/loss']:.4f} nats acc {m['test/acc']:.4f}")
    if "test/acc_local_mean" in m:
        parts.append(
            f"local acc mean {m['test/acc_local_mean']:.4f} min {m['test/acc_local_min']:.4f}"
        )
    if "gossip/consensus_distance" in m:
        parts.append(f"consensus dist {m['gossip/consensus_distance']:.3g}")
    if "async/staleness_mean" in m:
        parts.append(f"τ mean {m['async/staleness_mean']:.2f} max {m['async/staleness_max']:.0f}")
    if "time/simulated_s" in m:
        parts.append(f"simulated {m['time/simulated_s']:.2f}s")
    parts.append(f"lr {m['lr']:.4g}")
    if "comm/bytes" in m:
        parts.append(f"sent {_bytes(m['comm/bytes'])}")
    if "comm/modeled_s" in m:
        parts.append(f"modeled comm {m['comm/modeled_s']:.3f}s")
    wall = m["time/wall_s"]
    parts.append(f"wall {wall:.1f}s")
    if wall > 0 and m["step"] > 0:
        rate = m["step"] / wall
        speed = f"{rate:.3g} steps/s"
        if "tokens" in m:
            speed += f" ({m['tokens'] / wall:.0f} tokens/s)"
        elif "samples" in m:
            speed += f" ({m['samples'] / wall:.0f} img/s)"
        parts.append(speed)
        parts.append(f"ETA {_duration((total_steps - m['step']) / rate)}")
    return " | ".join(parts)


def format_setup(setup: dict[str, Any]) -> str:
    """One line per described component, e.g. the topology and its spectral facts."""
    lines = []
    for name, facts in setup.items():
        if isinstance(facts, dict):
            shown = ", ".join(f"{k}={_short(v)}" for k, v in facts.items())
            lines.append(f"{name}: {shown}")
        else:
            lines.append(f"{name}: {_short(facts)}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
