"""The algorithm's nodes: the optimizer an algorithm owns, the algorithm class's own checks
(`Algorithm.check_config`, its declared `OPTIONS` among them), compression against what its
messages need, the outer optimizer, the protocol, and the nodes an algorithm takes by
reference left alone when it does not."""

from __future__ import annotations

import json
from collections.abc import Sequence

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from dpresearch.config.checks.common import as_config_error
from dpresearch.config.checks.plugins import check_optimizer_values
from dpresearch.errors import ConfigError
from dpresearch.run.build import algorithm_class


def _owned_optimizer(cfg: DictConfig) -> type | None:
    """The optimizer class when an algorithm owns its step (`OwnedOptimizer`), else None."""
    from dpresearch.algorithms.compressed_adam import OwnedOptimizer

    try:
        optimizer = get_object(cfg.optimizer._target_)
    except Exception:
        return None
    owned = isinstance(optimizer, type) and issubclass(optimizer, OwnedOptimizer)
    return optimizer if owned else None


def _selected_by(cfg: DictConfig) -> str:
    """How the user named the algorithm: the optimizer option for an algorithm an optimizer
    selects (optimizer=onebit_adam), else algorithm=<class>."""
    optimizer = _owned_optimizer(cfg)
    if optimizer is not None:
        return optimizer.option
    return f"algorithm={cfg.algorithm._target_.rsplit('.', 1)[-1]}"


def check_optimizer_owner(cfg: DictConfig) -> None:
    """An optimizer stepped by its own algorithm (`OwnedOptimizer`: optimizer=onebit_adam) runs
    with that algorithm only."""
    optimizer = _owned_optimizer(cfg)
    if optimizer is not None and algorithm_class(cfg) is not get_object(optimizer.algorithm):
        name = cfg.algorithm._target_.rsplit(".", 1)[-1]
        raise ConfigError(
            f"{optimizer.option} runs its own algorithm ({optimizer.algorithm.rsplit('.', 1)[-1]}"
            f", which exchanges the momentum); drop algorithm= (it is {name})"
        )


def check_algorithm(cfg: DictConfig) -> None:
    """The algorithm class's own checks (`Algorithm.check_config`), raising ValueError (e.g. a
    topology that cannot exist for `workers`); the first line becomes the `ConfigError`."""
    cls = algorithm_class(cfg)
    if cls is not None:
        as_config_error(lambda: cls.check_config(cfg))


def check_compression(cfg: DictConfig) -> None:
    """Compressor and error feedback pair with each other and with what the algorithm's
    messages need, as its class declares (`Algorithm.channel`: sync aggregation, gossip or
    pushes; None: no compressor)."""
    from dpresearch.compress.build import check_algorithm_node
    from dpresearch.compress.channel import is_identity, is_inactive

    alg = cfg.algorithm
    cls = algorithm_class(cfg)
    if cls is None:
        return  # (the target check names it)
    name = alg._target_.rsplit(".", 1)[-1]
    no_memory = is_inactive(cfg.error_feedback)
    if cls.channel is None or "compressor" not in alg:
        if no_memory and is_identity(cfg.compressor):
            return
        note = cls.traits.compression_note
        if note:
            raise ConfigError(
                f"{_selected_by(cfg)} {note}; drop compressor=/error_feedback= (leave "
                "compressor=identity error_feedback=none)"
            )
        if cls.channel is not None:
            raise ConfigError(
                f"{name} declares compressed messages (channel) but its algorithm node passes "
                "no compressor; add `compressor: ${compressor}` to its YAML, or leave "
                "compressor=identity error_feedback=none"
            )
        raise ConfigError(
            f"{name} does not use compressor/error_feedback; use algorithm=sync (compressed "
            "gradients) or algorithm=choco (compressed gossip), or leave compressor=identity "
            "error_feedback=none"
        )
    try:
        check_algorithm_node(
            alg,
            cls.channel,
            float(cfg.optimizer.get("momentum") or 0.0),
            error_feedback=cfg.error_feedback,
            options=cls.OPTIONS.from_node(alg) if cls.OPTIONS is not None else None,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if "error_feedback" not in alg and not no_memory:
        raise ConfigError(
            f"{name} takes no error_feedback (its messages keep their own copies); leave "
            "error_feedback=none"
        )


def check_outer(cfg: DictConfig) -> None:
    """An outer optimizer (`outer=...`): its optimizer node's values, then the outer node's
    own checks (`algorithms.outer.check_config`: the base algorithm, the schedule, the codec);
    nothing for `outer=none`. The nested nodes are built once by preflight."""
    from dpresearch.algorithms import outer

    node = outer.outer_node(cfg)
    if node is None:
        return
    if node.get("optimizer") is not None:
        check_optimizer_values(node.optimizer, "outer.optimizer")
    try:
        outer.check_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc).strip().splitlines()[0]) from None


def check_protocol(cfg: DictConfig) -> None:
    """The `protocol` node builds for `workers` workers, and only an algorithm that takes one
    is given one other than the default."""
    from hydra.utils import instantiate

    from dpresearch.asynchrony.protocol import DEFAULT_PROTOCOL

    node = cfg.get("protocol")
    if node is None:
        return
    if "protocol" not in cfg.algorithm:
        try:
            default = get_object(node.get("_target_")) is DEFAULT_PROTOCOL
        except Exception:
            default = False
        if not default:
            raise ConfigError(
                f"{cfg.algorithm._target_.rsplit('.', 1)[-1]} does not use a protocol; use "
                f"algorithm=async_sgd, or leave protocol={DEFAULT_PROTOCOL.name}"
            )
        return
    as_config_error(lambda: instantiate(node, workers=cfg.workers))


# Nodes an algorithm takes by reference (`options: ${async}`, `topology: ${topology}`): set
# for an algorithm that does not reference them, they would be ignored without a word.
# (compressor/error_feedback: `check_compression`.)
REFERENCED_NODES = ("async", "topology")


def check_unused_nodes(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """A `REFERENCED_NODES` node that the algorithm's node does not reference is left as it
    is: its schema defaults (`async`) and no override of it on the command line."""
    from dpresearch.asynchrony.options import SPEED_KEYS, AsyncOptions, check_options

    used = json.dumps(OmegaConf.to_container(cfg.algorithm, resolve=False))
    name = cfg.algorithm._target_.rsplit(".", 1)[-1]
    given = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    for node in REFERENCED_NODES:
        if node not in cfg or "${" + node + "}" in used:
            continue
        changed = [k for k in given if k == node or k.startswith(node + ".")]
        if node == "async":
            defaults = AsyncOptions.defaults()
            now = OmegaConf.to_container(cfg[node], resolve=True)
            changed += [f"async.{k}" for k, v in now.items() if v != defaults.get(k, v)]
            # the speed model is every family's (`time/modeled_s`, `run/modeled_clock.py`)
            changed = [k for k in changed if k.removeprefix("async.") not in SPEED_KEYS]
            opts = AsyncOptions.from_node(now)
            as_config_error(lambda opts=opts: check_options(opts, cfg.workers))
        if changed:
            raise ConfigError(
                f"{changed[0]} is set but {name} does not use the {node} options (only an "
                f"algorithm whose node references ${{{node}}} does, e.g. "
                f"{'algorithm=async_sgd' if node == 'async' else 'algorithm=dpsgd'}); "
                f"leave {node} out, or pick that algorithm"
            )
