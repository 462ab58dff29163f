"""Read the command line before Hydra does, and turn composition failures into one line.

Hydra's own messages span several lines and a stack hint; `compose_command_line` composes the
command line's overrides first and, if that fails, raises `ConfigError` with a single sentence
naming the fix. Sweeps (`a=1,2`) are checked value by value for config-group choices and
composed with their first value (the sweeper checks every point before it launches any).
Anything this check cannot interpret is left to Hydra.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from dpresearch.config.validate import (
    RUNTIME_ARGS,
    ConfigError,
    not_an_option_message,
    unknown_key_message,
)

# Flags after which Hydra prints something and exits: nothing to check.
HYDRA_FLAGS_THAT_EXIT = {
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
}
# Flags after which Hydra prints the (checked) configuration and runs nothing.
HYDRA_FLAGS_THAT_PRINT = {"--cfg", "-c", "--resolve"}
FLAGS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--cfg",
    "-c",
    "--package",
    "-p",
}
# Flags that point Hydra at another configuration: our checks would judge the wrong one.
FLAGS_LEFT_TO_HYDRA = {
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    *HYDRA_FLAGS_THAT_EXIT,
}
MULTIRUN_FLAGS = {"--multirun", "-m"}
# Hydra modes, of which one command line may hold one.
MODE_FLAGS = {
    "--run": "--run",
    "-r": "--run",
    "--multirun": "-m",
    "-m": "-m",
    "--cfg": "--cfg",
    "-c": "--cfg",
    "--info": "--info",
    "-i": "--info",
    "--shell-completion": "-sc",
    "-sc": "-sc",
}


@dataclass(frozen=True)
class CommandLine:
    """What `python -m dpresearch.train ARGS` asks for.

    `overrides`: the `key=value` arguments; `multirun`: `-m`; `runs`: False when Hydra will
    only print (`--cfg`, `--help`, ...); `checkable`: False when a flag points Hydra at another
    configuration, so the checks here are left to the task; `config_name`: `-cn`'s value."""

    overrides: list[str]
    multirun: bool
    runs: bool
    checkable: bool
    config_name: str = "config"


