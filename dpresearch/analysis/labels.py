"""Short case labels for runs a study did not name, from what differs between their configs.

`varying_keys` lists the config keys (`cfg.*`) and config-group choices (`choice.*`) whose value
differs between runs — the sweep's overrides — leaving out the seed (and any key equal to the
seed in every run that has it: `algorithm.seed`, `outer.seed` copy it), bookkeeping (logger,
paths, progress), copies the algorithm node holds of other groups, and a key whose values repeat
an earlier one's in every run (`model.block_size` beside `data.block_size`). `case_labels` turns
each run's values of those keys into a label such as `sync`, `topk(0.01)+ef14` or `dpsgd,
topology=ring, lr=0.1`: the algorithm, compressor and error feedback by their config-group names
(the compressor with its main parameter), other groups as `group=choice`, everything else as
`key=value`. A label holds only what applies to its run:

- a key the run does not have (`optimizer.momentum` of an AdamW run) or a group the run's
  algorithm does not embed (`topology` of a synchronous run, `protocol` and `async` of any run
  but an asynchronous one, `compressor` of local SGD) is left out;
- a group's no-op (`compressor=identity`, `error_feedback=none`, `outer=none`) is left out;
- a key of a group whose choice is shown (`optimizer._target_`, `optimizer.lr` beside
  `optimizer=adamw`) is left out unless it differs between runs of the same choice.

Runs that differ only in their seed (or in what does not apply to them) share a label, so a
seed sweep is aggregated by default.
"""

from __future__ import annotations

from typing import Any

SEED_KEYS = ("cfg.seed",)
IGNORED_PREFIXES = (
    "cfg.logger.",
    "cfg.hydra",
    "cfg.debug.",
    "choice.hydra",
    "choice.logger",
    "choice.experiment",
    "cfg.train.resume",
    "cfg.train.progress",
    "cfg.data.root",
    "cfg.train.save_model",
    "cfg.backend.timeout_s",
    "cfg.backend.heartbeat_s",
    "cfg.data.download",
)
# Groups shown by name (in this order), and the parameter shown beside a name.
COMPONENTS = ("algorithm", "compressor", "error_feedback")
PRIMARY = ("ratio", "rank", "levels", "period", "gamma")
NOTHING = {"compressor": ("identity", "Identity"), "error_feedback": ("none",), "outer": ("none",)}
# Top-level group → its key in the algorithm node that embeds it: the group applies to a run
# only when the run's algorithm embeds it (when any run's does: hand-made configs say nothing).
SLOTS = {
    "compressor": "compressor",
    "error_feedback": "error_feedback",
    "topology": "topology",
    "protocol": "protocol",
    "async": "options",
}
# The algorithm node embeds these groups' nodes: their copies are not separate keys.
EMBEDDED = tuple(SLOTS.values())


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _missing(value: Any) -> bool:
    return value is None or value != value or value == ""


def _seedlike(runs, column: str, seed_key: str) -> bool:
    """Whether `column` copies the seed: it equals the seed in every run that has it
    (`algorithm.seed: ${seed}` of a synchronous run; a local-SGD run has no such key). Such a
    key never tells cases apart, also when the runs mix methods that have it and that do not."""
    import pandas as pd

    if seed_key not in runs:
        return False
    held = runs[column].notna()
    if not held.any():
        return False
    values = pd.to_numeric(runs.loc[held, column], errors="coerce")
    seeds = pd.to_numeric(runs.loc[held, seed_key], errors="coerce")
    return bool(values.notna().all() and (values == seeds).all())


def varying_keys(runs, seed_key: str = "cfg.seed") -> list[str]:
    """The config keys and group choices that differ between `runs` (see the module doc)."""
    out: list[str] = []
    seen: set[tuple[str, ...]] = set()
    for column in runs.columns:
        if not column.startswith(("cfg.", "choice.")) or column == seed_key:
            continue
        if column.startswith(IGNORED_PREFIXES):
            continue
        if column.startswith(tuple(f"cfg.algorithm.{g}." for g in EMBEDDED)):
            continue
        values = runs[column].astype(str)
        if values.nunique(dropna=False) > 1 and not _seedlike(runs, column, seed_key):
            if tuple(values) in seen:  # the same values as an earlier key: a copy of it
                continue
            seen.add(tuple(values))
            out.append(column)
    return out


def _group(column: str) -> str | None:
    """The config group a column belongs to (`choice.optimizer`, `cfg.optimizer.lr` →
    optimizer); None for a top-level key (`cfg.workers`)."""
    if column.startswith("choice."):  # `choice.compressor@outer.compressor`: the outer's
        name = column.split(".", 1)[1]
        return name.split("@", 1)[1].split(".")[0] if "@" in name else name
    parts = column.split(".")
    return parts[1] if len(parts) > 2 else None


def _identity(runs, group: str) -> str | None:
    """The column naming a group's choice: `choice.<group>`, else its `_target_`."""
    for column in (f"choice.{group}", f"cfg.{group}._target_"):
        if column in runs:
            return column
    return None


def _embedded(runs) -> dict[str, Any]:
    """Per slotted group that some run's algorithm embeds: a boolean Series, whether each run's
    algorithm embeds it."""
    out = {}
    for group, slot in SLOTS.items():
        node = f"cfg.algorithm.{slot}"
        columns = [c for c in runs.columns if c == node or c.startswith(node + ".")]
        if columns:
            held = runs[columns].notna().any(axis=1)
            if held.any():
                out[group] = held
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
    key = _primary(row, group)
    return f"{name}({_text(row[key])})" if key else str(name)


