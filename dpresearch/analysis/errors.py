"""The one error type the analysis reports to users, as a single `error:` line."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable

INSTALL_EXTRA = "pip install 'dpresearch[analysis]'"


class AnalysisError(ValueError):
    """A request the data cannot answer (a missing column, no runs); the message is one line
    naming the fix."""


def require_columns(columns: Iterable[str], wanted: Iterable[str], what: str = "column") -> None:
    """Raise `AnalysisError` if any of `wanted` is missing: one line with the closest names
    ("did you mean"), the run-level columns, and how many config keys (`cfg.*`) there are
    rather than all of them (`python -m dpresearch.analysis ROOTS --keys` lists every one)."""
    have = [str(c) for c in columns]
    missing = [c for c in wanted if c not in have]
    if not missing:
        return
    close = [name for m in missing for name in closest(m, have)]
    shown = sorted(c for c in have if not c.startswith("cfg."))
    config = [c for c in have if c.startswith("cfg.")]
    listed = ", ".join(shown[:MAX_LISTED]) + (
        f", … ({len(shown) - MAX_LISTED} more)" if len(shown) > MAX_LISTED else ""
    )
    raise AnalysisError(
        f"no {what} {', '.join(map(repr, missing))}"
        + (f" (did you mean {' or '.join(map(repr, dict.fromkeys(close)))}?)" if close else "")
        + f"; available: {listed}"
        + (f"; and {len(config)} config keys cfg.* (--keys lists them)" if config else "")
    )


MAX_LISTED = 40  # columns named in an error line; the rest are counted


def closest(name: str, have: list[str], n: int = 3) -> list[str]:
    """Names in `have` that `name` probably meant: a key ending in it (`lr` →
    `cfg.optimizer.lr`, `compressor` → `cfg.compressor._target_`), else close spellings."""
    tails = [h for h in have if h.endswith((f".{name}", f".{name}._target_"))]
    if tails:
        return tails[:n]
    return difflib.get_close_matches(name, have, n=n, cutoff=0.75)


def require_modules(*names: str, purpose: str = "the analysis") -> None:
    """Raise `AnalysisError` naming the extra to install if any of the modules `names` (the
    `analysis` extra's pandas, matplotlib) cannot be imported."""
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise AnalysisError(
            f"{purpose} needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; {INSTALL_EXTRA}"
        )
