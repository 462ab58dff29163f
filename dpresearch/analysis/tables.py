"""Tables as text: markdown, LaTeX (booktabs) and CSV.

A metric column `m` that has a partner `m std` (as `aggregate` writes) is shown as
"mean ± std" in markdown and LaTeX — as a study's report shows it (`mean_std`): three
significant figures with the spread to the same decimal place, accuracies in % with one
decimal, bytes as the mean alone — and as two numeric columns in CSV, so the CSV stays
machine-readable. Missing values are shown as "–". Besides Python format specs, a column's
format may be "%" (a fraction shown as a percentage with one decimal), "MB" (an amount in
MB shown with three significant figures, in GB from 1000 MB) or "bytes" (an amount in bytes
shown as "MB" shows it).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from dpresearch.analysis.errors import require_columns

MISSING = "–"
DEFAULT_FORMAT = ".4g"


def percent(value: Any) -> str:
    """A fraction as a percentage with one decimal (0.5321 → "53.2")."""
    return MISSING if not _finite(value) else f"{100 * float(value):.1f}"


def significant(value: Any, digits: int = 3) -> str:
    """`value` with `digits` significant figures, trailing zeros kept (20 → "20.0")."""
    if not _finite(value):
        return MISSING
    text = f"{float(value):#.{digits}g}"
    return text.rstrip(".") if "e" not in text else f"{float(value):.{digits}g}"


def decimals_of(text: str) -> int:
    """How many decimals a formatted number shows ("1.31" → 2, "45" → 0)."""
    return 0 if "." not in text or "e" in text else len(text.split(".", 1)[1])


def with_spread(mean: Any, std: Any, digits: int = 3) -> str:
    """ "mean ± std": the mean with `digits` significant figures, the spread to the same
    decimal place (1.3052, 0.00643 → "1.31 ± 0.01")."""
    text = significant(mean, digits)
    if not _finite(std) or text == MISSING:
        return text
    if "e" in text:
        return f"{text} ± {float(std):.1e}"
    return f"{text} ± {float(std):.{decimals_of(text)}f}"


def mean_std(mean: Any, std: Any, fmt: Callable[[Any], str] | None = None) -> str:
    """A mean and its spread as every report prints them: with `fmt` (e.g. `percent`) both in
    that format, else `with_spread` (three significant figures, the spread to the same decimal
    place); the mean alone where the spread is not finite (one run)."""
    if fmt is None:
        return with_spread(mean, std)
    text = fmt(mean)
    return text + (f" ± {fmt(std)}" if _finite(std) and text != MISSING else "")


def megabytes(value: Any) -> str:
    """An amount in MB (10⁶ bytes) with three significant figures, in GB from 1000 MB."""
    if not _finite(value):
        return MISSING
    value = float(value)
    return f"{significant(value / 1000)} GB" if abs(value) >= 1000 else f"{significant(value)} MB"


def bytes_in_megabytes(value: Any) -> str:
    """An amount in bytes as `megabytes` shows it (2.82e6 → "2.82 MB")."""
    return megabytes(float(value) / 1e6) if _finite(value) else MISSING


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


# Format names `_cell` understands besides Python's format specs.
SPECIAL = {"%": percent, "MB": megabytes, "bytes": bytes_in_megabytes}


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return "✓" if value else ""
    if fmt in SPECIAL and isinstance(value, numbers.Real):
        return SPECIAL[fmt](value)
    if isinstance(value, numbers.Real):
        try:
            return format(value, fmt)
        except (ValueError, TypeError):
            return str(value)
    return str(value)


def _spread_cell(mean: Any, std: Any, fmt: str) -> str:
    """A metric with its spread, as a study's report prints it (`mean_std`): "%" both in %,
    "MB" and "bytes" the mean alone in MB (as the study's bytes column), anything else
    `with_spread`."""
    if not _finite(mean):
        return _cell(mean, fmt)
    if fmt in ("MB", "bytes"):
        return SPECIAL[fmt](mean)
    return mean_std(mean, std, percent if fmt == "%" else None)


def display_frame(df, columns: Sequence[str], formats: dict[str, str] | None = None):
    """`columns` of `df` as strings, metric columns merged with their `std` partner."""
    import pandas as pd

    require_columns(df.columns, columns)
    formats = formats or {}
    out = pd.DataFrame(index=df.index)
    for c in columns:
        fmt = formats.get(c, DEFAULT_FORMAT if pd.api.types.is_float_dtype(df[c]) else "")
        std = f"{c} std"
        if std in df:
            cells = [_spread_cell(m, s, fmt) for m, s in zip(df[c], df[std], strict=True)]
        else:
            cells = list(df[c].map(lambda v, f=fmt: _cell(v, f)))
        out[c] = cells
    return out


def markdown_table(
    df,
    columns: Sequence[str],
    formats: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> str:
    """A GitHub-markdown table of `columns` of `df` (see the module docstring)."""
    shown = display_frame(df, columns, formats)
    headers = headers or {}
    head = "| " + " | ".join(headers.get(c, c) for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"
        for row in shown.itertuples(index=False)
    ]
    return "\n".join([head, rule, *body])


_LATEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "–": "--",
    "✓": r"$\checkmark$",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


def latex_table(
    df,
    columns: Sequence[str],
    formats: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    caption: str | None = None,
) -> str:
    """A booktabs `tabular` (in a `table` float when `caption` is given)."""
    shown = display_frame(df, columns, formats)
    headers = headers or {}
    lines = [
        r"\begin{tabular}{" + "l" * len(columns) + "}",
        r"\toprule",
        " & ".join(latex_escape(headers.get(c, c)) for c in columns) + r" \\",
        r"\midrule",
        *(
            " & ".join(latex_escape(c) for c in row) + r" \\"
            for row in shown.itertuples(index=False)
        ),
        r"\bottomrule",
        r"\end{tabular}",
    ]
    if caption:
        lines = [
            r"\begin{table}",
            r"\centering",
            r"\caption{" + latex_escape(caption) + "}",
            *lines,
            r"\end{table}",
        ]
    return "\n".join(lines)


def csv_table(df, columns: Sequence[str]) -> str:
    """`columns` (each followed by its `std` partner where there is one) as CSV, raw values."""
    require_columns(df.columns, columns)
    wanted: list[str] = []
    for c in columns:
        wanted += [c, f"{c} std"] if f"{c} std" in df else [c]
    return df[wanted].to_csv(index=False)
