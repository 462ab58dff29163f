"""Studies: a YAML of cases × lr grid × seeds, launched resumably, reported by the analysis.

    python -m dpresearch.study run experiments/compression_subset/study.yaml --jobs 2
    python -m dpresearch.study status experiments/compression_subset/study.yaml
    python -m dpresearch.study report experiments/compression_subset/study.yaml

`spec` reads the YAML, `launcher` runs the points (skipping finished ones, recording each
point's status), `report` writes results.md through `dpresearch.analysis`.
"""

from dpresearch.study.launcher import point_state, run_study
from dpresearch.study.spec import Case, Point, Study, StudyError, load_study

__all__ = ["Case", "Point", "Study", "StudyError", "load_study", "point_state", "run_study"]
