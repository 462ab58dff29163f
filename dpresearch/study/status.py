"""`study status` counts: where a study's runs stand, by the part of the protocol they belong to.

Every run is a point (case, lr, seed) and belongs to one part: the tuning **grid** (a case's
own lrs on the selection seeds), a grid **extension** (an lr beyond the grid, added on the
selection seeds where the pick was at an edge) or the **final seeds** (the other seeds, at the
selected lr). `tally` counts runs by case, part and status; the runs are read from run
directories (`study_point.json` in each, as the launcher writes them) or, for a shipped study
with no run directories, from its packed run data (`<study>.rundata.jsonl.gz`, which `unpack`
turns back into run directories).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from dpresearch.study.spec import Study

PARTS = ("grid", "extension", "final")


def part_of(study: Study, case: str, lr: float, seed: int) -> str:
    """`grid`, `extension` or `final`: the part of the protocol the point (case, lr, seed)
    belongs to (a case reusing another's lr has no grid: its runs are final seeds)."""
    known = next((c for c in study.cases if c.name == case), None)
    if seed not in study.selection_seeds or known is None or known.lr_from:
        return "final"
    return "grid" if any(abs(lr - g) <= 1e-9 * abs(g) for g in known.lrs) else "extension"


def tally(study: Study, points: Iterable[tuple[str, float, int, str]]) -> dict[str, Counter]:
    """{case: Counter of (part, status)} over the runs `points` ((case, lr, seed, status)),
    cases in the study's order (a case the study no longer has: after them)."""
    out: dict[str, Counter] = {c.name: Counter() for c in study.cases}
    for case, lr, seed, status in points:
        out.setdefault(case, Counter())[(part_of(study, case, lr, seed), status)] += 1
    return out


def packed_points(study: Study) -> list[tuple[str, float, int, str]]:
    """(case, lr, seed, status) of every run in the study's shipped run data."""
    from dpresearch.analysis.rundata import read_rundata
    from dpresearch.analysis.runs import infer_status

    _, records = read_rundata(study.data_path)
    points = []
    for record in records:
        point = record.get("point") or {}
        if {"case", "lr", "seed"} <= point.keys():
            status = infer_status(record.get("summary"))
            points.append((point["case"], float(point["lr"]), int(point["seed"]), status))
    return points


def launched_points(out: Path) -> list[tuple[Path, dict]]:
    """(run directory, its `study_point.json` record) of every run a study launched under
    `out/runs` (none where that folder does not exist), in path order."""
    import json

    from dpresearch.analysis.runs import POINT_FILE

    runs = out / "runs"
    paths = sorted(runs.rglob(POINT_FILE)) if runs.is_dir() else []
    return [(path.parent, json.loads(path.read_text())) for path in paths]


def directory_points(out: Path) -> list[tuple[str, float, int, str]]:
    """(case, lr, seed, state) of every run directory under `out/runs` that a study launched
    (state as `launcher.point_state` reads it)."""
    from dpresearch.study.launcher import point_state

    return [
        (point["case"], float(point["lr"]), int(point["seed"]), point_state(run_dir))
        for run_dir, point in launched_points(out)
    ]


def describe(counts: dict[str, Counter]) -> list[str]:
    """The lines `study status` prints: a total per part, then one line per case."""

    def parts(counter: Counter) -> str:
        shown = []
        for part in PARTS:
            states = Counter({s: n for (p, s), n in counter.items() if p == part})
            if states:
                detail = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
                shown.append(f"{_NAMES[part]} {sum(states.values())} ({detail})")
        return "; ".join(shown) or "no runs"

    total = sum(counts.values(), Counter())
    return [f"   all cases: {parts(total)}"] + [f"   {c}: {parts(n)}" for c, n in counts.items()]


_NAMES = {"grid": "grid", "extension": "grid extensions", "final": "final seeds"}
