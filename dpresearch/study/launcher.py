"""Running a study's points: resumable, every point's status recorded.

`run_study(study, out)` runs each point of `study` into `out/<point.dir>` unless that directory
already holds a result (`finished` or `diverged`: skipped). A directory left by a killed or
interrupted attempt is moved to `out/aborted/` (kept, never overwritten) and the point runs
again. `out/status.json` records every point's status, attempts, return code and seconds; it is
rewritten after each point, so a study killed at any moment resumes with `run_study` again.

Launchers:
- `local`: one `python -m dpresearch.train ... hydra.run.dir=<point>` per point, `jobs` at once;
  the children die with the study (Linux: parent-death signal) and are told how many run at
  once (`DPRESEARCH_JOBS`), so each takes at most its share of the cores
  (`dpresearch/launch/threads.py`).
- `hydra`: one `python -m dpresearch.train -m ...` per case and lr over the seeds left, through
  the configured Hydra launcher (`hydra_launcher`: e.g. `parallel` = joblib, `slurm`).
- `inprocess`: compose and train in this process, one point at a time (tests, debugging).
- a callable `(point, run_dir, overrides) -> returncode`.

Every point's run carries `logger.group=<study>`, `logger.tags=[<case>]` and
`logger.name="<case> | lr=<lr> | seed=<seed>"` (used when the W&B logger is on: the name holds
what the study varies, not what every point shares) and a `study_point.json` naming its study,
case, lr and seed, which the analysis reads.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dpresearch import SOURCE_ROOT
from dpresearch.analysis.runs import POINT_FILE, infer_status
from dpresearch.study.spec import Point, Study, StudyError, slug

DONE = ("finished", "diverged")  # a point holding one of these is a result: never re-run
Runner = Callable[[Point, Path, list[str]], int]


def point_state(run_dir: Path) -> str:
    """`missing` (nothing there), or the run's status as the analysis infers it."""
    if not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists():
        return "missing" if not (run_dir / "summary.json").exists() else "finished"
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        summary = None
    return infer_status(summary)


class StatusBook:
    """`status.json`: one record per point, written atomically after every change."""

    def __init__(self, path: Path, study: Study) -> None:
        self.path, self._lock = path, threading.Lock()
        old = json.loads(path.read_text()) if path.exists() else {}
        self.data: dict[str, Any] = {
            "study": study.name,
            "file": str(study.path),
            "points": old.get("points", {}),
        }

    def get(self, point: Point) -> dict[str, Any]:
        return self.data["points"].get(point.id, {})

    def update(self, point: Point, **fields: Any) -> None:
        with self._lock:
            record = self.data["points"].setdefault(
                point.id,
                {
                    "case": point.case,
                    "lr": point.lr,
                    **({"also": dict(point.also)} if point.also else {}),
                    "seed": point.seed,
                    "dir": str(point.dir),
                    "attempts": 0,
                },
            )
            record.update(fields)
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.data, indent=1) + "\n")
            os.replace(tmp, self.path)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _set_aside(run_dir: Path, out: Path) -> Path:
    """Move a killed attempt out of the way, keeping it under `out/aborted/`."""
    rel = run_dir.relative_to(out / "runs")
    for n in range(1, 10_000):
        aside = out / "aborted" / rel.parent / f"{rel.name}.attempt{n}"
        if not aside.exists():
            aside.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(run_dir), str(aside))
            return aside
    raise StudyError(f"too many aborted attempts of {run_dir}")


def run_name(point: Point, seed: str | None = None) -> str:
    """The W&B name of a point: its case and the values the study varies (lr, any other
    tuned key, seed), never the overrides every point shares."""
    also = "".join(f" | {k}={v:g}" for k, v in point.also)
    return f"{point.case} | lr={point.lr:g}{also} | seed={point.seed if seed is None else seed}"


