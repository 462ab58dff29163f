"""What every node's check shares: a plug-in's ValueError turned into a `ConfigError`, and a
value shown as the command line writes it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from dpresearch.errors import ConfigError


def as_config_error(check: Callable[[], object]) -> None:
    """Run `check`; a ValueError it raises (or one Hydra wraps, a constructor's) becomes a
    `ConfigError` with its first line."""
    try:
        check()
    except Exception as exc:
        cause = exc
        while not isinstance(cause, ValueError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if not isinstance(cause, ValueError):
            raise
        raise ConfigError(str(cause).strip().splitlines()[0]) from None


def is_number(value: Any) -> bool:
    """An int or a float, not a bool (YAML's true is no number of steps)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def show(value: Any) -> str:
    """`value` as the command line writes it (a list as `[1,2]`, no spaces)."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return json.dumps(value).replace(" ", "") if isinstance(value, list) else str(value)
