"""A study: a YAML file naming its cases, each case's learning-rate grid, seeds, the selection
metric and the time-to-accuracy target; expanded into points (case × lr × seed).

    name: compression_subset             # W&B group of every point; the runs folder's name
    description: ResNet-20 on the CIFAR-10 subset, K = 4
    common: [experiment=resnet20_cifar10_subset, "data.root={repo}/../shared/data/cifar10-subset"]
    lrs: [0.3, 0.1, 0.03]                # default grid
    lr_key: optimizer.lr                 # the override the grid sets
    seeds: [0, 1, 2]
    tune_seeds: [0]                      # the grid runs on these; the other seeds at the
                                         # selected lr only (omit: every seed at every lr)
    select: val/acc:max                  # null: validation metric, else final training loss
    target: {metric: test/acc, value: 0.6}
    network: 1gbe                        # modeled seconds in the report
    published: {file: published.csv, key: case, columns: [top1]}
    cases:
      identity: [compressor=identity]    # a list of overrides ...
      top-k 1% + EF:                     # ... or a mapping with its own grid
        overrides: [compressor=topk, compressor.ratio=0.01, error_feedback=ef14]
        lrs: [0.1, 0.03, 0.01]

`{repo}` (the repository root) and `{study_dir}` (the YAML's folder) are substituted in
overrides. A case may not set the lr key or `seed` itself (the grid and `seeds` do). Every
problem is one `StudyError` line.

With `tune_seeds`, a study runs in two stages: the grid on the tuning seeds (`points`), then,
once every case's lr is selected on them, the remaining seeds at that lr (`final_points`); the
report selects on the tuning seeds only, so the other seeds never influence the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KEYS = {"name", "description", "common", "lrs", "lr_key", "seeds", "tune_seeds", "select",
        "target", "network", "published", "cases", "title"}  # fmt: skip


class StudyError(ValueError):
    """A study file that cannot be run; the message is one line naming the fix."""


def slug(text: str) -> str:
    """A folder-safe name, always one folder inside its parent: lower case letters, digits,
    `.` and `-`, runs of other characters as one `_`, no leading `.` (so never `.` or `..`),
    at most 100 characters (a longer name is cut and ends with a hash of the whole)."""
    import hashlib

    out = "".join(c if c.isalnum() or c in ".-" else "_" for c in str(text).lower())
    name = "_".join(part for part in out.split("_") if part).lstrip(".") or "_"
    if len(name) > 100:
        name = name[:87] + "-" + hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:12]
    return name


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    lrs: tuple[float, ...]


@dataclass(frozen=True)
class Point:
    """One run of the study: `dir` is relative to the study's output folder."""

    case: str
    lr: float
    seed: int
    overrides: tuple[str, ...]

    @property
    def dir(self) -> Path:
        return Path("runs") / slug(self.case) / f"lr{self.lr:g}" / f"seed{self.seed}"

    @property
    def id(self) -> str:
        return f"{self.case} | lr {self.lr:g} | seed {self.seed}"


@dataclass(frozen=True)
class Study:
    name: str
    path: Path
    cases: tuple[Case, ...]
    seeds: tuple[int, ...]
    common: tuple[str, ...] = ()
    lr_key: str = "optimizer.lr"
    select: str | None = None
    target_metric: str = "test/acc"
    target: float | None = None
    network: str | None = None
    published: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    title: str = ""
    tune_seeds: tuple[int, ...] | None = None

    @property
    def selection_seeds(self) -> tuple[int, ...]:
        """The seeds every lr of the grid runs on (and the selection reads)."""
        return self.tune_seeds if self.tune_seeds is not None else self.seeds

    def points(self, only: Sequence[str] | None = None) -> list[Point]:
        """The grid: every case, lr by lr, on the selection seeds (`only`: these cases)."""
        return [
            self._point(case, lr, seed)
            for case in self._cases(only)
            for lr in case.lrs
            for seed in self.selection_seeds
        ]

    def final_points(self, lrs: dict[str, float], only: Sequence[str] | None = None) -> list[Point]:
        """The seeds not tuned on, each case at its selected lr `lrs[case]` (a case missing
        from `lrs` has none: nothing could be selected)."""
        rest = [s for s in self.seeds if s not in self.selection_seeds]
        return [
            self._point(case, lrs[case.name], seed)
            for case in self._cases(only)
            if case.name in lrs
            for seed in rest
        ]

    def _point(self, case: Case, lr: float, seed: int) -> Point:
        grid = (f"{self.lr_key}={lr!r}", f"seed={seed}")
        return Point(case.name, lr, seed, (*self.common, *case.overrides, *grid))

    def _cases(self, only: Sequence[str] | None) -> list[Case]:
        if only:
            unknown = sorted(set(only) - {c.name for c in self.cases})
            if unknown:
                raise StudyError(
                    f"no case {', '.join(map(repr, unknown))} in {self.path.name}; "
                    f"cases: {', '.join(c.name for c in self.cases)}"
                )
        return [case for case in self.cases if not only or case.name in only]


