"""`study status` on a shipped study: counts the packed run data by part of the protocol (grid,
grid extensions, final seeds) and says to `unpack`; after `unpack` the same counts from the run
directories; it names no file it did not write (issue 43, item 5)."""

from __future__ import annotations

from collections import Counter

from helpers import REPO

from dpresearch.study import load_study
from dpresearch.study.__main__ import main
from dpresearch.study.status import packed_points, part_of

LM = REPO / "experiments/lm_shakespeare/study.yaml"


def test_part_of_by_hand():
    """lm_shakespeare: tuning seeds 0, 1; DiLoCo H=50's grid 2e-3, 4e-3, 8e-3; its outer-lr
    variant reuses its lr (no grid)."""
    study = load_study(LM)
    assert part_of(study, "DiLoCo H=50", 4.0e-3, 1) == "grid"
    assert part_of(study, "DiLoCo H=50", 1.6e-2, 0) == "extension"
    assert part_of(study, "DiLoCo H=50", 4.0e-3, 3) == "final"
    assert part_of(study, "DiLoCo H=50 outer lr 0.4", 4.0e-3, 0) == "final"


def test_status_of_a_shipped_study_reads_its_run_data_then_its_unpacked_runs(tmp_path, capsys):
    """The README's counts for lm_shakespeare: 130 tuning runs (96 grid, 34 extensions) and 51
    final seeds; counted again, identically, from the unpacked run directories."""
    study = load_study(LM)
    points = packed_points(study)
    parts = Counter(part_of(study, c, lr, s) for c, lr, s, _ in points)
    assert parts == {"grid": 96, "extension": 34, "final": 51}
    out = tmp_path / "lm"
    assert main(["status", str(LM), "--out", str(out)]) == 0
    shipped = capsys.readouterr().out
    assert f"its shipped run data (study.rundata.jsonl.gz) holds {len(points)} runs" in shipped
    assert "   all cases: grid 96 (6 diverged, 90 finished); grid extensions 34 (2 diverged, " \
           "32 finished); final seeds 51 (51 finished)" in shipped  # fmt: skip
    assert f"unpack {LM} --out {out}" in shipped
    assert " missing" not in shipped.replace("what is missing", "") and "status.json" not in shipped
    assert main(["unpack", str(LM), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["status", str(LM), "--out", str(out)]) == 0
    on_disk = capsys.readouterr().out
    assert not (out / "status.json").exists() and "status.json" not in on_disk
    table = shipped[shipped.index("   all cases") : shipped.index("== to add runs")]
    assert on_disk.endswith("== runs on disk, by part of the protocol:\n" + table)
