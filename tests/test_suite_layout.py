"""The suite itself: test modules share helpers through `helpers.py` only (no test module
imports another test module, nor conftest.py; no helper copied into a test module), the README's
test counts are pytest's, and `-m quick` selects the core it names (`helpers.QUICK_CORE`)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    PACKAGES,
    QUICK_CORE,
    REPO,
    SLOW_BY_MEASURE,
    cli_env,
    importable_checkout,
    load_scaled,
    project_files,
)

TESTS = Path(__file__).resolve().parent
# Modules of tests/ that are not test modules: pytest's fixtures and hooks, and the helpers.
HELPER_MODULES = {"conftest", "helpers"}
# How far the README's counts may drift from pytest's before this fails (tests are added all the
# time; a count off by more than this is stale). The count also varies a little by machine: a
# row or two depend on CUDA being present.
COUNT_MARGIN = 0.05


def imported_modules(source: str) -> dict[str, int]:
    """Top-level module name → line of every import in `source`, nested ones included (a lazy
    import in a function is still an import)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            found.setdefault(name.split(".")[0], node.lineno)
    return found


def forbidden_imports(path: Path, test_modules: set[str]) -> list[str]:
    """`path:line imports name` for each import of a test module or of conftest."""
    return [
        f"{path.name}:{line} imports {name}"
        for name, line in imported_modules(path.read_text()).items()
        if name in test_modules or name == "conftest"
    ]


def _test_module_paths() -> list[Path]:
    return sorted(TESTS.glob("test_*.py"))


def test_no_test_module_imports_another_test_module_or_conftest():
    names = {p.stem for p in _test_module_paths()}
    found = [line for p in _test_module_paths() for line in forbidden_imports(p, names)]
    found += [line for m in HELPER_MODULES for line in forbidden_imports(TESTS / f"{m}.py", names)]
    assert not found, "move what is shared into tests/helpers.py:\n" + "\n".join(found)


def test_the_import_check_finds_an_import_of_a_test_module(tmp_path):
    """The check above can fail: nested, aliased and `import x` forms are all found."""
    module = tmp_path / "test_example.py"
    module.write_text(
        "import os\nfrom helpers import SMALL\n\n\ndef test_x():\n"
        "    from test_other import thing as t\n    import conftest\n    import test_third.sub\n"
    )
    found = forbidden_imports(module, {"test_other", "test_third", "test_example"})
    assert found == [
        "test_example.py:6 imports test_other",
        "test_example.py:7 imports conftest",
        "test_example.py:8 imports test_third",
    ]


def test_tests_holds_test_modules_and_the_helper_modules_only():
    others = {p.stem for p in TESTS.glob("*.py")} - {p.stem for p in _test_module_paths()}
    assert others == HELPER_MODULES, "shared helpers belong in tests/helpers.py"


def test_no_helper_is_copied_into_a_test_module():
    """A function of helpers.py defined again, the same code, in a test module."""

    def functions(path: Path) -> dict[str, str]:
        tree = ast.parse(path.read_text())
        return {
            n.name: ast.dump(ast.Module(body=n.body, type_ignores=[]))
            for n in tree.body
            if isinstance(n, ast.FunctionDef)
        }

    shared = functions(TESTS / "helpers.py")
    copies = [
        f"{p.name}: {name}"
        for p in _test_module_paths()
        for name, body in functions(p).items()
        if shared.get(name) == body
    ]
    assert not copies, "import these from helpers instead:\n" + "\n".join(copies)


