"""The README's method table ("Methods at a glance", issue 41): one row per method, each row
true to the code.

- every row's selection composes and passes the checks `python -m dpresearch.train` runs
  before any worker starts (configuration, data, a build of every component; no training);
- every test it names is a test function of that file, every docs link a file of the
  repository and, with an anchor, a heading of that file;
- every YAML of `conf/algorithm` and `conf/outer` is the option some row's selection takes
  (read from Hydra's choices, so a method selected through another group — `optimizer=onebit_adam`
  selects its algorithm — counts): a new method without a row fails here.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO, check_command_line

from dpresearch import CONF_DIR

README = REPO / "README.md"
HEADING = "## Methods at a glance"
COLUMNS = (
    "method",
    "paper",
    "selection",
    "runs on",
    "batched workers",
    "reference test",
    "docs",
)
GROUPS = ("algorithm", "outer")  # every option of these groups needs a row


@dataclass(frozen=True)
class Row:
    """One row of the table, its cells by column name."""

    line: int
    cells: dict[str, str]

    @property
    def selection(self) -> list[str]:
        """The command-line overrides of the selection cell (its one code span)."""
        (code,) = re.findall(r"`([^`]*)`", self.cells["selection"])
        return shlex.split(code)

    @property
    def tests(self) -> list[tuple[str, str]]:
        """(file, test function) of each `file::name` code span in the test cell."""
        spans = re.findall(r"`([^`]*)`", self.cells["reference test"])
        return [tuple(span.split("::", 1)) for span in spans]  # type: ignore[misc]

    @property
    def links(self) -> list[str]:
        """The targets of the Markdown links in the docs cell."""
        return re.findall(r"\]\(([^)]+)\)", self.cells["docs"])

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.cells['method']})"


def table_rows() -> list[Row]:
    """The rows of the table under `HEADING` (its header checked against `COLUMNS`)."""
    lines = README.read_text().splitlines()
    start = lines.index(HEADING)
    rows: list[Row] = []
    header_seen = False
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if header_seen and rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header_seen:
            assert tuple(cells) == COLUMNS, f"README.md:{number}: header {cells}"
            header_seen = True
            continue
        if set("".join(cells)) <= set("-: "):
            continue  # the separator line
        assert len(cells) == len(COLUMNS), f"README.md:{number}: {len(cells)} cells"
        rows.append(Row(number, dict(zip(COLUMNS, cells, strict=True))))
    return rows


ROWS = table_rows()


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to -."""
    text = heading.lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of a Markdown file (outside fenced blocks)."""
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            found.add(slug(line))
    return found


def test_the_table_has_a_row_per_method():
    assert len(ROWS) >= 25
    methods = [r.cells["method"] for r in ROWS]
    assert len(set(methods)) == len(methods), "a method with two rows"
    for row in ROWS:
        assert row.selection, f"{row}: no selection"
        assert row.tests, f"{row}: no reference test"
        assert row.links, f"{row}: no docs link"


@pytest.mark.parametrize("row", ROWS, ids=[r.cells["method"] for r in ROWS])
def test_every_selection_passes_the_checks(row, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_command_line(row.selection)


def test_every_algorithm_and_outer_yaml_has_a_row():
    taken: dict[str, set[str]] = {group: set() for group in GROUPS}
    for row in ROWS:
        choices = check_command_line([*row.selection, "--cfg", "job"]).hydra.runtime.choices
        for group in GROUPS:
            taken[group].add(choices[group])
    for group in GROUPS:
        shipped = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
        missing = shipped - taken[group]
        assert not missing, f"{group}= options without a row in the README's table: {missing}"


def test_every_named_test_and_docs_link_exists():
    readme_anchors = anchors(README)
    for row in ROWS:
        for file, name in row.tests:
            path = REPO / file
            assert path.is_file(), f"{row}: no {file}"
            assert re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M), (
                f"{row}: {file} has no test {name}"
            )
        for link in row.links:
            target, _, anchor = link.partition("#")
            path = REPO / target if target else README
            assert path.is_file(), f"{row}: no {target}"
            if anchor:
                known = readme_anchors if path == README else anchors(path)
                assert anchor in known, f"{row}: {path.name} has no heading #{anchor}"
