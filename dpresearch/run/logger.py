"""The run directory's writer: resolved config, metrics.jsonl, summary.json, W&B.

Only the process holding worker 0 creates a `RunLogger`; every other process gets a
`NullLogger`. Each metrics line is flushed as it is written, so a crash loses nothing already
logged.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dpresearch.run.checkpoint_files import atomic_write_text
from dpresearch.run.io_errors import writing
from dpresearch.run.lifeline import check_launcher, guard_run_dir

WANDB_MODES = ("online", "offline", "disabled")
WANDB_ID_FILE = "wandb_id"  # the run's W&B id, so a resumed run continues the same W&B run


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep only the lines of `path` (metrics.jsonl) whose step is at most `last_step`
    (rewritten atomically; a torn last line is dropped); returns how many were kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if step <= last_step:
            kept.append(line + "\n")
    atomic_write_text(path, "".join(kept))
    return len(kept)


class NullLogger:
    """Logger of the processes that do not write."""

    def log(self, metrics: dict[str, Any]) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


WANDB_MAX_BINS = 512  # wandb.Histogram's limit


def wandb_value(key: str, value: Any) -> Any:
    """What W&B gets for a summary entry: a list under a key ending in `_histogram` (counts of
    the integers 0, 1, 2, …, e.g. `async/tau_histogram`) becomes a `wandb.Histogram`, with
    neighbouring integers merged when there are more than W&B's 512 bins."""
    if not (key.endswith("_histogram") and isinstance(value, list) and value):
        return value
    import numpy as np
    import wandb

    width = -(-len(value) // WANDB_MAX_BINS)
    counts = np.add.reduceat(np.asarray(value, dtype=np.int64), np.arange(0, len(value), width))
    edges = np.arange(len(counts) + 1, dtype=np.float64) * width - 0.5
    return wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist()))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


@contextlib.contextmanager
def _quiet_wandb() -> Iterator[None]:
    """W&B's own start-up chatter off (its errors come back as exceptions; we print one line)."""
    saved = os.environ.get("WANDB_SILENT")
    os.environ["WANDB_SILENT"] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("WANDB_SILENT", None)
        else:
            os.environ["WANDB_SILENT"] = saved


PROBE_S = 4.0  # how long an online start waits for the W&B server's first answer


def _unanswered(within_s: float) -> str | None:
    """Why W&B's server cannot be used now (no answer to an HTTP request within `within_s`,
    name resolution included: no network, a firewall dropping packets, a server that never
    answers), or None when it answers (any HTTP status) or no API key is configured (W&B then
    refuses at once, without the network). W&B's own `init_timeout` does not bound its start:
    without a network it took 40-90 s to give up."""
    import urllib.error
    import urllib.request

    from wandb.sdk import wandb_setup

    if not (os.environ.get("WANDB_API_KEY") or _netrc().is_file()):
        return None
    url = os.environ.get("WANDB_BASE_URL") or str(wandb_setup.singleton().settings.base_url)
    answer: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(url, timeout=within_s).close()
            answer.append(None)
        except urllib.error.HTTPError:
            answer.append(None)  # it answered
        except Exception as exc:  # (any failure to get an answer is the same)
            answer.append(f"{url}: {getattr(exc, 'reason', None) or exc}")

    thread = threading.Thread(target=probe, name="dpresearch-wandb-probe", daemon=True)
    thread.start()
    thread.join(within_s)
    return answer[0] if answer else f"no answer from {url} within {within_s:g} s"


def _netrc() -> Path:
    return Path(os.environ.get("NETRC") or Path.home() / ".netrc")


