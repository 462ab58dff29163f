"""The one error type the analysis reports to users, as a single `error:` line."""

from __future__ import annotations

from collections.abc import Iterable


class AnalysisError(ValueError):
    """A request the data cannot answer (a missing column, no runs); the message is one line
    naming the fix."""


def require_columns(columns: Iterable[str], wanted: Iterable[str], what: str = "column") -> None:
    """Raise `AnalysisError` listing the available columns if any of `wanted` is missing."""
    have = list(columns)
    missing = [c for c in wanted if c not in have]
    if missing:
        shown = ", ".join(sorted(c for c in have if not c.startswith("cfg.")))
        config = sorted(c for c in have if c.startswith("cfg."))
        raise AnalysisError(
            f"no {what} {', '.join(map(repr, missing))}; available: {shown}"
            + (f"; config keys: {', '.join(config)}" if config else "")
        )
