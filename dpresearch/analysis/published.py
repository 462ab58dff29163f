"""Published numbers beside ours: a CSV joined onto a table by a key column, with citations.

The CSV holds one row per published number (or several per key, e.g. one per paper): a key
column whose values equal our case labels, the value columns, and a citation column
(`citation`, `paper`, `study` or `source`, the first present). Joined columns are named
`published <col>`; a `ref` column numbers the citations, listed by `Published.footnotes`.
Several rows for one key are shown together, separated by " / ". Rows that match no case are
reported, never dropped silently.

Like for like: a published number sits beside our case only when it was measured in our case's
setting (the method and its knobs: compressor and its parameters, error feedback, optimizer and
momentum, topology, data split; the scale — data set, model, workers, steps — is stated in its
own columns and never makes two rows comparable). A row in another setting names what differs
in a `differs` column (e.g. "QSGD 64 levels (ours s = 1)"); `split_by_setting` keeps such rows,
and rows naming no case, apart from those beside our cases, and `join_published` never joins them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dpresearch.analysis.errors import AnalysisError, require_columns

CITATION_COLUMNS = ("citation", "paper", "study", "source")
DIFFERS = "differs"  # what differs from our case's setting; empty: like for like


@dataclass
class Published:
    path: Path
    frame: object  # pandas.DataFrame
    key: str
    columns: list[str]
    citation: str | None
    citations: list[str] = field(default_factory=list)

    def footnotes(self) -> list[str]:
        return [f"[{i}] {c}" for i, c in enumerate(self.citations, 1)]


def load_published(
    path: str | Path, key: str = "case", columns: Sequence[str] | None = None
) -> Published:
    """Read the CSV at `path`; `columns` default to its numeric columns."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise AnalysisError(f"published-numbers file {path} does not exist")
    frame = pd.read_csv(path)
    require_columns(frame.columns, [key], f"key column in {path.name}:")
    citation = next((c for c in CITATION_COLUMNS if c in frame), None)
    if columns is None:
        columns = [c for c in frame.select_dtypes("number").columns if c != key]
    require_columns(frame.columns, columns, f"column in {path.name}:")
    citations = list(dict.fromkeys(frame[citation].astype(str))) if citation else []
    return Published(path, frame, key, list(columns), citation, citations)


def _blank(frame, column: str):
    import pandas as pd

    if column not in frame:
        return pd.Series(True, index=frame.index)
    return frame[column].fillna("").astype(str).str.strip() == ""


def other_setting(frame, key: str = "case"):
    """A boolean mask over `frame`'s rows: True where the row is not like for like with a case
    of ours — it names what differs (`differs` non-empty) or names no case (`key` empty)."""
    return ~_blank(frame, DIFFERS) | _blank(frame, key)


def split_by_setting(frame, key: str = "case"):
    """(rows like for like with the case they name, rows in another setting) — see
    `other_setting`; both keep `frame`'s row order."""
    mask = other_setting(frame, key)
    return frame[~mask], frame[mask]


def join_published(table, published: Published, on: str):
    """(`table` with `published <col>` and `ref` columns, notes on unmatched rows). Rows in
    another setting (`differs` non-empty) are not joined: a note names them and what differs."""
    require_columns(table.columns, [on])
    frame = published.frame.copy()
    notes: list[str] = []
    same = _blank(frame, DIFFERS)
    notes += [
        f"published {r[published.key]} not joined, other setting: {r[DIFFERS]}"
        for _, r in frame[~same].iterrows()
    ]
    frame = frame[same].copy()
    if published.citation:
        number = {c: str(i) for i, c in enumerate(published.citations, 1)}
        frame["ref"] = frame[published.citation].astype(str).map(number)
    value_columns = published.columns + (["ref"] if published.citation else [])

    def together(values) -> str:
        return " / ".join(dict.fromkeys(str(v) for v in values if v == v))

    grouped = frame.groupby(published.key, sort=False)[value_columns].agg(together)
    grouped = grouped.rename(columns={c: f"published {c}" for c in published.columns})
    grouped.index = grouped.index.astype(str)
    out = table.assign(_key=table[on].astype(str)).join(grouped, on="_key").drop(columns="_key")
    unmatched = sorted(set(grouped.index) - set(table[on].astype(str)))
    if unmatched:
        notes.append(f"published rows matching no {on}: {', '.join(unmatched)}")
    keyless = int(frame[published.key].isna().sum())
    if keyless:
        notes.append(f"{keyless} published rows have no {published.key} and match nothing")
    return out, notes
