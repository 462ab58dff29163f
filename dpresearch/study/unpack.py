"""A shipped study's run data back as run directories, so a study grows without re-running it.

`python -m dpresearch.study unpack STUDY.yaml [--out DIR]` writes every run of the study's
`*.rundata.jsonl.gz` into `DIR/runs/...` as the run itself would have left it for the study
tools: `config.yaml`, `summary.json`, `study_point.json`, the config-group choices
(`.hydra/hydra.yaml`) and `metrics.jsonl` with the curves the run data keeps. `run` then
starts only the points that are not there (more final seeds, a grid grown past an edge), and
`report` packs the old runs into the same records they came from (tested: unpacking and packing
again gives the records back unchanged), beside the new ones.

The run data keeps only the curves the reports read (`rundata.CURVES` and the study's own),
rounded to 7 significant digits: an unpacked run is a result for the study's tables and plots,
not a run to resume training from (it has no checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpresearch.analysis.runs import POINT_FILE
from dpresearch.study.spec import Study, StudyError


def _choices_yaml(choices: dict[str, str]) -> str:
    # The block `analysis.runs.read_choices` scans (`hydra.runtime.choices`), as Hydra writes it.
    lines = ["hydra:", "  runtime:", "    choices:"]
    lines += [f"      {key}: {value if value != '' else 'null'}" for key, value in choices.items()]
    return "\n".join(lines) + "\n"


def _metric_lines(curves: dict[str, list[Any]]) -> str:
    rows = max((len(values) for values in curves.values()), default=0)
    lines = []
    for i in range(rows):
        row = {k: values[i] for k, values in curves.items() if values[i] is not None}
        lines.append(json.dumps(row))
    return "".join(line + "\n" for line in lines)


def _point_record(study: Study, record: dict[str, Any]) -> dict[str, Any]:
    point = dict(record.get("point") or {})
    case = next((c for c in study.cases if c.name == point.get("case")), None)
    if case is not None and "lr" in point and "seed" in point:
        # The packer drops the overrides (the config holds them); a case the study still has
        # gets them back as the launcher would have written them.
        setting = (point["lr"], *(point.get("also") or {}).values())
        point["overrides"] = list(study.point(case, setting, point["seed"]).overrides)
    return point


def unpack_study(study: Study, out: str | Path) -> int:
    """Write the study's run data as run directories under `out/runs`; return how many.
    `out/runs` must not hold runs yet (a StudyError says so): unpacked runs never overwrite or
    mix with runs on disk."""
    from omegaconf import OmegaConf

    from dpresearch.analysis.rundata import read_rundata
    from dpresearch.analysis.runs import find_runs

    out = Path(out)
    if (out / "runs").exists() and find_runs([out / "runs"]):
        raise StudyError(
            f"{out / 'runs'} already holds runs; unpack into an empty folder (--out DIR)"
        )
    if not study.data_path.exists():
        raise StudyError(f"no shipped run data {study.data_path}; nothing to unpack")
    _, records = read_rundata(study.data_path)
    for record in records:
        label = Path(record["run"])
        if label.is_absolute() or ".." in label.parts:
            raise StudyError(f"{study.data_path.name}: run label {record['run']!r} leaves --out")
        run_dir = out / label
        (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(record.get("config") or {}))
        if record.get("summary") is not None:
            (run_dir / "summary.json").write_text(json.dumps(record["summary"], indent=1) + "\n")
        (run_dir / POINT_FILE).write_text(json.dumps(_point_record(study, record), indent=1) + "\n")
        (run_dir / ".hydra" / "hydra.yaml").write_text(_choices_yaml(record.get("choices") or {}))
        (run_dir / "metrics.jsonl").write_text(_metric_lines(record.get("curves") or {}))
    return len(records)