def _point_overrides(study: Study, point: Point, seed: str | None = None) -> list[str]:
    from dpresearch.config.cli_check import quote_value

    return [
        *point.overrides,
        f"logger.group={quote_value(slug(study.name))}",  # quoted: unicode, or a leading digit
        f"logger.tags=[{quote_value(slug(point.case))}]",
        f"logger.name={quote_value(run_name(point, seed))}",
        "train.progress=false",
    ]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _popen_kwargs(jobs: int = 1) -> dict[str, Any]:
    from dpresearch.launch.threads import JOBS_ENV

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if jobs > 1:
        env[JOBS_ENV] = str(jobs)  # jobs × threads within the cores
    if SOURCE_ROOT is not None:
        # The children import this checkout's dpresearch, whatever the interpreter has
        # installed (an installed wheel is what the interpreter imports anyway).
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SOURCE_ROOT), *filter(None, [env.get("PYTHONPATH")])]
        )
    # They run where the study was started: relative paths in overrides mean the same there.
    kwargs: dict[str, Any] = {"env": env, "stdin": subprocess.DEVNULL}
    if sys.platform.startswith("linux"):
        kwargs["preexec_fn"] = _die_with_parent
    return kwargs


def run_local(point: Point, run_dir: Path, overrides: list[str], jobs: int = 1) -> int:
    """`python -m dpresearch.train` for one point, one of `jobs` running at once; output in
    `run_dir/launcher.log`."""
    from dpresearch.config.cli_check import quote_value

    cmd = [
        sys.executable,
        "-m",
        "dpresearch.train",
        *overrides,
        f"hydra.run.dir={quote_value(str(run_dir))}",
    ]
    with (run_dir / "launcher.log").open("w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        return subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, **_popen_kwargs(jobs)
        ).returncode


def run_inprocess(point: Point, run_dir: Path, overrides: list[str]) -> int:
    """Compose the point's config and train it in this process."""
    from hydra import compose, initialize_config_dir

    from dpresearch.config.selects import with_selected_choices
    from dpresearch.train import CONF_DIR, train

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=with_selected_choices([o for o in overrides if not o.startswith("hydra")]),
        )
    train(cfg, run_dir)
    return 0


def _hydra_group(study: Study, points: list[Point], out: Path, launcher: str | None) -> int:
    """One multirun over the seeds of `points` (one case, one setting)."""
    from dpresearch.config.cli_check import quote_value

    first = points[0]
    overrides = [o for o in _point_overrides(study, first, "${seed}") if not o.startswith("seed=")]
    lr_dir = out / first.dir.parent
    cmd = [
        sys.executable,
        "-m",
        "dpresearch.train",
        "-m",
        *overrides,
        "seed=" + ",".join(str(p.seed) for p in points),
        f"hydra.sweep.dir={quote_value(str(lr_dir))}",
        "hydra.sweep.subdir=seed${seed}",
        *([f"hydra/launcher={launcher}"] if launcher else []),
    ]
    with (lr_dir / "launcher.log").open("a") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        return subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, **_popen_kwargs()
        ).returncode


def plan(
    study: Study, out: str | Path, only: Sequence[str] | None = None, points=None
) -> list[tuple]:
    """(point, state) for every point (default: the study's grid), without touching anything:
    `state` is `missing`, a run status (see `point_state`), or `running` while the recorded
    study process lives."""
    out = Path(out).resolve()
    path = out / "status.json"
    records = json.loads(path.read_text()).get("points", {}) if path.exists() else {}
    rows = []
    for point in study.points(only) if points is None else points:
        state = point_state(out / point.dir)
        if state not in DONE and _alive(records.get(point.id, {}).get("pid")):
            state = "running"
        rows.append((point, state))
    return rows


