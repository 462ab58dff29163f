"""A study checked whole before any point runs (a dry run included): every problem is one
`StudyError` line naming the case and the fix.

- Each case's configuration composes and passes the checks `train` makes before any worker
  (`preflight`: the configuration, the data set loaded, the model built for it; `common`
  alone the configuration checks only), with
  the study's `common` overrides, the case's own, the lr key at the case's first lr and the
  first seed: a typo in `common`, a bad override inside a case and a misspelt `lr_key` are
  all caught here, not by a failed point (the rest of a case's grid only changes the lr, the
  `tune_also` key, at its first value here too, and the seed, whose keys this composition has
  checked). `common` is first composed alone,
  without the lr key, which may belong to a group only the cases choose (`outer.optimizer.lr`).
- Every `network:` the report re-prices on is a preset (`comm.network.PRESETS`).
- The selection metric (`select: NAME[:min|max]`) and the target's metric are ones a run
  reports; a validation metric needs a validation split (`train.val_size`) in every case, unless
  the data set brings its own (`Dataset.own_validation`).
"""

from __future__ import annotations

import typing
from typing import Any

from dpresearch.data.base import Dataset
from dpresearch.study.spec import Study, StudyError

# What a run's summary reports that a study may select on or aim at.
METRICS = (
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "test/loss",
    "test/acc",
    "best/test_acc",
    "test/acc_local_mean",
    "test/acc_local_min",
    "test/bpc",
    "val/bpc",
    "test/ppl",
    "val/ppl",
)


def check_study(study: Study) -> None:
    """Raise `StudyError` (one line) for the first problem of `study` (see module doc)."""
    metric = _selection(study.select)
    _known(study.target_metric, "target.metric")
    _networks(study.networks)
    # `common` alone, without the lr key: that key may live in a group only the cases choose
    # (a study of the outer lr sets outer.optimizer.lr, and `outer=` is each case's).
    _compose(study, (), "common", with_lr=False)
    for case in study.cases:
        grid = case.lrs or study.case(case.lr_from).lrs  # an lr_from case runs at another's lr
        # (and at its other tuned keys' values: the first of each)
        also = case.also or (study.case(case.lr_from).also if case.lr_from else ())
        tuned = tuple(f"{key}={grid.values[0]!r}" for key, grid in also)
        cfg = _compose(study, (*case.overrides, *tuned), f"case {case.name!r}", grid[0])
        if (
            metric is not None
            and metric.startswith("val/")
            and not cfg.train.val_size
            and not dataset_class(cfg.data).own_validation
        ):
            raise StudyError(
                f"select: {study.select} needs a validation split, but case {case.name!r} has "
                "train.val_size=0; add e.g. train.val_size=0.1 to common"
            )


def dataset_class(node: Any) -> type[Dataset]:
    """The `Dataset` class a data node builds: its `_target_` is the class, or a factory whose
    declared return type is."""
    from hydra.utils import get_method

    target = get_method(node._target_)
    if isinstance(target, type):
        return target
    return typing.get_type_hints(target).get("return", Dataset)


def _selection(select: str | None) -> str | None:
    """The metric `select` names (None: the report's default)."""
    if select is None:
        return None
    if not isinstance(select, str):
        raise StudyError(f"select: {select!r} must be NAME or NAME:min|max, e.g. val/acc:max")
    name, _, mode = select.partition(":")
    if mode not in ("", "min", "max"):
        raise StudyError(f"select: mode {mode!r} in {select!r}; use {name}:min or {name}:max")
    _known(name, "select")
    return name


def _networks(names: tuple[str, ...]) -> None:
    """Each network the report re-prices on is a preset (the report would fail on it)."""
    import difflib

    from dpresearch.comm.network import PRESETS

    for name in names:
        if name not in PRESETS:
            close = difflib.get_close_matches(name, list(PRESETS), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise StudyError(
                f"network: {name!r} is not a network preset; {hint}choose one of: "
                f"{', '.join(PRESETS)}"
            )


def _known(metric: str, what: str) -> None:
    if metric not in METRICS:
        import difflib

        close = difflib.get_close_matches(metric, METRICS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise StudyError(
            f"{what}: {metric!r} is not a metric a run reports; {hint}choose one of: "
            f"{', '.join(METRICS)}"
        )


def _compose(
    study: Study,
    overrides: tuple[str, ...],
    where: str,
    lr: float | None = None,
    with_lr: bool = True,
):
    """The composed and checked configuration of `overrides` after the study's `common`, at
    `lr` (default: the study's first; none set when not `with_lr`) and the first seed; `where`
    names them in the error."""
    from dpresearch import CONF_DIR
    from dpresearch.config.cli_check import compose_command_line, parse_command_line, task_config
    from dpresearch.config.preflight import preflight
    from dpresearch.config.schema import register_configs
    from dpresearch.config.validate import ConfigError, validate

    register_configs()
    lr = lr if lr is not None else min(c.lrs[0] for c in study.cases if c.lrs)
    lr_arg = [f"{study.lr_key}={lr!r}"] if with_lr else []
    args = [*study.common, *overrides, *lr_arg, f"seed={study.seeds[0]}"]
    try:
        cfg = task_config(compose_command_line(parse_command_line(args), CONF_DIR))
        if with_lr:  # a case: what `train` checks, so a case it would refuse fails here
            preflight(cfg, args)
        else:  # `common` alone: the cases may choose the model its data needs
            validate(cfg, args)
    except ConfigError as exc:
        named = str(exc).split(" ", 1)[0].split("=", 1)[0]
        if named == study.lr_key:
            where = f"lr_key {study.lr_key}"
        else:
            also = [k for k in study.also_keys if k == named or k.startswith(named + ".")]
            where = f"tune_also key {also[0]}" if also else where
        raise StudyError(f"{where}: {exc}") from None
    return cfg
