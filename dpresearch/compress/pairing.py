"""The one check of what a compressor can be paired with: read from the traits the classes
declare (`linear`, `rounds`, `gossip`, `memories`), raising one line that names the key to
change. Algorithms call it before any worker starts (`check_compatibility` from config nodes)
and once when they build their codecs — never per call."""

from __future__ import annotations

from types import MappingProxyType

from dpresearch.compress.base import COLLECTIVES, Compressor
from dpresearch.compress.error_feedback import ErrorFeedback

USES = ("sync", "gossip", "push")
GOSSIP_CODECS = "compressor=topk, randomk, qsgd, natural, sign, onebit, terngrad, fp16 or identity"
WHY_NOT = MappingProxyType(
    {
        "gossip": "cannot be used for gossip (multi-round protocol or a vote, not a weighted sum "
        "of decoded messages)",
        "push": "cannot compress a push (a multi-round protocol or a vote needs every worker "
        "at once)",
    }
)


def check_pairing(
    compressor: Compressor,
    memory: ErrorFeedback | None = None,
    use: str = "sync",
    collective: str = "auto",
    optimizer_momentum: float = 0.0,
    where: str = "algorithm",
) -> None:
    """Raise ValueError (one line) if `compressor` with error feedback `memory` cannot serve
    `use`: "sync" (aggregation by `collective`), "gossip" (CHOCO-SGD's weighted decoding, no
    error feedback: its public copies x̂ compensate the error) or "push" (one worker's message
    with its own EF14 memory). `where` is the config node holding `collective`."""
    if use not in USES:
        raise ValueError(f"use={use!r}; choose one of: {', '.join(USES)}")
    name = type(compressor).__name__
    if collective not in COLLECTIVES:
        choices = ", ".join(COLLECTIVES)
        raise ValueError(f"{where}.collective={collective}; choose one of: {choices}")
    if collective == "allreduce" and not compressor.linear:
        raise ValueError(
            f"{where}.collective=allreduce but {name} payloads are not linear (per-worker "
            f"indices or scales cannot be summed); set {where}.collective=auto (allgather)"
        )
    if compressor.rounds > 1 and collective == "allgather" and not compressor.variable_size:
        raise ValueError(
            f"{where}.collective=allgather but {name} runs {compressor.rounds} allreduce "
            f"rounds; set {where}.collective=auto"
        )
    if use != "sync" and not compressor.gossip:
        why = compressor.gossip_note or WHY_NOT[use]
        raise ValueError(f"compressor {name} {why}; choose e.g. {GOSSIP_CODECS}")
    if compressor.applies_momentum and optimizer_momentum > 0:
        raise ValueError(
            f"compressor {name} applies momentum itself (compressor.momentum); set "
            f"optimizer.momentum=0 (it is {optimizer_momentum})"
        )
    if memory is None:
        return
    if compressor.applies_momentum and memory.momentum > 0:
        raise ValueError(
            f"compressor {name} applies momentum itself (compressor.momentum); set "
            "error_feedback.momentum=0"
        )
    if memory.mode not in compressor.memories:
        why = compressor.memories_note or f"it takes mode {', '.join(compressor.memories)}"
        mode = f"error_feedback.mode={memory.mode}"
        raise ValueError(f"{mode} with {name}: {why}; use error_feedback=none")
    if use == "gossip" and memory.active:
        raise ValueError(
            "CHOCO-SGD's public copies x̂ already compensate the compression error; set "
            "error_feedback=none"
        )
    if use == "push":
        if memory.mode not in ("none", "ef14"):
            raise ValueError(
                f"error_feedback.mode={memory.mode}: asynchronous pushes support "
                "error_feedback=none or ef14 (each worker's own memory)"
            )
        if memory.momentum > 0 or memory.start_after_steps:
            raise ValueError(
                "asynchronous pushes take no error_feedback.momentum or start_after_steps; use "
                "the server optimizer's momentum (optimizer.momentum) instead"
            )
    if memory.momentum > 0 and optimizer_momentum > 0:
        raise ValueError(
            f"error_feedback.momentum={memory.momentum} applies momentum before compression "
            f"(DGC); set optimizer.momentum=0 (it is {optimizer_momentum})"
        )