class RunLogger(NullLogger):
    """Writes `config.yaml`, `metrics.jsonl` and `summary.json` into `run_dir`; mirrors
    metrics to W&B when `logger_cfg.wandb` is true. An online W&B start that fails (no network,
    no API key, no answer within `logger_cfg.init_timeout_s`) falls back to offline with one
    warning line: the run never fails for W&B's sake."""

    def __init__(
        self,
        run_dir: Path,
        resolved_cfg: dict[str, Any],
        logger_cfg: Any,
        resume_at: int | None = None,
    ) -> None:
        """`resume_at`: this run continues one whose checkpoint was taken after step
        `resume_at` (0: a resumed run that starts afresh): `metrics.jsonl` keeps only its lines
        up to that step, so no step appears twice, and W&B continues the run whose id is stored
        in the run directory (`wandb_id`)."""
        self.run_dir = Path(run_dir)
        guard_run_dir(self.run_dir)  # a worker writes only while its launcher holds the lock
        config = self.run_dir / "config.yaml"
        with writing(config):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            config.write_text(OmegaConf.to_yaml(resolved_cfg))
        metrics = self.metrics_path = self.run_dir / "metrics.jsonl"
        with writing(metrics):
            if resume_at is not None:
                truncate_metrics(metrics, resume_at)
            self._metrics = open(metrics, "a", buffering=1)  # noqa: SIM115
        self._wandb = None
        if logger_cfg.wandb:
            self._wandb = self._start_wandb(resolved_cfg, logger_cfg, resume_at is not None)

    def _start_wandb(self, resolved_cfg: dict[str, Any], logger_cfg: Any, resume: bool):
        mode = logger_cfg.mode or os.environ.get("WANDB_MODE") or "online"
        if mode not in WANDB_MODES:
            raise ValueError(f"logger.mode={mode!r}; choose one of: {', '.join(WANDB_MODES)}")
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")

        fields = dict(
            project=logger_cfg.project,
            entity=logger_cfg.entity,
            name=logger_cfg.get("name"),
            group=logger_cfg.group,
            job_type=logger_cfg.job_type,
            tags=list(logger_cfg.tags) or None,
            config=resolved_cfg,
            dir=str(self.run_dir),
            reinit="finish_previous",
            id=run_id,
            resume="allow",
        )
        if mode != "online":
            return wandb.init(mode=mode, **fields)
        timeout = float(logger_cfg.init_timeout_s)
        silent = _unanswered(min(timeout, PROBE_S))
        if silent is not None:  # no network, or a server that never answers: offline at once
            return self._offline(wandb, silent, fields, id_file, started=False)
        try:
            with _quiet_wandb():
                run = wandb.init(
                    mode="online", settings=wandb.Settings(init_timeout=timeout), **fields
                )
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return self._offline(wandb, reason, fields, id_file, started=True)
        print(f"W&B: {run.url}", flush=True)
        return run

    def _offline(self, wandb: Any, reason: str, fields: dict, id_file: Path, started: bool):
        """The offline W&B run an online start falls back to, said in one warning line."""
        print(
            f"warning: W&B online start failed ({reason}); logging offline to "
            f"{self.run_dir / 'wandb'} (upload later with `wandb sync`)",
            file=sys.stderr,
            flush=True,
        )
        with _quiet_wandb():
            if started:
                with contextlib.suppress(Exception):
                    wandb.teardown()
            # The failed online start may still hold its run id in W&B's service ("run ID
            # is in use"): the offline run gets its own id, kept for a later resume.
            fields["id"] = uuid.uuid4().hex[:12]
            id_file.write_text(f"{fields['id']}\n")
            return wandb.init(mode="offline", settings=wandb.Settings(silent=True), **fields)

    def log(self, metrics: dict[str, Any]) -> None:
        check_launcher()  # a worker whose launcher (holding the run's lock) died writes nothing
        line = json.dumps({k: _jsonable(v) for k, v in metrics.items()}) + "\n"
        with writing(self.metrics_path, len(line)):  # (a torn line is dropped on resume)
            self._metrics.write(line)
        if self._wandb is not None:
            self._wandb.log(metrics, step=int(metrics["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        check_launcher()
        text = json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2) + "\n"
        try:
            with writing(self.run_dir / "summary.json", len(text)):
                atomic_write_text(self.run_dir / "summary.json", text)
        finally:
            with contextlib.suppress(OSError):  # (buffered lines a full disk refused)
                self._metrics.close()
        if self._wandb is not None:
            self._wandb.summary.update({k: wandb_value(k, v) for k, v in summary.items()})
            self._wandb.finish()
            self._wandb = None