def _primary(row: dict[str, Any], group: str) -> str | None:
    """The key of the parameter shown beside a component's name in this run, if any."""
    for key in PRIMARY:
        value = row.get(f"cfg.{group}.{key}")
        if value is not None and value == value:
            return f"cfg.{group}.{key}"
    return None


def _within_choice(runs, key: str) -> bool:
    """Whether `key` of a group differs between runs that made the same choice of it (and have
    it): only then does it say more than the choice."""
    group = _group(key)
    ident = _identity(runs, group) if group else None
    if ident is None or ident == key or key not in runs:
        return True
    have = runs[runs[key].notna()]
    if have.empty:
        return False
    counts = have.groupby(have[ident].astype(str))[key].agg(lambda v: v.astype(str).nunique())
    return bool((counts > 1).any())


def key_names(keys: list[str]) -> dict[str, str]:
    """The shortest dotted suffix naming each key uniquely (`lr`, `data.block_size`); a group
    choice or a group's `_target_` by the group (`optimizer`)."""
    full = {}
    for key in keys:
        name = key.split(".", 1)[1] if key.startswith("choice.") else key.removeprefix("cfg.")
        name = name.split("@", 1)[-1]  # `compressor@outer.compressor`: outer.compressor
        full[key] = name.removesuffix("._target_")
    out = {}
    for key, name in full.items():
        parts = name.split(".")
        out[key] = name
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            others = [o for k, o in full.items() if k != key]
            if not any(o == short or o.endswith("." + short) for o in others):
                out[key] = short
                break
    return out


def label_parts(runs, keys: list[str]):
    """(label per run, the keys some label shows) — see `case_labels`."""
    import pandas as pd

    groups = [
        g for g in COMPONENTS if any(k == f"choice.{g}" or k.startswith(f"cfg.{g}.") for k in keys)
    ]
    embedded = _embedded(runs)
    rest = []
    for key in keys:
        group = _group(key)
        if (
            group in COMPONENTS
            and group in groups
            and key in (f"choice.{group}", f"cfg.{group}._target_")
        ):
            continue
        if not _within_choice(runs, key):
            continue  # what the shown choice of its group already says
        rest.append(key)
    names = key_names(rest)
    labels, used = [], set()
    for i, row in enumerate(runs.to_dict("records")):
        applies = {g: bool(flags.iloc[i]) for g, flags in embedded.items()}
        parts = []
        for g in groups:
            part = _component(row, g) if applies.get(g, True) else None
            if part:
                parts.append(part)
                used.update(k for k in (_identity(runs, g), _primary(row, g)) if k in keys)
        main = "+".join(parts)
        if not main:  # nothing of the components differs (or all are no-ops): the algorithm
            main = _component(row, "algorithm") or ""
        shown = []
        for key in rest:
            group, value = _group(key), row.get(key)
            if _missing(value) or not applies.get(group, True):
                continue  # the run has no such setting, or its algorithm does not use it
            if group in groups and (key == _primary(row, group) or key.startswith("choice.")):
                continue  # the component says it
            if key.startswith("choice.") and value in NOTHING.get(key.split(".")[-1], ()):
                continue
            if key.endswith("._target_"):
                value = str(value).rsplit(".", 1)[-1]
            shown.append(f"{names[key]}={_text(value)}")
            used.add(key)
        labels.append(", ".join(x for x in (main, *shown) if x) or "all runs")
    return pd.Series(labels, index=runs.index, dtype=object), [k for k in keys if k in used]


def case_labels(runs, keys: list[str]):
    """A label per run from its values of `keys` (see the module docstring)."""
    return label_parts(runs, keys)[0]


def _distinct(runs, choice: str, target: str) -> list[str]:
    """The runs' distinct names of a group (its choice, else its `_target_`'s class), in
    order of first appearance."""
    names = []
    for row in runs.to_dict("records"):
        name = row.get(choice)
        if _missing(name):
            target = row.get(target)
            name = None if _missing(target) else str(target).rsplit(".")[-1]
        if name is not None and str(name) not in names:
            names.append(str(name))
    return names


def _listed(values: list[str], noun: str, most: int = 3) -> str:
    return " / ".join(values) if len(values) <= most else f"{len(values)} {noun}"


def default_title(runs) -> str:
    """A title for runs a study did not title: their study's name, else what they are, true of
    every run (`resnet20 on cifar10, K = 4`; `gpt / gpt_tiny on shakespeare, K = 4, 8`)."""
    if "study" in runs and runs["study"].nunique() == 1 and runs["study"].notna().all():
        return str(runs["study"].iloc[0])
    models = _distinct(runs, "choice.model", "cfg.model._target_")
    data = _distinct(runs, "choice.data", "cfg.data._target_")
    parts = []
    if models and data:
        parts.append(f"{_listed(models, 'models')} on {_listed(data, 'data sets')}")
    if "cfg.workers" in runs:
        workers = sorted({int(w) for w in runs["cfg.workers"] if not _missing(w)})
        if workers:
            parts.append("K = " + ", ".join(map(str, workers)))
    return ", ".join(parts) or "Results"
