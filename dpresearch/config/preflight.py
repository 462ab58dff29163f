"""Everything that can be known about a run before any worker starts, checked in one place.

`preflight(cfg, overrides)` runs `validate` (the configuration alone), loads the data set (or
fetches it), checks that every worker gets a batch, and builds each component once on the CPU —
the model (with one forward pass on two training examples, and the weights `train.init_from`
names loaded against it), the optimizer and the schedule —
so that a bad value surfaces as one `ConfigError` line here, not as a traceback in every worker
process. It builds what the trainer builds, with the trainer's own factories; nothing it builds
is kept except the data set (see `validate.prepare_data`).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from dpresearch.config.validate import ConfigError, prepare_data, validate
from dpresearch.data.base import Dataset

# Configurations that passed in this process: the entry point checks a run before Hydra starts
# and `train()` checks it again inside; the second time costs nothing.
_PASSED: set[str] = set()
# Warnings printed in this process (each once).
_NOTED: set[str] = set()


def preflight(cfg: DictConfig, overrides: Sequence[str] = ()) -> Dataset:
    """Raise `ConfigError` for a run that cannot start; return its data set (on the CPU)."""
    try:
        key = json.dumps(
            [OmegaConf.to_container(cfg, resolve=True), list(overrides)],
            sort_keys=True,
            default=str,
        )
    except Exception:
        key = None
    if key is not None and key in _PASSED:
        return prepare_data(cfg)
    validate(cfg, overrides)
    dataset = prepare_data(cfg)
    # the trainer holds the validation split out itself: the data set returned stays whole
    trained = _call("train", lambda: dataset.hold_out(cfg.train.val_size))
    steps_per_epoch = check_fit(cfg, trained)
    model = build_model(cfg, dataset)
    check_init_from(cfg, model, dataset)
    check_optimizer(cfg, model)
    check_fragments(cfg, model)
    check_dct_blocks(cfg, model)
    check_batched(cfg, dataset)
    steps = cfg.train.steps or max(1, math.ceil(cfg.train.epochs * steps_per_epoch))
    schedule = _build("schedule", cfg.schedule, steps_per_epoch=steps_per_epoch, total_steps=steps)
    _call("schedule", lambda: [float(schedule(s)) for s in (0, steps // 2, steps - 1)])
    if key is not None:
        _PASSED.add(key)
    return dataset


def check_fit(cfg: DictConfig, dataset: Dataset) -> int:
    """Every worker's shard holds at least one batch; returns the steps per epoch."""
    partitioner = _call("data", lambda: dataset.make_partitioner(cfg.workers, cfg.seed))
    per_worker = partitioner.samples_per_worker
    steps_per_epoch = per_worker // cfg.train.batch_size
    if steps_per_epoch < 1:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} is larger than the {per_worker} examples "
            f"each of {cfg.workers} workers holds ({dataset.num_train} in all); lower "
            "train.batch_size or workers"
        )
    return steps_per_epoch


def build_model(cfg: DictConfig, dataset: Dataset) -> torch.nn.Module:
    """The model, built for the data set's shapes, which accepts its inputs and returns one
    score per class."""
    shape = tuple(dataset.input_shape)
    name = cfg.model._target_.rsplit(".", 1)[-1]

    def wrong_model(exc: BaseException) -> ConfigError:
        return ConfigError(
            f"model {name} cannot take this data set's inputs of shape {shape} "
            f"({_first_line(exc)}); pick a model for them, e.g. model=mlp for vectors, "
            "model=resnet20 for images or model=gpt for text"
        )

    try:
        model = instantiate(cfg.model, num_classes=dataset.num_classes, input_shape=shape)
    except Exception as exc:
        cause = _root_cause(exc)
        if _first_line(cause).startswith("model."):
            raise ConfigError(_first_line(cause)) from None
        raise wrong_model(cause) from None
    x, _ = dataset.train_batch(torch.arange(2), torch.Generator().manual_seed(0))
    model.eval()
    try:
        with torch.no_grad():
            out = model(x.cpu())
    except Exception as exc:
        raise wrong_model(exc) from None
    if tuple(out.shape[1:]) != dataset.output_shape:
        raise ConfigError(
            f"model {name} returns outputs of shape {tuple(out.shape[1:])} per example, not "
            f"{dataset.output_shape} (scores per class); check its num_classes handling"
        )
    return model


def check_init_from(cfg: DictConfig, model: torch.nn.Module, dataset: Dataset) -> None:
    """`train.init_from` names weights `model` (built from `cfg` for `dataset`) can start
    from (`run.init_from`): the same resolved `model` node (the differing keys named), the same
    vocabulary, every tensor of the same shape. Under torchrun global rank 0 alone reads them
    (the others receive them), so it alone checks."""
    from dpresearch.launch.processes import global_rank, under_torchrun
    from dpresearch.run import init_from
    from dpresearch.run.resume import show_changes, trajectory_differences

    value = cfg.train.get("init_from")
    if value is None or str(value).strip() == "" or (under_torchrun() and global_rank() != 0):
        return
    source = init_from.resolve(str(value))
    if source.config is not None:
        differing = [
            k for k in trajectory_differences(source.config, cfg) if k.split(".")[0] == "model"
        ]
        if differing:
            changes = show_changes(differing, source.config, cfg)
            raise source.fail(f"its model differs: {changes}; {init_from.FIX}")
    vocabulary = dataset.facts().get("data/vocab_fingerprint")
    if source.vocabulary is not None and source.vocabulary != vocabulary:
        raise source.fail(
            f"its model was trained on another vocabulary (fingerprint {source.vocabulary}, this "
            f"corpus gives {vocabulary}); start from a run on this corpus and data.tokenizer"
        )
    init_from.weights(source, model)


