"""The terminal progress line printed by the writing process at every log step."""

from __future__ import annotations

from typing import Any


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_progress(m: dict[str, Any], total_steps: int) -> str:
    """One line: step, epoch, losses, accuracy, lr, bytes sent per worker, modeled comm time."""
    parts = [f"step {m['step']}/{total_steps}", f"ep {m['epoch']:.2f}"]
    parts.append(f"loss {m['train/loss']:.4f}")
    if "test/acc" in m:
        parts.append(f"test loss {m['test/loss']:.4f} acc {m['test/acc']:.4f}")
    parts.append(f"lr {m['lr']:.4g}")
    parts.append(f"sent {_bytes(m['comm/bytes'])}")
    parts.append(f"modeled comm {m['comm/modeled_s']:.3f}s")
    parts.append(f"wall {m['time/wall_s']:.1f}s")
    return " | ".join(parts)
