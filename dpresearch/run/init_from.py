"""`train.init_from`: start a run from another run's model weights, and nothing else.

What is taken: the model's weights — its trainable parameters and its buffers, floating-point
(BatchNorm's running mean and variance) and integer (`num_batches_tracked`). Everything else
starts fresh, as in any new run: the optimizer state, the learning-rate schedule, the step
counter, the data order, the random streams and the algorithm's state (its error-feedback
memories, an outer optimizer's momentum, ...).

Where the weights come from (`resolve`):

- a run directory whose run finished with its model (`summary.json` says finished and
  `model_final.pt` is there; `<run>/model_final.pt` named itself works too): that model — the
  consensus model the run evaluated at its end (the algorithm's `consensus()`: the workers'
  average, worker 0's model under synchronous training, the server's model, DiLoCo's outer
  model), at the run's last step;
- otherwise a run directory, or its `checkpoints/` named itself: its latest complete
  checkpoint (`checkpoint_files.latest_checkpoint`, as `train.resume` finds it; a finished
  run's last checkpoint is the last one its `train.checkpoint_every` wrote, not its end); a
  checkpoint file: that one. A checkpoint holds every worker's replica row, not the consensus
  model (forming that takes the algorithm's state and its collectives), so the weights are
  worker 0's row: the
  consensus model for algorithms whose workers agree after every step (synchronous training,
  compressed or not), worker 0's own model at that step for local methods.

Every worker of the new run starts from those same weights, whatever the number of workers of
either run: the main process reads the file (through the checkpoint loader: tensors and plain
data only, nothing in the file is run) and loads the weights into its replicas, and
`build.build_run`'s broadcast of worker 0's state hands them to every other worker and process
before the optimizers and the algorithm are built — so the other processes, as on resume, need
no access to the file.

Refused before any worker starts, in one line (`config.preflight.check_init_from`): a path that
does not exist or holds no checkpoint and no finished model, a model whose resolved `model`
node differs (the differing keys named), whose tensors differ in shape (the first named), or
that was trained on another vocabulary. `train.init_from` is part of the trajectory: a resumed
run takes every weight from its own checkpoint, and a checkpoint of a run started from other
weights is refused (`resume.check_resume`). Where the weights came from (the file and its step)
is printed at the start and kept in summary.json (`init_from`) and in the run's checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig
from torch import Tensor, nn

from dpresearch.comm.base import Communicator
from dpresearch.errors import ConfigError
from dpresearch.replicas import Replicas, row_state_dict
from dpresearch.run.checkpoint_files import (
    CHECKPOINTS,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    load_model_file,
    read_header,
)

FINAL_MODEL = "model_final.pt"  # a finished run's consensus model (`trainer.Trainer._finished`)


@dataclass(frozen=True)
class Source:
    """The file a run starts from: `kind` "final model" (a finished run's `model_final.pt`) or
    "checkpoint" (worker 0's row of it), after `step` steps of its run, with that run's resolved
    configuration and vocabulary fingerprint where known."""

    value: str  # train.init_from as given
    path: Path
    kind: str
    step: int
    config: dict[str, Any] | None
    vocabulary: str | None
    header: dict[str, Any] = field(default_factory=dict, repr=False)

    def facts(self) -> dict[str, Any]:
        """Where the run's weights came from, as summary.json and the checkpoints keep it."""
        taken = "the consensus model" if self.kind == "final model" else "worker 0's row"
        return {"path": str(self.path), "step": self.step, "weights": taken}

    def fail(self, problem: str) -> ConfigError:
        return ConfigError(f"train.init_from={self.value}: {problem}")


def resolve(value: str) -> Source:
    """The file `train.init_from=value` names (see the module docstring). Raises
    `ConfigError` (one line) for a path holding no checkpoint and no finished model."""
    where = f"train.init_from={value}"
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{where}: no such file or directory; pass a checkpoint file or a run directory "
            "(a finished run, or one holding checkpoints/)"
        )
    if path.is_dir():
        run_dir = path.parent if path.name == CHECKPOINTS else path
        final = _final_model(value, run_dir) if path.name != CHECKPOINTS else None
        if final is not None:
            return final
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise ConfigError(
                f"{where}: no finished run's {FINAL_MODEL} and no complete checkpoint "
                "(checkpoints/latest) there; pass a checkpoint file, or the directory of a run "
                "that finished or wrote checkpoints (train.checkpoint_every)"
            )
        path = latest
    elif path.name == FINAL_MODEL:
        final = _final_model(value, path.parent)
        if final is None:
            raise ConfigError(
                f"{where}: no finished run's config.yaml and summary.json beside it (the "
                "model's settings and step); pass its run directory as the run left it"
            )
        return final
    try:
        header = read_header(path, fix="pass a checkpoint file or a run directory")
    except CheckpointError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return Source(
        value,
        path.resolve(),
        "checkpoint",
        int(header["step"]),
        header.get("config"),
        header.get("vocabulary"),
        header,
    )


def _final_model(value: str, run_dir: Path) -> Source | None:
    """The final model of the finished run in `run_dir`, or None (not finished, no model)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    model = run_dir / FINAL_MODEL
    if not (isinstance(summary, dict) and summary.get("status") == "finished" and model.is_file()):
        return None
    return Source(
        value,
        model.resolve(),
        "final model",
        int(summary["total_steps"]),
        config if isinstance(config, dict) else None,
        summary.get("data/vocab_fingerprint"),
    )


def weights(source: Source, model: nn.Module) -> dict[str, Tensor]:
    """The source's weights as `model`'s named tensors (its state dict's names: trainable
    parameters and buffers), read from the file. Raises `ConfigError` naming the first tensor
    that does not fit `model`."""
    try:
        if source.kind == "final model":
            state = load_model_file(source.path)
        else:
            state = _worker0_row(source, model)
    except CheckpointError as exc:
        raise source.fail(str(exc)) from None
    except ValueError as exc:
        raise source.fail(f"its model does not fit this one ({exc}); {FIX}") from None
    mine = model.state_dict()
    for name, tensor in mine.items():
        if name not in state and not _frozen(model, name):
            raise source.fail(f"its model has no {name}; {FIX}")
        if name in state and state[name].shape != tensor.shape:
            raise source.fail(
                f"its {name} is of shape {tuple(state[name].shape)}, this model's "
                f"{tuple(tensor.shape)}; {FIX}"
            )
    extra = sorted(set(state) - set(mine))
    if source.kind == "final model" and extra:
        raise source.fail(f"its model has {extra[0]}, this one has not; {FIX}")
    return {name: state[name] for name in mine if name in state}


FIX = "start from a run of this model (the same model= and model.* settings, the same data)"


def _frozen(model: nn.Module, name: str) -> bool:
    """A parameter that does not train: not in a replica's flat row (kept as initialised)."""
    parameter = dict(model.named_parameters(remove_duplicate=False)).get(name)  # tied: any name
    return parameter is not None and not parameter.requires_grad


def _worker0_row(source: Source, model: nn.Module) -> dict[str, Tensor]:
    """Worker 0's row of a checkpoint: in the first process that holds a worker (after the
    processes an algorithm adds, e.g. a parameter server; a simulated run's one process)."""
    file = load_checkpoint(source.path, mmap=True)
    processes, workers = int(file["processes"]), int(file["workers"])
    replicas = file["states"][processes - workers if processes > 1 else 0]["replicas"]
    # a run saved before `train.channels_last` existed ran channels-first
    layout = bool((source.config or {}).get("train", {}).get("channels_last"))
    return row_state_dict(
        model,
        replicas["params"][0],
        replicas["buffers"][0],
        replicas["int_buffers"][0],
        bool(layout),
    )


@torch.no_grad()
def load_into(cfg: DictConfig, comm: Communicator, replicas: Replicas) -> dict[str, Any]:
    """On the main process, load `train.init_from`'s weights into every local replica; returns
    the set-up facts to print and keep (`{"init_from": Source.facts()}`; other processes and
    runs without it: {}). The caller broadcasts worker 0's state to every worker."""
    value = cfg.train.get("init_from")
    if value is None or str(value).strip() == "" or not comm.is_main_process:
        return {}
    source = resolve(str(value))
    state = weights(source, replicas.models[0])
    for model in replicas.models:
        model.load_state_dict(state, strict=False)  # (frozen parameters stay as initialised)
    return {"init_from": source.facts()}
