"""What a compressor can be paired with: each consumer of compressed messages declares its
needs (`ChannelNeeds`, a class attribute of the algorithm: `Algorithm.channel`), and one check
(`check_pairing`) reads them together with the traits the compressor classes declare
(`linear`, `rounds`, `gossip`, `memories`), raising one line that names the key to change. The
configuration checks call it before any worker starts (`check_compatibility` with the
algorithm's declaration) and `channel.open_channel` / the reducers once when they build their
codecs — never per call."""

from __future__ import annotations

from dataclasses import dataclass

from dpresearch.compress.base import COLLECTIVES, Compressor
from dpresearch.compress.error_feedback import ErrorFeedback

KINDS = ("sync", "gossip", "push")
GOSSIP_CODECS = (
    "compressor=topk, randomk, qsgd, fp4, natural, sign, onebit, terngrad, fp16 or identity"
)


@dataclass(frozen=True)
class ChannelNeeds:
    """What a consumer's compressed messages need, declared once on its class.

    kind: how the messages are combined —
      "sync": every worker's rows aggregated by a collective (allreduce / allgather; any
      compressor, multi-round protocols and votes included);
      "gossip": decoded messages summed with arbitrary weights, one sender at a time (CHOCO-SGD,
      AD-PSGD's pairs, a user's DeepSqueeze): single-round codecs whose class declares
      `Compressor.gossip`;
      "push": one worker's message decoded alone (asynchronous SGD): the same codecs.
    who: how the one-line errors name the consumer.
    memories: the error-feedback modes the consumer keeps (None: whatever the compressor takes;
    gossip's default "none": its public copies compensate the error; push's "none", "ef14":
    each worker's own memory), `memory_note` why.
    bare_memory: the memory holds the error only (no `error_feedback.momentum`, no dense
    warm-up `start_after_steps`).
    """

    kind: str = "sync"
    who: str = ""
    memories: tuple[str, ...] | None = None
    memory_note: str = ""
    bare_memory: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ChannelNeeds(kind={self.kind!r}); choose one of: {', '.join(KINDS)}")

    @classmethod
    def gossip(cls, who: str = "gossip") -> ChannelNeeds:
        """Compressed gossip: weighted decoding, public copies instead of error feedback."""
        note = "its public copies of the models already compensate the compression error"
        return cls("gossip", who, ("none",), note, bare_memory=True)

    @classmethod
    def push(cls, who: str = "asynchronous pushes") -> ChannelNeeds:
        """A worker's message decoded alone, with the worker's own EF14 memory."""
        return cls("push", who, ("none", "ef14"), "each worker's own memory", bare_memory=True)

    @property
    def weighted(self) -> bool:
        """Messages are decoded one sender at a time (needs `Compressor.gossip`)."""
        return self.kind != "sync"

    def why_not(self) -> str:
        """Why a compressor without `gossip` cannot serve this consumer (its default)."""
        if self.kind == "push":
            return (
                "cannot compress a push (a multi-round protocol or a vote needs every worker "
                "at once)"
            )
        return (
            "cannot be used for gossip (multi-round protocol or a vote, not a weighted sum of "
            "decoded messages)"
        )


SYNC = ChannelNeeds()


def check_pairing(
    compressor: Compressor,
    memory: ErrorFeedback | None = None,
    use: ChannelNeeds | str = SYNC,
    collective: str = "auto",
    optimizer_momentum: float = 0.0,
    where: str = "algorithm",
) -> None:
    """Raise ValueError (one line) if `compressor` with error feedback `memory` cannot serve
    the consumer declaring `use` (a `ChannelNeeds`, or its kind: "sync", "gossip", "push" with
    that kind's defaults). `collective`: how a sync consumer aggregates; `where` is the config
    node holding it."""
    needs = _needs(use)
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
    if needs.weighted and not compressor.gossip:
        why = compressor.gossip_note or needs.why_not()
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
    if needs.memories is not None and memory.mode not in needs.memories:
        modes = " or ".join(needs.memories)
        raise ValueError(
            f"error_feedback.mode={memory.mode} with {needs.who}, which can only support "
            f"error_feedback={modes} ({needs.memory_note}); "
            f"leave error_feedback={needs.memories[0]}"
        )
    if needs.bare_memory and (memory.momentum > 0 or memory.start_after_steps):
        raise ValueError(
            f"no error_feedback.momentum or start_after_steps with {needs.who} (the memory "
            "holds the error only); use the optimizer's momentum (optimizer.momentum) instead"
        )
    if memory.momentum > 0 and optimizer_momentum > 0:
        raise ValueError(
            f"error_feedback.momentum={memory.momentum} applies momentum before compression "
            f"(DGC); set optimizer.momentum=0 (it is {optimizer_momentum})"
        )


def _needs(use: ChannelNeeds | str) -> ChannelNeeds:
    if isinstance(use, ChannelNeeds):
        return use
    if use == "gossip":
        return ChannelNeeds.gossip()
    if use == "push":
        return ChannelNeeds.push()
    return ChannelNeeds(use)
