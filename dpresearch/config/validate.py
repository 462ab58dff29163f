"""Checks that run before any worker starts; each failure is one line naming the fix.

`validate` runs, in order: the schema's keys (`check_schema_keys`), the mandatory values a
config leaves to the user (`check_required_values`: `???`), every typed node's own
check (`checks.NODE_CHECKS`), the run length against the command line (`check_run_length`),
every plug-in's `_target_` and keys (`check_target`), and every plug-in node's own check
(`checks.PLUGIN_CHECKS`, the algorithm's among them), and that no node is set for an
algorithm that ignores it (`check_unused_nodes`). `prepare_data` (`run.build`'s) loads the data
set once.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import logging
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from dpresearch.config.checks import (
    NODE_CHECKS,
    PLUGIN_CHECKS,
    check_unused_nodes,
    process_count,
)
from dpresearch.errors import ConfigError
from dpresearch.run.build import forget_data, prepare_data

__all__ = ["ConfigError", "process_count", "validate", "prepare_data", "forget_data"]

# Arguments the trainer supplies at instantiation, per plug-in group.
RUNTIME_ARGS = {
    "data": {"device"},
    "model": {"num_classes", "input_shape"},
    "optimizer": {"params"},
    "schedule": {"steps_per_epoch", "total_steps"},
    "algorithm": {"replicas", "comm", "optimizers"},
    "compressor": {"seed", "worker"},
    "error_feedback": {"inner"},
    "topology": {"num_workers"},
    "outer": {"base", "replicas", "comm", "optimizers"},
    "protocol": {"workers"},
}
OWN_KEYS = {"optimizer": {"exclude_bn_bias_from_weight_decay"}}


def check_target(group: str, node: Any) -> None:
    """The node's `_target_` exists and accepts its keys plus the trainer's runtime arguments."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(f"{group}: no _target_ set; pick one with {group}=<option>")
    target = node._target_
    try:
        obj = get_object(target)
    except Exception as exc:
        lines = str(exc).splitlines()  # hydra's: "Error loading ...", the cause, a question
        detail = "; ".join(line.strip() for line in lines[1:] if line.strip()) or lines[0]
        raise ConfigError(f"{group}._target_={target} cannot be imported: {detail}") from None
    keys = [k for k in node if not str(k).startswith("_") and k not in OWN_KEYS.get(group, ())]
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in keys if k not in params]
    if unknown:
        raise ConfigError(not_an_option_message(f"{group}.{unknown[0]}", target, params))
    check_types(group, node, obj, [params[k] for k in keys])


def check_types(group: str, node: DictConfig, obj: Any, params: list[inspect.Parameter]) -> None:
    """Each scalar key's value has the type its `_target_`'s parameter is annotated with, where
    that is `bool`, `int` or a `Literal` (each optionally `| None`): a plug-in node is untyped, so
    `outer.period=2.5` would reach the code as a float (and `range` or `%` make it 2 silently),
    `algorithm.mix_buffers=maybe` as a non-empty string, which `if` takes for true."""
    for param in params:
        kind = _simple_annotation(obj, param)
        if kind is None:
            continue
        try:
            value = node[param.name]
        except Exception:  # (an unresolvable value is reported elsewhere)
            continue
        if isinstance(value, (DictConfig, ListConfig)):
            continue
        problem = _type_problem(value, *kind)
        if problem:
            raise ConfigError(f"{group}.{param.name}={_shown(value)}{problem}")


def _simple_annotation(obj: Any, param: inspect.Parameter) -> tuple[Any, bool] | None:
    """(bool, int or the Literal's values as a tuple; whether None is allowed) for `param`'s
    annotation, or None for any other (or unresolvable) annotation."""
    annotation = param.annotation
    if isinstance(annotation, str):  # `from __future__ import annotations`
        function = obj.__init__ if inspect.isclass(obj) else obj
        namespace = getattr(inspect.unwrap(function), "__globals__", {})
        try:
            annotation = eval(annotation, dict(namespace))  # (the package's own annotations)
        except Exception:  # (a name only imported for type checkers)
            return None
    options = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = list(typing.get_args(annotation))
    nullable = type(None) in options
    options = [o for o in options if o is not type(None)]
    if len(options) != 1:
        return None
    (kind,) = options
    if typing.get_origin(kind) is typing.Literal:
        return tuple(typing.get_args(kind)), nullable
    return (kind, nullable) if kind in (bool, int) else None


def _type_problem(value: Any, kind: Any, nullable: bool) -> str:
    """What is wrong with `value` for `kind` (see `_simple_annotation`): the rest of the line,
    or "" when nothing is."""
    if value is None and nullable:
        return ""
    null = " (or null)" if nullable else ""
    if isinstance(kind, tuple):
        if value in kind:
            return ""
        return f"; choose one of: {', '.join(_shown(k) for k in kind)}{null}"
    if kind is bool:
        return "" if isinstance(value, bool) else f": must be true or false{null}"
    if isinstance(value, int) and not isinstance(value, bool):
        return ""
    if isinstance(value, float) and value.is_integer():
        return f": must be an integer{null}; write {int(value)}"
    return f": must be an integer{null}"


