"""Whether a run may continue: the checks `train.resume` makes before anything starts.

Made before Hydra writes anything and before any worker starts (the entry point, a sweep's
point check, and `train()` again for callers that skip both), so a refused or no-op resume
leaves every file of the named run as it was:

- `finished_run(cfg, run_dir)`: with `train.resume=auto`, a run directory whose run has
  finished is left alone — its summary when this configuration is the run's own (nothing to
  do), a `ConfigError` when it is another one (a changed sweep re-run into old directories);
- `check_resume(cfg, run_dir)`: the checkpoint `train.resume` names fits this run — the same
  layout (workers, processes, algorithm), the same configuration in everything that shapes
  the trajectory (`trajectory_differences`, except the keys `train.resume_allow_changes`
  lists), and a step short of the run's end.

The checkpoint is read by its header only (`checkpoint.read_header`: memory-mapped, nothing in
it run).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dpresearch.errors import ConfigError
from dpresearch.run.build import prepare_data

# Keys that never change what a run computes (its parameters and its metrics' values): how
# often it logs, evaluates or checkpoints, where its data lives, how it reports, how long it
# waits for a peer, fault injection. Everything else is compared.
NOT_TRAJECTORY = (
    "train.resume",
    "train.resume_allow_changes",
    "train.progress",
    "train.log_every",
    "train.eval_every",
    "train.eval_batch_size",
    "train.checkpoint_every",
    "train.checkpoint_keep",
    "train.save_model",
    "backend.threads",
    "backend.timeout_s",
    "backend.heartbeat_s",
    "logger",
    "debug",
    "data.root",
    "data.memmap",  # token files mapped or read whole: the same windows (tests/test_token_files.py)
    "data.download",
    "data.verify",
    "data.download_timeout_s",
    "async.timeout_s",
)
_ABSENT = object()
_MIRROR = re.compile(r"^\$\{([\w.]+)\}$")
SHOWN = 4  # differing keys named in one line


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a.b": leaf}` for every leaf of nested dicts (lists are leaves)."""
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: node}