class _Tally:
    """Points ended so far of `total`, the time since the first started and the estimated
    time left at that pace (thread-safe: parallel points end concurrently)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.began = total, 0, time.time()
        self._lock = threading.Lock()

    def one_more(self) -> str:
        with self._lock:
            self.done += 1
            took = time.time() - self.began
            left = took / self.done * (self.total - self.done)
            return f"[{self.done}/{self.total}; {_duration(took)} so far, ETA {_duration(left)}]"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def grid_runs(study: Study, out: str | Path):
    """(runs, metrics) of the study's run directories under `out/runs`, runs that did not
    train marked (None when there are none yet)."""
    from dpresearch.analysis.quality import mark_untrained
    from dpresearch.analysis.runs import find_runs, load_metrics_many, load_summaries

    paths = find_runs([Path(out) / "runs"])
    if not paths:
        return None
    runs, metrics = load_summaries(paths), load_metrics_many(paths)
    if "case" not in runs or f"cfg.{study.lr_key}" not in runs or "cfg.seed" not in runs:
        return None
    return mark_untrained(runs, metrics), metrics


def study_horizons(study: Study, out: str | Path):
    """The selection at every horizon, from the runs under `out/runs` ([] before any ran)."""
    from dpresearch.study.select import horizons

    loaded = grid_runs(study, out)
    return [] if loaded is None else horizons(study, *loaded)


def check_tuning_seeds(study: Study) -> None:
    """A study that tunes selects on the mean over `min_tune_seeds` (default 2) or more."""
    tuned = any(len(c.settings()) > 1 for c in study.cases if c.lr_from is None)
    if tuned and len(study.selection_seeds) < study.min_tune_seeds:
        raise StudyError(
            f"{study.path.name} selects on {len(study.selection_seeds)} tuning seed(s); select "
            f"on the mean over at least {study.min_tune_seeds}: give tune_seeds (or seeds) with "
            f"{study.min_tune_seeds} or more"
        )


def run_study(
    study: Study,
    out: str | Path,
    *,
    launcher: str | Runner = "local",
    jobs: int = 1,
    hydra_launcher: str | None = None,
    only: Sequence[str] | None = None,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
    start_until: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Run every point not yet done; return `status.json`'s point records (see module doc).
    `start_until` (a `time.time()` value): no point starts after it (for a time-limited
    allocation: the points started finish, the rest wait for the next `run_study`).

    The protocol: the grid on the tuning seeds; while a case's pick (at any horizon the study
    states) is an edge of the lrs it tried and its bound is not reached, one more grid step
    beyond that edge; then the final seeds at every selected lr (see `study.select`)."""
    from dpresearch.study.check import check_study
    from dpresearch.study.select import chosen_lrs, extensions

    check_study(study)  # every case composes and passes the checks: a dry run too
    if not dry_run:
        check_tuning_seeds(study)
    out = Path(out).resolve()
    run = dict(
        launcher=launcher,
        jobs=jobs,
        hydra_launcher=hydra_launcher,
        dry_run=dry_run,
        log=log,
        start_until=start_until,
    )
    grid = study.points(only)
    records = _run_points(study, out, grid, **run)
    # status.json may also hold points of an earlier version of the study (a grid since
    # changed): only this grid's points gate the extensions
    if not dry_run and not all(records.get(p.id, {}).get("status") in DONE for p in grid):
        log("== some grid points did not finish; the extensions and final seeds wait for them")
        return records
    wanted = {c.name for c in study._cases(only)}
    wanted |= {c.lr_from for c in study.cases if c.name in wanted and c.lr_from}
    while True:
        found = study_horizons(study, out)
        grow = {case: new for case, new in extensions(study, found).items() if case in wanted}
        new = [
            study.point(study.case(case), setting, seed)
            for case, settings in grow.items()
            for setting in settings
            for seed in study.selection_seeds
        ]
        if not new:
            break
        for case, settings in grow.items():
            why = (
                "the pick is at an edge of its grid"
                if any(case in h.picks for h in found)
                else "no lr tried can be picked (every one failed)"
            )
            shown = [study.point(study.case(case), s, 0).tuned for s in settings]
            log(f"== {case}: {why}; adding " + ", ".join(shown))
        if dry_run:
            log("== (dry run: the extensions and final seeds depend on those runs' results)")
            return records
        records = {**records, **_run_points(study, out, new, **run)}
        if not all(records.get(p.id, {}).get("status") in DONE for p in new):
            log("== some grid extensions did not finish; the final seeds wait for them")
            return records
    lrs = chosen_lrs(found)
    final = study.final_points(lrs, only)
    unselected = sorted(c for c in wanted if not study.case(c).lr_from and c not in lrs)
    if dry_run:
        log(
            f"== then the final seeds at each case's selected lr(s): {len(final)} points"
            + (f" ({len(unselected)} cases not selectable yet)" if unselected else "")
        )
    elif unselected:
        log(f"== no lr could be selected for {', '.join(unselected)}: their final seeds wait")
    if final:
        records = {**records, **_run_points(study, out, final, **run)}
    return records