def _shown(value: Any) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def not_an_option_message(key: str, target: str, params: Any) -> str:
    """One line for a plug-in key its `_target_` does not take (`params`: its parameters)."""
    group, _, leaf = key.partition(".")
    allowed = sorted(set(params) - RUNTIME_ARGS.get(group, set()) - {"self", "kw", "kwargs"})
    close = difflib.get_close_matches(leaf, allowed, n=1, cutoff=0.6)
    hint = f"did you mean {group}.{close[0]}? " if close else ""
    return f"{key} is not an option of {target}; {hint}valid options: {', '.join(allowed)}"


def validate(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Raise `ConfigError` for any configuration that would fail once workers are running, or
    that would run silently other than asked. `overrides` are the command line's (Hydra's
    `key=value` strings); they tell which keys the user set (see `check_run_length`). Runs
    every node's own check (`checks.NODE_CHECKS`, `checks.PLUGIN_CHECKS`); needs no data and
    builds nothing; `preflight.preflight` adds the checks that do."""
    with quiet_lookups():
        check_schema_keys(cfg)
        check_required_values(cfg)
        for check in NODE_CHECKS.values():
            check(cfg)
        check_run_length(cfg, overrides)
        for group in RUNTIME_ARGS:
            if group != "outer" or cfg.get("outer"):  # outer=none: no node
                check_target(group, cfg[group])
        for check in PLUGIN_CHECKS.values():
            check(cfg)
        check_unused_nodes(cfg, overrides)
        OmegaConf.resolve(OmegaConf.create(OmegaConf.to_container(cfg)))


@contextlib.contextmanager
def quiet_lookups() -> Iterator[None]:
    """Hydra's `get_object` logs every failed lookup before it raises; a check reports the
    failure itself, once, in one line (a bad `_target_` printed twice over six lines before)."""
    logger = logging.getLogger("hydra.utils")
    before = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = before


# What to pass for a mandatory value (`???`) a config leaves to the user.
REQUIRED_HINTS = {
    "data.root": "a .txt file, a folder of .txt files or a nanoGPT folder (train.bin, val.bin)",
}


def check_required_values(cfg: DictConfig) -> None:
    """Every mandatory value (`???` in a config: `data.root` of `data=text`) is given."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        value = REQUIRED_HINTS.get(key, "value")
        raise ConfigError(f"{key} must be given (this config has no default); pass {key}=<{value}>")


# Keys that became nodes of their own: what to pass instead.
MOVED = {
    "async.protocol": "the protocol is its own config group: pass protocol=asgd|ssp|softsync|sync",
    "async.max_staleness": "pass protocol=ssp protocol.max_staleness=<s>",
    "async.softsync_c": "pass protocol=softsync protocol.c=<c>",
}


def unknown_key_message(key: str, candidates: Sequence[str]) -> str:
    """One line for a key that the schema does not have, suggesting the closest ones."""
    if key in MOVED:
        return f"{key} is not a config key any more; {MOVED[key]}"
    parent, _, leaf = key.rpartition(".")
    close = difflib.get_close_matches(leaf, list(candidates), n=2, cutoff=0.6)
    guess = " or ".join(f"{parent + '.' if parent else ''}{c}" for c in close)
    hint = f"did you mean {guess}? " if guess else ""
    return f"{key} is not a config key; {hint}list the keys with --cfg job"


def _schema() -> DictConfig:
    """The registered structured schema (`base_config`), whatever nodes it holds."""
    from hydra.core.config_store import ConfigStore

    return ConfigStore.instance().load("base_config.yaml").node


def check_schema_keys(cfg: DictConfig) -> None:
    """Every key of a typed section (`train`, `backend`, ... and the top level) is in the schema:
    `+train.stepz=5` adds a key the framework would silently ignore."""

    def walk(node: DictConfig, schema: DictConfig, prefix: str) -> None:
        for key in node:
            if prefix == "" and key == "hydra":
                continue
            if key not in schema:
                raise ConfigError(unknown_key_message(f"{prefix}{key}", list(schema)))
            sub, sub_schema = node[key], schema[key]
            # an open node of the schema (`outer`) is a plug-in: its keys are its target's; a
            # mapping of names (`train.time_scenarios`) is checked by its node's own check
            if (
                isinstance(sub, DictConfig)
                and isinstance(sub_schema, DictConfig)
                and OmegaConf.is_struct(sub_schema)
                and OmegaConf.get_type(sub_schema) is not dict
            ):
                walk(sub, sub_schema, f"{prefix}{key}.")

    walk(cfg, _schema(), "")


def _given(overrides: Sequence[str]) -> dict[str, Any]:
    """key → value of the plain `key=value` overrides (sweeps and unparsable ones left out)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    given: dict[str, Any] = {}
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except Exception:
            continue
        if not override.is_sweep_override() and not override.is_delete():
            given[override.key_or_group] = override.value()
    return given


def check_run_length(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """`train.steps` wins over `train.epochs`, so setting `train.epochs` on the command line
    while steps is set (on the same line, or by the config) would be ignored: reject it."""
    given = _given(overrides)
    epochs = given.get("train.epochs")
    if epochs is None or cfg.train.steps is None:
        return
    if given.get("train.steps") is not None:
        raise ConfigError(
            f"train.steps={cfg.train.steps} and train.epochs={epochs} are both given; pass one: "
            "train.steps=N runs N steps, train.epochs=E runs E epochs"
        )
    raise ConfigError(
        f"train.epochs={epochs} would be ignored: train.steps={cfg.train.steps} is set by the "
        "config; add train.steps=null to train by epochs"
    )
