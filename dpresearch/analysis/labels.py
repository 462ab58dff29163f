"""Short case labels for runs a study did not name, from what differs between their configs.

`varying_keys` lists the config keys (`cfg.*`) and config-group choices (`choice.*`) whose
value differs between runs — the sweep's overrides — leaving out the seed (and what follows
it), bookkeeping (logger, paths, progress) and copies the algorithm node holds of other
groups. `case_labels` turns each run's values of those keys into a label such as `sync`,
`topk(0.01)+ef14` or `dpsgd, topology=ring, lr=0.1`: the algorithm, compressor and error
feedback by their config-group names (the compressor with its main parameter), everything
else as `key=value`. Runs that differ only in their seed share a label, so a seed sweep is
aggregated by default.
"""

from __future__ import annotations

from typing import Any

SEED_KEYS = ("cfg.seed",)
IGNORED_PREFIXES = ("cfg.logger.", "cfg.hydra", "cfg.debug.", "choice.hydra", "choice.logger",
                    "choice.experiment", "cfg.train.resume", "cfg.train.progress",
                    "cfg.data.root", "cfg.train.save_model", "cfg.backend.timeout_s",
                    "cfg.backend.heartbeat_s", "cfg.data.download")  # fmt: skip
# Groups shown by name (in this order), and the parameter shown beside a name.
COMPONENTS = ("algorithm", "compressor", "error_feedback")
PRIMARY = ("ratio", "rank", "levels", "period", "gamma")
NOTHING = {"compressor": ("identity", "Identity"), "error_feedback": ("none",)}
# The algorithm node embeds these groups' nodes: their copies are not separate keys.
EMBEDDED = ("compressor", "error_feedback", "topology", "options")


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _seedlike(runs, column: str, seed_key: str) -> bool:
    return seed_key in runs and runs[column].astype(str).equals(runs[seed_key].astype(str))


def varying_keys(runs, seed_key: str = "cfg.seed") -> list[str]:
    """The config keys and group choices that differ between `runs` (see the module doc)."""
    out = []
    for column in runs.columns:
        if not column.startswith(("cfg.", "choice.")) or column == seed_key:
            continue
        if column.startswith(IGNORED_PREFIXES):
            continue
        if column.startswith(tuple(f"cfg.algorithm.{g}." for g in EMBEDDED)):
            continue
        if runs[column].astype(str).nunique(dropna=False) > 1 and not _seedlike(
            runs, column, seed_key
        ):
            out.append(column)
    return out


def _component(row: dict[str, Any], group: str) -> str | None:
    """`name(main parameter)` of a config group for one run, None when it is the no-op."""
    name = row.get(f"choice.{group}")
    if not name:
        target = row.get(f"cfg.{group}._target_")
        if target is None or target != target:
            return None
        name = str(target).rsplit(".", 1)[-1].lower()
        if group == "error_feedback":
            name = str(row.get("cfg.error_feedback.mode", name))
    if name in NOTHING.get(group, ()):
        return None
    for key in PRIMARY:
        value = row.get(f"cfg.{group}.{key}")
        if value is not None and value == value:
            return f"{name}({_text(value)})"
    return str(name)


def _covered(column: str, shown: set[str]) -> bool:
    """Whether a shown component already says what `column` holds."""
    return any(column == f"choice.{g}" or column.startswith(f"cfg.{g}.") for g in shown)


def case_labels(runs, keys: list[str]):
    """A label per run from its values of `keys` (see the module docstring)."""
    import pandas as pd

    groups = [g for g in COMPONENTS
              if any(k == f"choice.{g}" or k.startswith(f"cfg.{g}.") for k in keys)]  # fmt: skip
    labels = []
    for row in runs.to_dict("records"):
        parts = [p for p in (_component(row, g) for g in groups) if p]
        main = "+".join(parts)
        if not main:  # nothing of the components differs (or all are no-ops): the algorithm
            main = _component(row, "algorithm") or ""
        shown = set(groups) | {"algorithm"}
        rest = [f"{k.split('.', 1)[1].rsplit('.', 1)[-1]}={_text(row.get(k))}"
                for k in keys if not _covered(k, shown)]  # fmt: skip
        labels.append(", ".join(x for x in (main, *rest) if x) or "all runs")
    return pd.Series(labels, index=runs.index, dtype=object)


def default_title(runs) -> str:
    """A title for runs a study did not title: their study's name, else what they share
    (`resnet20 on cifar10, K = 4`)."""
    if "study" in runs and runs["study"].nunique() == 1 and runs["study"].notna().all():
        return str(runs["study"].iloc[0])
    first = runs.iloc[0].to_dict() if len(runs) else {}
    model = first.get("choice.model") or str(first.get("cfg.model._target_", "")).rsplit(".")[-1]
    data = first.get("choice.data") or str(first.get("cfg.data._target_", "")).rsplit(".")[-1]
    workers = first.get("cfg.workers")
    parts = []
    if model and data:
        parts.append(f"{model} on {data}")
    if workers is not None and workers == workers:
        parts.append(f"K = {workers}")
    return ", ".join(parts) or "Results"
