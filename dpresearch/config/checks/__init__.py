"""The checks of each config node, one function per node, split by what they check:
`run` (the typed run nodes of `schema.py`: workers, backend, device, train, run control,
comm, network, logger), `plugins` (the data, optimizer and schedule values every data set,
torch optimizer or schedule would reject mid-start) and `algorithm` (the optimizer an algorithm
owns, the algorithm class's own `Algorithm.check_config` with its declared `OPTIONS`,
compression through `compress.build.check_algorithm_node`, the outer optimizer, the protocol,
and nodes an algorithm ignores); the `async` node through `asynchrony.options.check_options`.

`NODE_CHECKS` and `PLUGIN_CHECKS` are the tables `validate.validate` runs in order. Every check
raises `ConfigError` (a typed node's) or ValueError (a plug-in's; the first line becomes the
`ConfigError`), one line naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from omegaconf import DictConfig

from dpresearch.config.checks.algorithm import (
    REFERENCED_NODES,
    check_algorithm,
    check_compression,
    check_optimizer_owner,
    check_outer,
    check_protocol,
    check_unused_nodes,
)
from dpresearch.config.checks.common import as_config_error
from dpresearch.config.checks.plugins import (
    NON_NEGATIVE_OPTIMIZER_KEYS,
    PARTITIONS,
    check_data,
    check_optimizer,
    check_optimizer_values,
    check_schedule,
    partitions_of,
)
from dpresearch.config.checks.run import (
    BACKENDS,
    check_backend,
    check_comm,
    check_device,
    check_hierarchy,
    check_logger,
    check_network,
    check_run_control,
    check_train,
    check_workers,
)
from dpresearch.run.build import algorithm_class, process_count
from dpresearch.run.time_scenarios import check_config


def check_time_scenarios(cfg: DictConfig) -> None:
    """`train.time_scenarios` (`run/time_scenarios.py`), for the configured algorithm."""
    check_config(cfg, algorithm_class(cfg))


# Every node's check, in the order `validate` runs them: the typed nodes, then (after the
# plug-in targets are known to import and take their keys) the plug-in nodes.
NODE_CHECKS: dict[str, Callable[[DictConfig], None]] = {
    "workers": check_workers,
    "backend": check_backend,
    "train.device": check_device,
    "train": check_train,
    "comm": check_comm,
    "network": check_network,
    "logger": check_logger,
    "train.run_control": check_run_control,
}
PLUGIN_CHECKS: dict[str, Callable[[DictConfig], None]] = {
    "data": check_data,
    "optimizer": check_optimizer,
    "optimizer.owner": check_optimizer_owner,
    "schedule": check_schedule,
    "compressor": check_compression,
    "protocol": check_protocol,
    "algorithm": check_algorithm,
    "outer": check_outer,
    "train.time_scenarios": check_time_scenarios,
}

__all__ = [
    "BACKENDS",
    "NODE_CHECKS",
    "NON_NEGATIVE_OPTIMIZER_KEYS",
    "PARTITIONS",
    "PLUGIN_CHECKS",
    "REFERENCED_NODES",
    "as_config_error",
    "check_algorithm",
    "check_backend",
    "check_comm",
    "check_compression",
    "check_data",
    "check_device",
    "check_hierarchy",
    "check_logger",
    "check_network",
    "check_optimizer",
    "check_optimizer_owner",
    "check_optimizer_values",
    "check_outer",
    "check_protocol",
    "check_run_control",
    "check_schedule",
    "check_train",
    "check_unused_nodes",
    "check_workers",
    "partitions_of",
    "process_count",
]