def parse_command_line(argv: list[str]) -> CommandLine:
    """Raises `ConfigError` for a command line asking Hydra for two modes at once."""
    modes = sorted(
        {MODE_FLAGS[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in MODE_FLAGS}
    )
    if len(modes) > 1:
        raise ConfigError(
            f"{' and '.join(modes)} cannot be combined; e.g. check a sweep's settings with "
            "--cfg hydra, without -m"
        )
    overrides: list[str] = []
    multirun, runs, checkable, config_name = False, True, True, "config"
    args = iter(argv)
    for arg in args:
        flag, has_inline, inline = arg.partition("=")
        if arg.startswith("-") and flag in HYDRA_FLAGS_THAT_PRINT | HYDRA_FLAGS_THAT_EXIT:
            runs = False
        if arg.startswith("-") and flag in FLAGS_LEFT_TO_HYDRA:
            checkable = False
        if arg in MULTIRUN_FLAGS:
            multirun = True
        if arg.startswith("-") and flag in FLAGS_WITH_VALUE:
            value = inline if has_inline else next(args, "")
            if flag in ("--config-name", "-cn"):
                config_name = value
            continue
        if arg.startswith("-"):
            continue
        overrides.append(arg)
    return CommandLine(overrides, multirun, runs, checkable, config_name)


def _group_options(conf_dir: Path, config_name: str, searchpath: list[str]):
    """`group -> its options` over every config source Hydra reads: the shipped `conf_dir`
    and the directories a `hydra.searchpath=[...]` override adds (a user's own configs)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    cache: dict[str, list[str]] = {}

    def options(group: str) -> list[str]:
        if group not in cache:
            with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
                loader = GlobalHydra.instance().config_loader()
                try:
                    found = loader.get_group_options(
                        group, config_name=config_name, overrides=searchpath
                    )
                except Exception:
                    found = []
            cache[group] = sorted(found)
        return cache[group]

    return options


def compose_command_line(cmd: CommandLine, conf_dir: Path) -> DictConfig:
    """The composed configuration, with its `hydra` node (sweeps: their first point); raises
    `ConfigError` with one line if the command line does not compose."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(cmd.overrides)
    except HydraException as exc:
        raise ConfigError(f"cannot parse the overrides: {str(exc).splitlines()[0]}") from None
    first_values = []
    searchpath = [ov.input_line for ov in parsed if ov.key_or_group == "hydra.searchpath"]
    group_options = _group_options(conf_dir, cmd.config_name, searchpath)
    for ov in parsed:
        key = ov.key_or_group
        if ov.is_sweep_override() and not cmd.multirun:
            raise ConfigError(
                f"{ov.input_line}: a comma (or a range) makes a list of values, which only a "
                f"sweep runs; quote the value to keep it whole ({key}='...'), or add -m to "
                "sweep over it"
            )
        if key.startswith("hydra") or ov.package is not None and ov.package.startswith("hydra"):
            first_values.append(ov.input_line)
            continue
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else None
        options = group_options(key) if "." not in key else []
        if options and not ov.is_delete():
            for value in values or [ov.value()]:
                if isinstance(value, str) and value not in options:
                    raise ConfigError(
                        f"{key}={value} is not an option; choose one of: {', '.join(options)}"
                    )
        if values is not None:
            first_values.append(f"{ov.get_key_element()}={values[0]}")
        else:
            first_values.append(ov.input_line)
    try:
        return _compose(conf_dir, cmd.config_name, first_values)
    except Exception as exc:
        raise ConfigError(
            _composition_message(exc, conf_dir, cmd.config_name, first_values)
        ) from None


def _compose(conf_dir: Path, config_name: str, overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=True)


def task_config(composed: DictConfig) -> DictConfig:
    """`composed` without its `hydra` node: what the task function receives."""
    task = composed.copy()
    with open_dict(task):
        task.pop("hydra", None)
    return task


def _composition_message(
    exc: Exception, conf_dir: Path, config_name: str, overrides: list[str]
) -> str:
    text = str(exc)
    if exc.__cause__ is not None:
        text += "\n" + str(exc.__cause__)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if "is not in struct" in text or "Could not override" in text:
        key = lines[0].split("'")[1] if "'" in lines[0] else lines[0]
        return _unknown_key_hint(key, conf_dir, config_name, overrides)
    detail = [
        ln
        for ln in lines
        if "could not be converted" in ln or "Invalid value" in ln or "is not a valid" in ln
    ]
    if detail:
        return f"{lines[0]}: {detail[0]}"
    return lines[0] if lines else type(exc).__name__


def _unknown_key_hint(key: str, conf_dir: Path, config_name: str, overrides: list[str]) -> str:
    """For a key of the schema: its closest names, never `+key=` (the schema would reject the
    added key). For a plug-in's key: `+key=` only if its `_target_` takes that argument."""
    parent_path, _, leaf = key.rpartition(".")
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        cfg = _compose(conf_dir, config_name, rest)
    except Exception:
        return unknown_key_message(key, [])
    parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
    if not isinstance(parent, DictConfig):
        return unknown_key_message(key, [])
    keys = [str(k) for k in parent if not str(k).startswith("_")]
    if parent_path in RUNTIME_ARGS and "_target_" in parent:
        from hydra.utils import get_object

        try:
            params = set(inspect.signature(get_object(parent._target_)).parameters)
        except Exception:
            return unknown_key_message(key, keys)
        if leaf in params and leaf not in RUNTIME_ARGS[parent_path]:
            return (
                f"{key} is not set by this {parent_path} config; its target "
                f"{parent._target_} takes it: add it with +{key}=..."
            )
        return not_an_option_message(key, parent._target_, params)
    return unknown_key_message(key, keys)


def quote_value(value: str) -> str:
    """A Hydra override value holding `value` verbatim (commas, spaces, quotes and all)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