def _covered(key: str, prefixes: Iterable[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def trajectory_differences(
    saved: Mapping[str, Any], current: DictConfig, allowed: Iterable[str] = ()
) -> list[str]:
    """The keys (dotted, sorted) whose values differ between the resolved configuration
    `saved` (a checkpoint's or a run's) and `current`, leaving out `NOT_TRAJECTORY` and
    `allowed` (a key or a whole node: `optimizer`). A key that only mirrors another node
    (`algorithm.compressor: ${compressor}`) is named by that node. A key `saved` lacks whose
    value is now null, or the default its schema declares, is no difference: a key added since,
    at its default (a run made before `train.init_from` existed started from no other weights
    either; one made before `train.eval_bn_stats` evaluated with the consensus's statistics)."""
    now = flatten(OmegaConf.to_container(current, resolve=True))
    before = flatten(dict(saved))
    skip = (*NOT_TRAJECTORY, *allowed)
    mirrors = {
        key: match.group(1)
        for key, value in flatten(OmegaConf.to_container(current, resolve=False)).items()
        if isinstance(value, str) and (match := _MIRROR.match(value))
    }
    differing = set()
    for key in set(now) | set(before):
        if _covered(key, skip) or now.get(key, _ABSENT) == before.get(key, _ABSENT):
            continue
        if key not in before and now.get(key, _ABSENT) == _declared_default(current, key):
            continue  # a key added since, at its default: the run saved it as absent
        for mirror, target in mirrors.items():
            if key == mirror or key.startswith(mirror + "."):
                key = target + key[len(mirror) :]
                break
        if not _covered(key, skip):
            differing.add(key)
    return sorted(differing)


def _declared_default(cfg: DictConfig, key: str) -> Any:
    """The default of dotted `key` as the structured schema behind its node declares it (a
    dataclass field's), else None (a key of no typed node counts as added at null)."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    kind = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if kind is None or not dataclasses.is_dataclass(kind):
        return None
    for f in dataclasses.fields(kind):
        if f.name == leaf:
            if f.default_factory is not dataclasses.MISSING:  # (`train.time_scenarios`: {})
                return f.default_factory()
            return None if f.default is dataclasses.MISSING else f.default
    return None


def show_changes(keys: list[str], saved: Mapping[str, Any], current: DictConfig) -> str:
    """`keys` (the first `SHOWN`) with their values in `saved` and in `current`: `k (a → b)`."""
    now, before = flatten(OmegaConf.to_container(current, resolve=True)), flatten(dict(saved))
    shown = [f"{k} ({_show(before, k)} → {_show(now, k)})" for k in keys[:SHOWN]]
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(shown) + more


def _show(flat: dict[str, Any], key: str) -> str:
    if key not in flat:  # a whole node added or removed: its children are the leaves
        children = [k for k in flat if k.startswith(key + ".")]
        return "a node" if children else "absent"
    return json.dumps(flat[key], ensure_ascii=False)


def allowed_changes(cfg: DictConfig) -> list[str]:
    """`train.resume_allow_changes` as a list of keys."""
    allowed = cfg.train.get("resume_allow_changes") or []
    return [str(k).strip() for k in allowed]


def finished_run(cfg: DictConfig, run_dir: Path | None) -> dict[str, Any] | None:
    """With `train.resume=auto`, the summary of the finished run in `run_dir` when it was made
    with this configuration (nothing to do), else None (no finished run there). Raises
    `ConfigError` for a finished run made with another configuration."""
    if cfg.train.resume != "auto" or run_dir is None:
        return None
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") != "finished":
        return None
    saved = _run_config(Path(run_dir))
    if saved is not None:
        differing = trajectory_differences(saved, cfg)
        if differing:
            raise ConfigError(
                f"{run_dir} holds a finished run made with other settings: "
                f"{show_changes(differing, saved, cfg)}; pass a new hydra.run.dir for this one"
            )
    return summary


def _run_config(run_dir: Path) -> dict[str, Any] | None:
    """The resolved configuration a run wrote (`config.yaml`), or None."""
    import yaml

    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return saved if isinstance(saved, dict) else None


def nothing_to_resume(cfg: DictConfig, run_dir: Path | None) -> str | None:
    """`train.resume=auto` with no checkpoint in `run_dir` yet: the line saying the run starts
    from step 0 (a forgotten `hydra.run.dir` looks exactly like this); else None. Call after
    `check_resume`, which refuses a resume that names a missing checkpoint."""
    from dpresearch.run.checkpoint_files import find_resume

    if cfg.train.resume is None or run_dir is None or find_resume(cfg.train.resume, run_dir):
        return None
    return (
        f"train.resume={cfg.train.resume}: no checkpoint in {run_dir}; starting from step 0 (to "
        "continue an earlier run, pass its directory as hydra.run.dir)"
    )


def data_vocabulary(cfg: DictConfig) -> str | None:
    """The fingerprint of the vocabulary of the run's data (text), None for other data."""
    return prepare_data(cfg).facts().get("data/vocab_fingerprint")


def check_started_from(saved: Mapping[str, Any], cfg: DictConfig, path: Path) -> None:
    """`train.init_from` with a resume: a resumed run takes every weight from its checkpoint,
    so the weights it names must be the ones the checkpoint's run started from (or it is left
    out); raises `ConfigError` otherwise, whatever `train.resume_allow_changes` says."""
    wanted = cfg.train.get("init_from")
    started = (saved.get("train") or {}).get("init_from")
    if wanted is not None and wanted != started:
        origin = f"train.init_from={started}" if started else "a random initialisation"
        raise ConfigError(
            f"train.init_from={wanted} with train.resume: checkpoint {path} continues a run "
            f"started from {origin}, and a resumed run takes its weights from its checkpoint; "
            "drop train.init_from (or pass the run's own), or start a new run without "
            "train.resume"
        )


def check_speed_streams(saved: Mapping[str, Any], cfg: DictConfig, path: Path) -> None:
    """The speed model (`async.speed`, every run's compute clock) draws the same random streams
    as the checkpoint's, whose state it continues (`asynchrony.speed.drawn_streams`); raises
    `ConfigError` otherwise, whatever `train.resume_allow_changes` says (a change between two
    random kinds, or of straggler_prob above 0, continues the saved streams)."""
    from dpresearch.asynchrony.options import AsyncOptions
    from dpresearch.asynchrony.speed import drawn_streams

    default = AsyncOptions()
    nodes = [saved.get("async") or {}, cfg.get("async") or {}]
    # each time scenario's clock (`train.time_scenarios`) continues its own streams too
    scenarios = [(saved.get("train") or {}).get("time_scenarios") or {}]
    scenarios.append(cfg.train.get("time_scenarios") or {})
    for key, nodes_of in [("async", nodes)] + [
        (f"train.time_scenarios.{name}", [_over(nodes[i], scenarios[i][name]) for i in (0, 1)])
        for name in scenarios[1]
        if name in scenarios[0]
    ]:
        shown, streams = [], []
        for node in nodes_of:
            kind = node.get("speed") or default.speed
            prob = node.get("straggler_prob")
            prob = default.straggler_prob if prob is None else prob
            shown.append(f"{key}.speed={kind}, {key}.straggler_prob={prob}")
            streams.append(drawn_streams(kind, prob))
        if streams[0] != streams[1]:
            raise ConfigError(
                f"checkpoint {path} holds the random streams of {shown[0]}, which {shown[1]} "
                f"does not draw: a resume may change {key}.speed only between random kinds and "
                f"{key}.straggler_prob only above 0; resume with {shown[0]}, or start a new run "
                "without train.resume"
            )


def _over(node: Mapping[str, Any], scenario: Any) -> dict[str, Any]:
    """A time scenario's keys over the run's `async` node (its null keys: the run's own)."""
    keys = scenario.items() if isinstance(scenario, Mapping) else ()
    return {**node, **{k: v for k, v in keys if v is not None}}


def check_resume(cfg: DictConfig, run_dir: Path | None, processes: int) -> None:
    """The checkpoint `train.resume` names (in `run_dir` for auto) can continue this run of
    `processes` processes; raises `ConfigError` (one line) otherwise. Nothing to resume (no
    resume, or auto with no checkpoint yet) passes."""
    from dpresearch.algorithms.outer import algorithm_name
    from dpresearch.run.checkpoint_files import (
        CheckpointError,
        find_resume,
        incompatibility,
        read_header,
    )

    if cfg.train.resume is None:
        return
    try:
        path = find_resume(cfg.train.resume, run_dir)
        if path is None:
            return
        header = read_header(path)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
    run = {"workers": cfg.workers, "processes": processes, "algorithm": algorithm_name(cfg)}
    problem = incompatibility(header, path, run)
    if problem is not None:
        raise ConfigError(problem)
    vocabulary = data_vocabulary(cfg)
    if header.get("vocabulary", vocabulary) != vocabulary:
        raise ConfigError(
            f"checkpoint {path} was trained on another vocabulary (fingerprint "
            f"{header.get('vocabulary')}, this corpus gives {vocabulary}); resume on the "
            "corpus and data.tokenizer it was trained on"
        )
    saved = header.get("config")
    if isinstance(saved, dict):
        check_started_from(saved, cfg, path)
        differing = trajectory_differences(saved, cfg, allowed_changes(cfg))
        if differing:
            raise ConfigError(
                f"checkpoint {path} was written with other settings: "
                f"{show_changes(differing, saved, cfg)}; resume with the run's own configuration, "
                f"or name deliberate changes: train.resume_allow_changes=[{','.join(differing)}]"
            )
        check_speed_streams(saved, cfg, path)
    steps = cfg.train.steps
    if steps is not None and int(header.get("step", 0)) >= steps:
        raise ConfigError(
            f"checkpoint {path} is at step {header.get('step')}, past this run's "
            f"train.steps={steps}: nothing is left to train; raise train.steps (with "
            "train.resume_allow_changes=[train.steps])"
        )