def check_batched(cfg: DictConfig, dataset: Dataset) -> None:
    """`train.batched_workers=true|stacked|vmap` only for a model whose workers can run that
    way (a run that holds several workers in one process: simulated)."""
    from dpresearch.run.batched import batched_mode, choose_way, unbatchable_message

    mode = batched_mode(cfg.train.batched_workers)
    if mode in ("auto", "false"):
        return
    if cfg.backend.name != "simulated" or cfg.workers < 2:
        return  # one worker per process: nothing to batch
    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    way, reason = choose_way(cfg, dataset, torch.device(device))
    if way is None:
        name = cfg.model._target_.rsplit(".", 1)[-1]
        raise ConfigError(unbatchable_message(name, reason, mode))


def check_optimizer(cfg: DictConfig, model: torch.nn.Module) -> None:
    """The optimizer node builds for the model's parameters (the trainer's own factory)."""
    from dpresearch.optim import make_optimizer

    _call("optimizer", lambda: make_optimizer(cfg.optimizer, model))


def check_fragments(cfg: DictConfig, model: torch.nn.Module) -> None:
    """An outer optimizer's fragments can be cut from the model's blocks of layers, and its
    optimizer node builds for the model's parameters."""
    from dpresearch.algorithms.outer import outer_node
    from dpresearch.algorithms.outer.fragments import blocks_of, split
    from dpresearch.algorithms.outer.optimizer import OuterOptions
    from dpresearch.optim import make_optimizer

    node = outer_node(cfg)
    if node is not None:
        opts = OuterOptions.from_node(node)
        _call("outer", lambda: split(blocks_of(model), int(opts.fragments), opts.fragment_pattern))
        if node.get("optimizer") is not None:  # (NoLoCo steps by hand, without one)
            _call("outer", lambda: make_optimizer(node.optimizer, model))


def check_dct_blocks(cfg: DictConfig, model: torch.nn.Module) -> None:
    """DCT top-k (DeMo's message, the `dct_topk` compressor) compresses this model's blocks:
    one error line where every block would be sent whole, a warning line (once, by the process
    that writes) where most coefficients would (`compress.dct.whole_blocks_note`)."""
    from dpresearch.algorithms.demo import DeMoAlgorithm
    from dpresearch.algorithms.outer import outer_node
    from dpresearch.compress.build import ChannelOptions
    from dpresearch.compress.channel import build_compressor, parameter_chunks
    from dpresearch.compress.dct import DCTTopK, chunk_shape, whole_blocks_note
    from dpresearch.launch.processes import global_rank, under_torchrun
    from dpresearch.options import options_of
    from dpresearch.run.build import algorithm_class

    tensors = [p.shape for p in model.parameters() if p.requires_grad]
    found: list[tuple[str, list, int, int]] = []  # (node, shapes, chunk, topk)
    cls = algorithm_class(cfg)
    if cls is not None and issubclass(cls, DeMoAlgorithm):
        found.append(("algorithm", tensors, cfg.algorithm.chunk, cfg.algorithm.topk))
    outer = outer_node(cfg)
    declared = options_of(cfg.algorithm._target_)
    # the compression units: the algorithm's declared ones; the outer node's reducer: auto
    nodes = [
        ("compressor", cfg.get("compressor"), declared and declared.from_node(cfg.algorithm)),
        ("outer.compressor", outer and outer.get("compressor"), None),
    ]
    for key, node, units in nodes:
        compressor = build_compressor(node, 0) if node else None  # (validate checked the node)
        if isinstance(compressor, DCTTopK):
            granularity = getattr(units, "granularity", "auto")
            if granularity == "auto":
                granularity = compressor.default_granularity
            bucket_mb = getattr(units, "bucket_mb", ChannelOptions.bucket_mb)
            chunks = parameter_chunks(model, granularity, bucket_mb, 4)
            shapes = [chunk_shape(ch) for ch in chunks]
            found.append((key, shapes, compressor.chunk, compressor.topk))
    for key, shapes, chunk, topk in found:
        try:
            note = whole_blocks_note(shapes, chunk, topk, key)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if note is not None and note not in _NOTED and not (under_torchrun() and global_rank()):
            _NOTED.add(note)
            print(f"warning: {note}", file=sys.stderr, flush=True)


def _build(group: str, node: DictConfig, **runtime: Any) -> Any:
    return _call(group, lambda: instantiate(node, **runtime))


def _call(group: str, make: Any) -> Any:
    """`make()`, with a user-input failure turned into one `ConfigError` line on `group`."""
    try:
        return make()
    except ConfigError:
        raise
    except (InstantiationException, ValueError, TypeError, RuntimeError, KeyError) as exc:
        message = _first_line(_root_cause(exc))
        if message.startswith(f"{group}.") or message.startswith("data."):
            raise ConfigError(message) from None
        raise ConfigError(f"{group}: {message}; check the {group}.* options") from None


def _root_cause(exc: BaseException) -> BaseException:
    """The error inside Hydra's instantiation wrappers."""
    while isinstance(exc, InstantiationException) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