# -- pytest's collection: the README's counts, the quick core ------------------------------------
def collected(*args: str) -> tuple[list[str], int, int]:
    """Node ids pytest selects with `args` (from the repository root, as scripts/test.sh runs
    it), with the number selected and deselected."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=load_scaled(120),
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [ln for ln in out.stdout.splitlines() if "::" in ln]
    tail = re.search(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", out.stdout)
    assert tail, out.stdout[-2000:]
    selected, deselected = int(tail.group(1)), int(tail.group(3) or 0)
    return ids, selected, deselected


def near(stated: int, actual: int) -> bool:
    return abs(stated - actual) <= COUNT_MARGIN * actual


def test_readme_test_counts_are_pytests():
    """The README's "default suite (N tests, K slow ones left out)" and CI's "T tests" are what
    pytest collects, within COUNT_MARGIN."""
    text = (REPO / "README.md").read_text()
    default = re.search(r"default suite \(([\d,]+) tests, ([\d,]+) slow\s+ones\s+left\s+out", text)
    total = re.search(r"the\s+slow\s+tests\s+—\s+([\d,]+)\s+tests", text)
    assert default and total, "the README's test counts moved: update this test"
    stated_default, stated_slow = (int(g.replace(",", "")) for g in default.groups())
    stated_total = int(total.group(1).replace(",", ""))
    _, slow, not_slow = collected("-m", "slow")
    assert near(stated_slow, slow), f"README: {stated_slow} slow tests; pytest: {slow}"
    assert near(stated_default, not_slow), f"README: {stated_default} tests; pytest: {not_slow}"
    assert near(stated_total, slow + not_slow), f"README: {stated_total}; pytest: {slow + not_slow}"


@pytest.mark.slow  # collects the whole suite, as the README's counts above
def test_every_slow_by_measure_entry_selects_a_slow_test():
    ids, _, _ = collected("-m", "slow")
    stale = [e for e in SLOW_BY_MEASURE if not any(i == e or i.split("[")[0] == e for i in ids)]
    assert not stale, "helpers.SLOW_BY_MEASURE names no test:\n" + "\n".join(stale)


def test_quick_selects_every_entry_of_the_core():
    ids, selected, _ = collected("-m", "quick")
    for entry in QUICK_CORE:
        assert any(i.startswith(entry) for i in ids), f"QUICK_CORE entry selects nothing: {entry}"
    assert 30 <= selected <= 400, selected  # the core, not the suite


# -- sealed off from the user's own folders at the repository's root -----------------------------
USER_FILES = {  # what docs/extending.md suggests a user keeps beside the project
    "my_research/__init__.py": "",
    "my_research/which.py": "WHO = 'the user folder at the root'\n",
    "conf/model/mine.yaml": "_target_: my_research.which.Model\n",
    "experiments/my_study/study.yaml": "name: mine\n",
    "experiments/my_study/published_mine.csv": "a,b\n",
}


def checkout_with_a_user_folder(root: Path) -> Path:
    """A git checkout at `root`: the project's packages (links to this checkout's) and a
    shipped study tracked by git, and the user's own files (`USER_FILES`) beside them."""
    root.mkdir()
    for name in PACKAGES:
        (root / name).symlink_to(REPO / name, target_is_directory=True)
    shipped = root / "experiments" / "shipped" / "study.yaml"
    shipped.parent.mkdir(parents=True)
    shipped.write_text("name: shipped\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True, timeout=load_scaled(60))
    subprocess.run(["git", "-C", str(root), "add", "."], check=True, timeout=load_scaled(60))
    for name, text in USER_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_suites_scans_skip_a_user_folder_at_the_root(tmp_path):
    """The files the suite scans are the ones git tracks: a study of the user's own under
    experiments/ and a folder at the root are not the project's."""
    checkout = checkout_with_a_user_folder(tmp_path / "checkout")
    assert project_files("experiments/*/*.yaml", checkout) == [
        checkout / "experiments" / "shipped" / "study.yaml"
    ]
    assert project_files("experiments/*/published*.csv", checkout) == []
    assert project_files("my_research/*.py", checkout) == []
    assert len(sorted(checkout.glob("experiments/*/*.yaml"))) == 2  # a plain glob takes both


def test_no_test_module_scans_the_repository_root_itself():
    """Every scan of the repository's files goes through `project_files` (a named package's
    folder, `dpresearch/`, may be walked directly: nothing of the user's is inside it)."""
    scans = re.compile(r"\bREPO\.(r?glob|iterdir|walk)\(|os\.(walk|listdir)\(\s*REPO\b")
    found = [
        f"{p.name}:{i}"
        for p in [*_test_module_paths(), TESTS / "helpers.py"]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if scans.search(line)
    ]
    assert found == [], "scan the project's files with helpers.project_files:\n" + "\n".join(found)


def test_a_user_package_at_the_root_never_shadows_a_tests_own(tmp_path):
    """A CLI subprocess imports the checkout's packages, not its root: the package of the same
    name that a test puts on PYTHONPATH (tests/test_extending.py writes docs/extending.md's
    `my_research`) is the one imported, though the user has their own at the root."""
    checkout = checkout_with_a_user_folder(tmp_path / "checkout")
    own = tmp_path / "own" / "my_research"
    own.mkdir(parents=True)
    (own / "__init__.py").write_text("")
    (own / "which.py").write_text("WHO = 'the test'\n")
    probe = "import dpresearch, my_research.which as w; print(w.WHO); print(dpresearch.SOURCE_ROOT)"

    def imported(*path: Path) -> list[str]:
        env = dict(cli_env(), PYTHONPATH=os.pathsep.join(map(str, path)))
        out = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=load_scaled(60),
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.splitlines()

    assert imported(importable_checkout(checkout), own.parent) == ["the test", str(REPO)]
    assert imported(checkout, own.parent)[0] == "the user folder at the root"  # the root: shadowed
    assert sorted(p.name for p in importable_checkout().iterdir()) == sorted(PACKAGES)
    assert cli_env()["PYTHONPATH"].split(os.pathsep)[0] == str(importable_checkout())
