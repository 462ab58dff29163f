"""A study: a YAML file naming its cases, each case's learning-rate grid, seeds, the selection
metric, the claim it tests and where its run data is shipped; expanded into points
(case × lr × seed).

    name: compression_subset             # W&B group of every point; the runs folder's name
    title: Compressors at tuned lr — ResNet-20, CIFAR-10 subset
    description: ResNet-20 on the CIFAR-10 subset, K = 4
    common: [experiment=resnet20_cifar10_subset, "data.root={repo}/../shared/data/cifar10-subset"]
    lrs: {from: 0.01, to: 0.3, per_decade: 2}   # log-spaced: 0.01, 0.032, 0.1, 0.32 (or a list)
    extend: 3                            # steps the grid may grow beyond an edge pick
    lr_range: [1.0e-4, 10]               # ... and never outside this range
    lr_key: optimizer.lr                 # the override the grid sets
    seeds: [0, 1, 2, 3]
    tune_seeds: [0, 1]                   # the grid runs on these (≥ 2); the other seeds (the
                                         # final seeds) at the selected lr only
    select: val/acc:max                  # null: validation metric, else final training loss
    target: {metric: test/acc, value: 0.6}
    network: 1gbe                        # modeled seconds in the report (a list: each one;
                                         # `metrics: [comm/modeled_s@wan_100mbit]` tabulates)
    published: {file: published.csv}    # published numbers with their sources (own table)
    claim:                               # what the study tests, judged at each horizon
      statement: error feedback recovers top-k's accuracy
      metric: test/acc
      horizons: [3, 10, 30]              # epochs; the runs' own length when omitted
      horizon_key: epoch                 # or time/simulated_s, time/modeled_s: horizons in
                                         # simulated / modeled wall-clock seconds
                                         # (time/modeled_s@<name>: a train.time_scenarios clock)
      window: 0.2                        # metrics: mean over the last fifth of each horizon
      expect:
        - {better: top-k 1% + EF, than: top-k 1% (no EF)}
        - {case: top-k 1% + EF, within: 0.02, of: none}
    curves: [gossip/consensus_distance]  # logged columns shipped beside the default ones
    metrics: [test/acc_local_min]        # final metrics shown beside test/acc and train/loss
    labels: {test/loss: "f(x) (squared target units)"}   # axis labels the defaults lack
    histograms: [async/tau_histogram]    # summary histograms plotted per case
    cases:
      identity: [compressor=identity]    # a list of overrides ...
      top-k 1% + EF:                     # ... or a mapping with its own grid
        overrides: [compressor=topk, compressor.ratio=0.01, error_feedback=ef14]
        lrs: [0.1, 0.03, 0.01]
      top-k, other data:                 # no grid of its own: the lr the named case selects
        overrides: [compressor=topk, data.partition=dirichlet]
        lr_from: top-k 1% + EF

A second key tuned per case beside the lr (`tune_also`: e.g. the outer lr or DiLoCo's H) makes
each case's grid two-dimensional — every lr × every value of that key:

    tune_also: {key: outer.optimizer.lr, values: [0.35, 0.7, 1.4], extend: 3, range: [0.1, 2]}
    cases:
      diloco: [algorithm=local_sgd, outer=nesterov]     # tunes both keys
      sync: {overrides: [], tune_also: null}             # the key does not apply: the lr alone
      diloco H=100: {overrides: [...], tune_also: {values: [0.5, 1.0]}}   # its own values

A joint grid, not one key after the other: the inner and outer lrs of DiLoCo interact (the
outer step scales what the inner steps moved), so the best outer lr at a poor inner lr need not
be the best at the good one, and a staged search can stop at a pick that is interior on each
key alone but not the joint optimum. Each key grows past its edges as the lr does (one more
value beyond the edge where the joint pick is the smallest or largest value of that key tried,
crossed with every value tried of the other key, until the pick is interior on both keys or
each key's bound is reached); the final seeds run at the joint pick.

`{repo}` (the git repository holding the study file, else the dpresearch checkout) and
`{study_dir}` (the YAML's folder) are substituted in overrides. A case may not set the lr key
or `seed` itself (the grid and `seeds` do). Every problem is one `StudyError` line.

Protocol (`launcher.run_study`): the grid on the tuning seeds; wherever a case's selection (at
any horizon) is the smallest or largest lr it tried, one more grid step beyond that edge, again
until the pick is interior or the bound (`extend` steps, `lr_range`) is reached; then the final
seeds at each case's selected lr(s). The report selects on the tuning seeds and reports the
final seeds, never mixing the two.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dpresearch import SOURCE_ROOT

KEYS = {
    "name",
    "description",
    "common",
    "lrs",
    "lr_key",
    "seeds",
    "tune_seeds",
    "select",
    "target",
    "network",
    "published",
    "cases",
    "title",
    "extend",
    "lr_range",
    "claim",
    "run_data",
    "results",
    "curves",
    "metrics",
    "min_tune_seeds",
    "labels",
    "histograms",
    "tune_also",
}
CASE_KEYS = {"overrides", "lrs", "extend", "lr_range", "lr_from", "tune_also"}
ALSO_KEYS = {"key", "values", "extend", "range"}  # a `tune_also` block
DEFAULT_EXTEND = 3
LOG_SPACING = 1.25  # neighbouring ratios of a list grid may differ by this factor at most


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


def round_lr(value: float) -> float:
    """An lr as a grid shows it: two significant digits (0.0316 → 0.032)."""
    return float(f"{value:.2g}")


@dataclass(frozen=True)
class Grid:
    """A log-spaced lr grid and how far it may grow: `ratio` between neighbours, at most
    `extend` more values beyond either edge, never outside `bounds`."""

    values: tuple[float, ...]  # in the order given (points run in it)
    ratio: float
    extend: int = DEFAULT_EXTEND
    bounds: tuple[float, float] = (0.0, math.inf)

    def step(self, lr: float, up: bool) -> float:
        """The grid value one step above (`up`) or below `lr`."""
        return round_lr(lr * self.ratio if up else lr / self.ratio)

    def next_beyond(self, tried: Sequence[float], up: bool) -> float | None:
        """The value one step beyond the largest (`up`) or smallest of `tried`, or None when
        the bound is reached (`extend` steps beyond the initial grid, or `bounds`)."""
        edge = max(tried) if up else min(tried)
        beyond = [v for v in tried if (v > max(self.values) if up else v < min(self.values))]
        if self.ratio <= 1 or len(beyond) >= self.extend:
            return None
        value = self.step(edge, up)
        return value if self.bounds[0] <= value <= self.bounds[1] else None

    def describe(self) -> str:
        if self.extend == 0:
            return "no extension allowed: extend 0"
        lo, hi = self.bounds
        bound = f"{self.extend} step(s) of ×{self.ratio:.3g} beyond the initial grid"
        if lo > 0 or hi < math.inf:
            bound += f", within [{lo:g}, {hi:g}]"
        return bound


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]
    grid: Grid
    lr_from: str | None = None  # no grid of its own: the lr(s) this case selects
    also: tuple[tuple[str, Grid], ...] = ()  # the other keys it tunes (`tune_also`), each's grid

    @property
    def lrs(self) -> tuple[float, ...]:
        return self.grid.values

    def settings(self) -> list[tuple[float, ...]]:
        """Every (lr, value of each `also` key) of the initial grid, lr by lr."""
        return list(itertools.product(self.lrs, *(grid.values for _, grid in self.also)))


@dataclass(frozen=True)
class Expectation:
    """`case` beats `other` on the claim's metric (`within` None), or `case` is no worse than
    `other` by more than `within`."""

    case: str
    other: str
    within: float | None = None

    def describe(self, metric: str) -> str:
        if self.within is None:
            return f"{self.case} > {self.other}"
        return f"{self.case} within {self.within:g} of {self.other}"


@dataclass(frozen=True)
class Claim:
    statement: str
    metric: str = "test/acc"
    horizons: tuple[float, ...] = ()  # in `horizon_key` units; () = the runs' own length
    expect: tuple[Expectation, ...] = ()
    horizon_key: str = "epoch"  # or e.g. time/simulated_s
    window: float = 0.0  # > 0: metrics averaged over this last fraction of each horizon


@dataclass(frozen=True)
class Point:
    """One run of the study: `dir` is relative to the study's output folder. `also`: the
    value of each other key the case tunes (`tune_also`), as (key, value)."""

    case: str
    lr: float
    seed: int
    overrides: tuple[str, ...]
    also: tuple[tuple[str, float], ...] = ()

    @property
    def setting(self) -> tuple[float, ...]:
        """The tuned values: (lr, each `also` key's)."""
        return (self.lr, *(v for _, v in self.also))

    @property
    def dir(self) -> Path:
        tuned = [f"lr{self.lr:g}", *(f"{slug(k)}{v:g}" for k, v in self.also)]
        return Path("runs", slug(self.case), *tuned, f"seed{self.seed}")

    @property
    def tuned(self) -> str:
        """The tuned values as shown: `lr 0.1`, `lr 0.1 | outer.optimizer.lr 0.7`."""
        return " | ".join([f"lr {self.lr:g}", *(f"{k} {v:g}" for k, v in self.also)])

    @property
    def id(self) -> str:
        return f"{self.case} | {self.tuned} | seed {self.seed}"


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
    networks: tuple[str, ...] = ()  # presets the report re-prices modeled time on
    published: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    title: str = ""
    tune_seeds: tuple[int, ...] | None = None
    claim: Claim | None = None
    run_data: Path | None = None  # the shipped run data (default: beside the YAML)
    results: Path | None = None  # the report's folder (default: <study dir>/results)
    curves: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    histograms: tuple[str, ...] = ()
    min_tune_seeds: int = 2

    @property
    def selection_seeds(self) -> tuple[int, ...]:
        """The seeds every lr of the grid runs on (and the selection reads)."""
        return self.tune_seeds if self.tune_seeds is not None else self.seeds

    @property
    def final_seeds(self) -> tuple[int, ...]:
        """The seeds run at the selected lr only (what the results table reports)."""
        return tuple(s for s in self.seeds if s not in self.selection_seeds)

    @property
    def data_path(self) -> Path:
        return self.run_data or self.path.with_name(f"{self.path.stem}.rundata.jsonl.gz")

    @property
    def results_dir(self) -> Path:
        return self.results or self.path.parent / "results"

    def case(self, name: str) -> Case:
        return next(c for c in self.cases if c.name == name)

    @property
    def also_keys(self) -> tuple[str, ...]:
        """The keys some case tunes beside the lr (`tune_also`), in the order first given."""
        return tuple(dict.fromkeys(key for case in self.cases for key, _ in case.also))

    def points(self, only: Sequence[str] | None = None) -> list[Point]:
        """The initial grid: every tuned case, setting by setting (lr by lr; with `tune_also`
        every lr × every value of the other key), on the selection seeds (`only`: these
        cases)."""
        return [
            self.point(case, setting, seed)
            for case in self._cases(only)
            if case.lr_from is None
            for setting in case.settings()
            for seed in self.selection_seeds
        ]

    def final_points(
        self, lrs: dict[str, Sequence[float | tuple[float, ...]]], only: Sequence[str] | None = None
    ) -> list[Point]:
        """The final seeds of each case at each of its selected settings `lrs[case]` (an lr,
        or (lr, each `also` key's value)); a case reusing another's lr: at that case's (its
        whole setting); a case missing from `lrs` has none. A study without final seeds runs
        its lr_from cases on the tuning seeds."""
        out = []
        for case in self._cases(only):
            chosen = lrs.get(case.lr_from or case.name, ())
            seeds = self.final_seeds or (self.selection_seeds if case.lr_from else ())
            out += [
                self.point(case, setting, seed) for setting in sorted(set(chosen)) for seed in seeds
            ]
        return out

    def point(self, case: Case, setting: float | Sequence[float], seed: int) -> Point:
        """The point of `case` at `setting` (the lr, or (lr, each `also` key's value): a case
        reusing another's lr takes that case's keys) and `seed`."""
        lr, *values = setting if isinstance(setting, Sequence) else (setting,)
        keys = [key for key, _ in self.case(case.lr_from).also] if case.lr_from else []
        also = tuple(zip(keys or [key for key, _ in case.also], values, strict=True))
        grid = (f"{self.lr_key}={lr!r}", *(f"{k}={v!r}" for k, v in also), f"seed={seed}")
        return Point(case.name, lr, seed, (*self.common, *case.overrides, *grid), also)

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
    if any("{repo}" in v for v in value):
        repo = str(repository_of(study_dir))
        value = [v.replace("{repo}", repo) for v in value]
    return tuple(v.replace("{study_dir}", str(study_dir)) for v in value)


def repository_of(study_dir: Path) -> Path:
    """What `{repo}` stands for: the git repository holding `study_dir` (a study kept in the
    user's own repository, or a shipped one in this checkout), else the dpresearch source
    checkout; raises `StudyError` when there is neither (an installed wheel, a study file
    outside any repository)."""
    for folder in (study_dir.resolve(), *study_dir.resolve().parents):
        if (folder / ".git").exists():
            return folder
    if SOURCE_ROOT is not None:
        return SOURCE_ROOT
    raise StudyError(
        f"{{repo}} in the study in {study_dir} stands for the git repository holding it, and "
        "there is none; write the path out, or use {study_dir} (the study file's folder)"
    )


def _positive(value: Any, what: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = math.nan
    if not out > 0 or math.isinf(out):
        raise StudyError(f"{what} must hold positive numbers, got {value!r}")
    return out


def grid_values(value: Any, what: str) -> tuple[tuple[float, ...], float]:
    """(values, ratio between neighbours) of a grid given as a list (its order kept) or as
    `{from, to, per_decade}` (the values 10^(k/per_decade), two significant digits, that lie
    in [from, to] as written); a list must be log-spaced."""
    if isinstance(value, dict):
        if set(value) != {"from", "to", "per_decade"}:
            raise StudyError(f"{what}: give a list, or {{from, to, per_decade}}, got {value!r}")
        lo, hi = _positive(value["from"], what), _positive(value["to"], what)
        n = value["per_decade"]
        if not isinstance(n, int) or n < 1 or lo > hi:
            raise StudyError(f"{what}: per_decade must be an integer ≥ 1 and from ≤ to")
        # Bounds compare with the values as written (two digits): `from: 0.032` is the grid's
        # 0.032, though 10^-1.5 = 0.0316 lies below it.
        first, last = math.floor(math.log10(lo) * n) - 1, math.ceil(math.log10(hi) * n) + 1
        written = (round_lr(10 ** (k / n)) for k in range(first, last + 1))
        values = tuple(v for v in written if lo <= v <= hi)
        if not values:
            raise StudyError(f"{what}: no grid value lies in [{lo:g}, {hi:g}]")
        for line in dropped_by_bounds(lo, hi, n, what):
            print(f"warning: {line}", file=sys.stderr)
        return values, 10 ** (1 / n)
    if not isinstance(value, list) or not value:
        raise StudyError(f"{what} must be a non-empty list of numbers, got {value!r}")
    values = tuple(dict.fromkeys(_positive(v, what) for v in value))
    if len(values) < 2:
        return values, 1.0
    ordered = sorted(values)
    ratios = [b / a for a, b in zip(ordered, ordered[1:], strict=False)]
    if max(ratios) / min(ratios) > LOG_SPACING:
        raise StudyError(
            f"{what} {list(values)} is not log-spaced (neighbours' ratios "
            f"{', '.join(f'{r:.3g}' for r in ratios)}); use e.g. {{from: {ordered[0]:g}, "
            f"to: {ordered[-1]:g}, per_decade: 2}}"
        )
    return values, (ordered[-1] / ordered[0]) ** (1 / (len(values) - 1))


def dropped_by_bounds(lo: float, hi: float, per_decade: int, what: str) -> list[str]:
    """A line per bound of `{from: lo, to: hi, per_decade}` whose nearest grid value (as
    written, two digits) lies outside [lo, hi] and is so left out: `to: 0.3` drops 0.32, which
    its writer likely meant to try."""
    lines = []
    for bound, name, outside in ((lo, "from", lambda v: v < lo), (hi, "to", lambda v: v > hi)):
        nearest = round_lr(10 ** (round(math.log10(bound) * per_decade) / per_decade))
        if outside(nearest):
            lines.append(
                f"{what}: {name}: {bound:g} is not a grid value (10^(k/{per_decade})); the "
                f"nearest, {nearest:g}, lies {'below' if name == 'from' else 'above'} it and is "
                f"left out: write {name}: {nearest:g} to try it"
            )
    return lines


def _grid(body: dict, default: dict, what: str, names=("lrs", "extend", "lr_range")) -> Grid:
    """The grid of `body`'s keys `names` (values, extend, range; those missing from
    `default`)."""
    values_key, extend_key, range_key = names
    raw = body.get(values_key, default.get(values_key))
    if raw is None:
        raise StudyError(f"{what} has no {values_key} and the study gives no default {values_key}")
    values, ratio = grid_values(raw, f"{what} {values_key}")
    extend = body.get(extend_key, default.get(extend_key, DEFAULT_EXTEND))
    if not isinstance(extend, int) or extend < 0:
        raise StudyError(f"{what}: {extend_key} must be an integer ≥ 0, got {extend!r}")
    bounds = body.get(range_key, default.get(range_key))
    if bounds is None:
        bounds = (0.0, math.inf)
    elif not isinstance(bounds, list) or len(bounds) != 2:
        raise StudyError(f"{what}: {range_key} must be [low, high], got {bounds!r}")
    else:
        bounds = (_positive(bounds[0], range_key), _positive(bounds[1], range_key))
    return Grid(values, ratio, extend, bounds)


def _also(raw: Any, default: dict, what: str) -> tuple[tuple[str, Grid], ...]:
    """A case's `tune_also` (its own block over the study's; null: none) as (key, grid)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or set(raw) - ALSO_KEYS:
        raise StudyError(
            f"{what} tune_also must be a mapping with {', '.join(sorted(ALSO_KEYS))} (or null), "
            f"got {raw!r}"
        )
    body = {**default, **raw}
    if "key" not in body:
        raise StudyError(f"{what} tune_also needs the key it tunes, e.g. key: outer.optimizer.lr")
    study_extend = {"extend": default["study_extend"]} if "study_extend" in default else {}
    grid = _grid(body, study_extend, f"{what} tune_also", ("values", "extend", "range"))
    return ((str(body["key"]), grid),)


def _case(
    name: str, body: Any, default: dict, lr_key: str, study_dir: Path, also: dict | None = None
) -> Case:
    """One case (`also`: the study's `tune_also` block, which a case's own block overrides
    key by key, or turns off with null)."""
    if isinstance(body, list) or body is None:
        body = {"overrides": body or []}
    if not isinstance(body, dict) or set(body) - CASE_KEYS:
        raise StudyError(
            f"case {name!r}: give a list of overrides or a mapping with "
            f"{', '.join(sorted(CASE_KEYS))}"
        )
    overrides = _strings(body.get("overrides"), f"case {name!r} overrides", study_dir)
    lr_from = body.get("lr_from")
    tuned = (
        ()
        if lr_from is not None
        else _also(
            body.get("tune_also", {}) if also is not None else body.get("tune_also"),
            {**(also or {}), "study_extend": default.get("extend", DEFAULT_EXTEND)},
            f"case {name!r}",
        )
    )
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key in (lr_key, "seed", *(k for k, _ in tuned)) or key.startswith("hydra."):
            raise StudyError(
                f"case {name!r} sets {key}; the study sets it (lrs, tune_also, seeds, and the "
                "run directory)"
            )
    if lr_from is not None:
        if "lrs" in body or "tune_also" in body:
            raise StudyError(f"case {name!r}: give lrs (and tune_also) or lr_from, not both")
        return Case(str(name), overrides, Grid((), 1.0, 0), str(lr_from))
    return Case(str(name), overrides, _grid(body, default, f"case {name!r}"), also=tuned)


def _claim(raw: Any, cases: set[str]) -> Claim | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or "statement" not in raw:
        raise StudyError("claim needs a `statement` (and optionally metric, horizons, expect)")
    unknown = set(raw) - {"statement", "metric", "horizons", "expect", "horizon_key", "window"}
    if unknown:
        raise StudyError(f"claim: unknown key {', '.join(sorted(unknown))}")
    horizons = tuple(_positive(h, "claim horizons") for h in raw.get("horizons") or ())
    expect = []
    for item in raw.get("expect") or ():
        if isinstance(item, dict) and set(item) == {"better", "than"}:
            expect.append(Expectation(str(item["better"]), str(item["than"])))
        elif isinstance(item, dict) and set(item) == {"case", "within", "of"}:
            expect.append(Expectation(str(item["case"]), str(item["of"]), float(item["within"])))
        else:
            raise StudyError(
                "claim expect: each item is {better: A, than: B} or {case: A, within: 0.03, "
                f"of: B}}, got {item!r}"
            )
    for e in expect:
        for name in (e.case, e.other):
            if name not in cases:
                raise StudyError(f"claim names case {name!r}, which the study does not have")
    window = raw.get("window", 0.0)
    if not isinstance(window, int | float) or not 0 <= window < 1:
        raise StudyError(f"claim window must be a fraction in [0, 1), got {window!r}")
    return Claim(
        str(raw["statement"]),
        str(raw.get("metric", "test/acc")),
        horizons,
        tuple(expect),
        str(raw.get("horizon_key", "epoch")),
        float(window),
    )


def _path(raw: Any, base: Path) -> Path | None:
    return None if raw is None else (base / str(raw)).resolve()


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
    default = {k: raw[k] for k in ("lrs", "extend", "lr_range") if k in raw}
    also = raw.get("tune_also")
    if also is not None and (
        not isinstance(also, dict) or "key" not in also or set(also) - ALSO_KEYS
    ):
        raise StudyError(
            f"tune_also must be a mapping of {', '.join(sorted(ALSO_KEYS))} naming its key "
            f"and values, e.g. {{key: "
            f"outer.optimizer.lr, values: [0.35, 0.7, 1.4]}}, got {also!r}"
        )
    if also is not None and str(also["key"]) in (lr_key, "seed"):
        raise StudyError(f"tune_also key {also['key']}: the lr and the seed are tuned already")
    cases = tuple(
        _case(str(n), b, default, lr_key, path.parent, also) for n, b in cases_raw.items()
    )
    names = {c.name for c in cases}
    slugs: dict[str, str] = {}
    for case in cases:
        other = slugs.setdefault(slug(case.name), case.name)
        if other != case.name:
            raise StudyError(
                f"cases {other!r} and {case.name!r} share the folder "
                f"{slug(case.name)!r}; rename one"
            )
        if case.lr_from is not None:
            source = next((c for c in cases if c.name == case.lr_from), None)
            if source is None or source.lr_from is not None:
                raise StudyError(
                    f"case {case.name!r}: lr_from {case.lr_from!r} must name a case with its "
                    "own grid"
                )
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise StudyError(f"seeds must be a non-empty list of integers, got {seeds!r}")
    tune_seeds = raw.get("tune_seeds")
    if tune_seeds is not None and (
        not isinstance(tune_seeds, list) or not tune_seeds or not set(tune_seeds) <= set(seeds)
    ):
        raise StudyError(
            f"tune_seeds must be a non-empty list of some of seeds {seeds}, got {tune_seeds!r}"
        )
    target = raw.get("target") or {}
    if not isinstance(target, dict) or set(target) - {"metric", "value"}:
        raise StudyError("target must be a mapping {metric: test/acc, value: 0.6}")
    published = raw.get("published") or {}
    if published and "file" not in published:
        raise StudyError("published needs `file` (a CSV beside the study file)")
    networks = raw.get("network") or []
    networks = [networks] if isinstance(networks, str) else networks
    if not isinstance(networks, list) or not all(isinstance(n, str) for n in networks):
        raise StudyError(f"network must be a preset name or a list of them, got {networks!r}")
    curves, metrics = raw.get("curves") or [], raw.get("metrics") or []
    histograms = raw.get("histograms") or []
    for what, value in (("curves", curves), ("metrics", metrics), ("histograms", histograms)):
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise StudyError(f"{what} must be a list of logged metric names, got {value!r}")
    labels = raw.get("labels") or {}
    if not isinstance(labels, dict):
        raise StudyError(f"labels must map metric names to axis labels, got {labels!r}")
    min_tune = raw.get("min_tune_seeds", 2)
    if not isinstance(min_tune, int) or min_tune < 1:
        raise StudyError(f"min_tune_seeds must be an integer ≥ 1, got {min_tune!r}")
    name = str(raw.get("name") or path.stem)
    return Study(
        name=name,
        path=path,
        cases=cases,
        seeds=tuple(seeds),
        common=_strings(raw.get("common"), "common", path.parent),
        lr_key=lr_key,
        select=raw.get("select"),
        target_metric=str(target.get("metric", "test/acc")),
        target=float(target["value"]) if "value" in target else None,
        networks=tuple(networks),
        published=dict(published),
        description=str(raw.get("description", "")),
        title=str(raw.get("title", name)),
        tune_seeds=tuple(tune_seeds) if tune_seeds is not None else None,
        claim=_claim(raw.get("claim"), names),
        run_data=_path(raw.get("run_data"), path.parent),
        results=_path(raw.get("results"), path.parent),
        curves=tuple(curves),
        metrics=tuple(metrics),
        labels={str(k): str(v) for k, v in labels.items()},
        histograms=tuple(histograms),
        min_tune_seeds=min_tune,
    )