def _strings(value: Any, what: str, study_dir: Path) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise StudyError(f"{what} must be a list of override strings, got {value!r}")
    return tuple(
        v.replace("{repo}", str(REPO)).replace("{study_dir}", str(study_dir)) for v in value
    )


def _floats(value: Any, what: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not value:
        raise StudyError(f"{what} must be a non-empty list of numbers, got {value!r}")
    try:
        return tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise StudyError(f"{what} must be a non-empty list of numbers, got {value!r}") from None


def _case(
    name: str, body: Any, default_lrs: tuple[float, ...] | None, lr_key: str, study_dir: Path
) -> Case:
    if isinstance(body, list) or body is None:
        body = {"overrides": body or []}
    if not isinstance(body, dict) or set(body) - {"overrides", "lrs"}:
        raise StudyError(
            f"case {name!r}: give a list of overrides or a mapping with overrides and lrs"
        )
    overrides = _strings(body.get("overrides"), f"case {name!r} overrides", study_dir)
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key in (lr_key, "seed") or key.startswith("hydra."):
            raise StudyError(
                f"case {name!r} sets {key}; the study sets it (lrs, seeds, and the run directory)"
            )
    lrs = _floats(body["lrs"], f"case {name!r} lrs") if "lrs" in body else default_lrs
    if lrs is None:
        raise StudyError(f"case {name!r} has no lrs and the study gives no default lrs")
    return Case(str(name), overrides, lrs)


def load_study(path: str | Path) -> Study:
    """Read and check the study YAML at `path`."""
    path = Path(path).resolve()
    if not path.exists():
        raise StudyError(f"study file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise StudyError(f"{path.name} is not valid YAML: {str(exc).splitlines()[0]}") from None
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise StudyError(
            f"unknown key {', '.join(unknown)} in {path.name}; allowed: {', '.join(sorted(KEYS))}"
        )
    cases_raw = raw.get("cases")
    if not isinstance(cases_raw, dict) or not cases_raw:
        raise StudyError(f"{path.name} needs `cases`: a mapping of case name to overrides")
    lr_key = str(raw.get("lr_key", "optimizer.lr"))
    default_lrs = _floats(raw["lrs"], "lrs") if "lrs" in raw else None
    cases = tuple(_case(str(n), b, default_lrs, lr_key, path.parent) for n, b in cases_raw.items())
    slugs: dict[str, str] = {}
    for case in cases:
        other = slugs.setdefault(slug(case.name), case.name)
        if other != case.name:
            raise StudyError(
                f"cases {other!r} and {case.name!r} share the folder "
                f"{slug(case.name)!r}; rename one"
            )
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise StudyError(f"seeds must be a non-empty list of integers, got {seeds!r}")
    tune_seeds = raw.get("tune_seeds")
    if tune_seeds is not None and (
        not isinstance(tune_seeds, list) or not tune_seeds or not set(tune_seeds) <= set(seeds)
    ):
        raise StudyError(f"tune_seeds must be a non-empty list of some of seeds {seeds}, "
                         f"got {tune_seeds!r}")  # fmt: skip
    target = raw.get("target") or {}
    if not isinstance(target, dict) or set(target) - {"metric", "value"}:
        raise StudyError("target must be a mapping {metric: test/acc, value: 0.6}")
    published = raw.get("published") or {}
    if published and "file" not in published:
        raise StudyError("published needs `file` (a CSV beside the study file)")
    name = str(raw.get("name") or path.stem)
    return Study(
        name=name, path=path, cases=cases, seeds=tuple(seeds),
        common=_strings(raw.get("common"), "common", path.parent), lr_key=lr_key,
        select=raw.get("select"), target_metric=str(target.get("metric", "test/acc")),
        target=float(target["value"]) if "value" in target else None,
        network=raw.get("network"), published=dict(published),
        description=str(raw.get("description", "")), title=str(raw.get("title", name)),
        tune_seeds=tuple(tune_seeds) if tune_seeds is not None else None,
    )  # fmt: skip
