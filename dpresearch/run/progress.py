"""The terminal progress line printed by the writing process at every log step."""

from __future__ import annotations

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


def format_progress(m: dict[str, Any], total_steps: int) -> str:
    """One line: step, epoch, losses, accuracy (a language model: bits per character), lr, bytes
    sent per worker, modeled comm time, throughput (steps/s and training images or tokens/s,
    averaged over the run's wall time so far) and the time left at that rate (ETA)."""
    parts = [f"step {m['step']}/{total_steps}", f"ep {m['epoch']:.2f}"]
    parts.append(f"loss {m['train/loss']:.4f}")
    if "test/bpc" in m:
        parts.append(f"test loss {m['test/loss']:.4f} bpc {m['test/bpc']:.4f}")
    elif "test/acc" in m:
        parts.append(f"test loss {m['test/loss']:.4f} acc {m['test/acc']:.4f}")
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
    parts.append(f"sent {_bytes(m['comm/bytes'])}")
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