def _run_points(
    study: Study,
    out: Path,
    points: list[Point],
    *,
    launcher: str | Runner,
    jobs: int,
    hydra_launcher: str | None,
    dry_run: bool,
    log: Callable[[str], None],
    start_until: float | None = None,
) -> dict[str, dict[str, Any]]:
    states = plan(study, out, points=points)
    running = [p.id for p, state in states if state == "running"]
    if running:
        raise StudyError(
            f"{running[0]} is still being run by another study process (status.json); "
            "wait for it or stop it first"
        )
    if dry_run:
        log(f"== study {study.name}: {len(states)} points")
        by_case: dict[str, dict[str, int]] = {}
        lrs: dict[str, set[float]] = {}
        for point, state in states:
            counts = by_case.setdefault(point.case, {})
            counts[state] = counts.get(state, 0) + 1
            lrs.setdefault(point.case, set()).add(point.lr)
        for case, counts in by_case.items():
            tried = ", ".join(f"{lr:g}" for lr in sorted(lrs[case]))
            log(f"   {case}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                + f" (lrs {tried})")  # fmt: skip
        return {
            p.id: {"case": p.case, "lr": p.lr, "seed": p.seed, "status": state}
            for p, state in states
        }
    (out / "runs").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(study.path, out / "study.yaml")
    book = StatusBook(out / "status.json", study)
    todo: list[Point] = []
    for point, state in states:
        run_dir = out / point.dir
        if state in DONE:
            book.update(point, status=state)
            continue
        if state != "missing":
            aside = _set_aside(run_dir, out)
            book.update(
                point,
                status="pending",
                aborted=[*book.get(point).get("aborted", []), str(aside.relative_to(out))],
            )
            log(f"== {point.id}: an earlier attempt ({state}) moved to {aside.relative_to(out)}")
        todo.append(point)
    log(f"== study {study.name}: {len(states) - len(todo)} points done, {len(todo)} to run")
    if not todo:
        return book.data["points"]
    tally = _Tally(len(todo))

    def start(point: Point) -> Path:
        run_dir = out / point.dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / POINT_FILE).write_text(
            json.dumps(
                {
                    "study": study.name,
                    "case": point.case,
                    "lr": point.lr,
                    **({"also": dict(point.also)} if point.also else {}),
                    "seed": point.seed,
                    "point": point.id,
                    "overrides": list(point.overrides),
                },
                indent=1,
            )
            + "\n"
        )
        book.update(
            point,
            status="running",
            pid=os.getpid(),
            started=time.time(),
            attempts=book.get(point).get("attempts", 0) + 1,
        )
        return run_dir

    def finish(point: Point, returncode: int, began: float) -> None:
        state = point_state(out / point.dir)
        status = state if state in DONE else ("failed" if returncode else state)
        book.update(
            point,
            status=status,
            returncode=returncode,
            pid=None,
            seconds=round(time.time() - began, 1),
        )
        log(
            f"== {point.id}: {status}"
            + (f" (exit {returncode})" if returncode else "")
            + f" in {time.time() - began:.0f} s {tally.one_more()}"
        )

    if launcher == "hydra":
        groups: dict[tuple[str, tuple[float, ...]], list[Point]] = {}
        for point in todo:
            groups.setdefault((point.case, point.setting), []).append(point)
        for group in groups.values():
            began = time.time()
            for point in group:
                start(point)
            rc = _hydra_group(study, group, out, hydra_launcher)
            for point in group:
                finish(point, rc, began)
        return book.data["points"]

    runner: Runner = (
        {"local": run_local, "inprocess": run_inprocess}.get(launcher, launcher)
        if isinstance(launcher, str)
        else launcher
    )  # type: ignore[arg-type]
    if isinstance(runner, str):
        raise StudyError(f"launcher {launcher!r}: choose local, hydra or inprocess")
    if runner is run_local and jobs > 1:
        runner = functools.partial(run_local, jobs=jobs)

    def one(point: Point) -> None:
        if start_until is not None and time.time() > start_until:
            return  # past the start deadline: left for the next run of the study
        began = time.time()
        run_dir = start(point)
        log(f"== {point.id}: running")
        try:
            rc = runner(point, run_dir, _point_overrides(study, point))
        except Exception as exc:
            book.update(point, error=f"{type(exc).__name__}: {exc}")
            rc = 1
        finish(point, rc, began)

    if jobs <= 1 or runner is run_inprocess:
        for point in todo:
            one(point)
    else:
        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(one, todo))
    return book.data["points"]


def summarize(records: dict[str, dict[str, Any]]) -> str:
    """One line: how many points are in each status."""
    counts: dict[str, int] = {}
    for record in records.values():
        counts[record.get("status", "?")] = counts.get(record.get("status", "?"), 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
