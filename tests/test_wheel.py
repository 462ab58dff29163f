"""Issue 22, item 1 (acceptance A): `pip install .` gives a package that works.

The wheel is built from a copy of the sources (so the checkout gets no `build/`), installed into
a fresh virtual environment, and run from a directory outside the checkout with nothing of the
checkout on the path: `--help`, a 5-step training, a study with its report and an analysis
table, through the console scripts. The fresh environment sees this environment's packages
(torch, Hydra, pandas, ...) through a `.pth` line, not the checkout: no network is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from helpers import REPO, load_scaled

# What the wheel is built from (pyproject.toml's packages and readme).
SOURCES = ("pyproject.toml", "README.md", "dpresearch", "hydra_plugins")


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of this checkout, built from a copy of its sources without network."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(dist),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=load_scaled(300),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = dist.glob("dpresearch-*.whl")
    return wheel


def test_wheel_ships_the_configs_and_the_console_scripts(tmp_path):
    import dpresearch

    wheel = build_wheel(tmp_path)
    assert wheel.name.startswith(f"dpresearch-{dpresearch.__version__}-")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = zf.read(entry_points).decode()
    conf = "dpresearch/conf/"
    shipped = {n.removeprefix(conf) for n in names if n.startswith(conf)}
    expected = {
        str(p.relative_to(REPO / "dpresearch" / "conf"))
        for p in (REPO / "dpresearch" / "conf").rglob("*.yaml")
    }
    assert shipped == expected and "config.yaml" in shipped
    assert "hydra_plugins/dpresearch_sweeper/__init__.py" in names
    assert not any(n.startswith(("tests/", "experiments/", "scripts/")) for n in names)
    for script in (
        "dpresearch",
        "dpresearch-train",
        "dpresearch-study",
        "dpresearch-analysis",
        "dpresearch-tune-gamma",
    ):
        assert f"\n{script} = " in f"\n{scripts}", scripts
    assert not (REPO / "build").exists() or _ignored(REPO / "build")


def _ignored(path: Path) -> bool:
    """git ignores the folder `path` (pip's in-tree build leaves build/ behind; it must not
    show up as untracked)."""
    out = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", f"{path}/"])
    return out.returncode == 0


def test_build_outputs_are_ignored_by_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for name in ("build", "dist", "dpresearch.egg-info", "runs", "outputs", "multirun"):
        assert _ignored(REPO / name), f"{name}/ would show up as untracked after pip install ."


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A new virtual environment holding the wheel; this environment's site-packages (torch,
    Hydra, ...) visible through a .pth line, this checkout nowhere on its path."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
        check=True,
        timeout=load_scaled(120),
    )
    python = venv / "bin" / "python"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=load_scaled(300),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Plain path lines: the .pth files in those folders (this checkout's editable-install
    # finder among them) are not processed, so only the installed wheel provides dpresearch.
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "dpresearch_test_deps.pth").write_text("\n".join(deps) + "\n")
    return venv


@pytest.mark.slow
def test_installed_wheel_trains_studies_and_analyses_outside_the_checkout(tmp_path):
    """~40 s on a quiet 2-core machine (a build, an install and six fresh interpreters)."""
    venv = fresh_venv(tmp_path, build_wheel(tmp_path))
    bin_ = venv / "bin"
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        out = subprocess.run(
            [str(a) for a in args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=load_scaled(300),
        )
        assert out.returncode == 0, f"{args}: {out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        return out

    where = run(bin_ / "python", "-c", "import dpresearch as d; print(d.__file__, d.SOURCE_ROOT)")
    package, source_root = where.stdout.split()
    assert Path(package).is_relative_to(venv) and source_root == "None"

    assert "== Config ==" in run(bin_ / "dpresearch-train", "--help").stdout
    completion = run(bin_ / "dpresearch-train", "-sc", "install=bash").stdout
    assert "-F hydra_bash_completion dpresearch-train" in completion

    small = ["data.num_train=256", "data.num_test=64", "model.hidden=[16]", "backend.threads=1"]
    trained = run(bin_ / "dpresearch", "train", "train.steps=5", *small)
    (summary_path,) = (work / "outputs").glob("*/*/summary.json")
    assert json.loads(summary_path.read_text())["status"] == "finished"
    last = trained.stdout.strip().splitlines()[-1]
    assert last == (
        f"finished: 5/5 steps in {last.split(' in ')[1].split(' s;')[0]} s; results in "
        f"{summary_path.parent.relative_to(work)}"
    )

    # 40 steps: enough to train (the analysis leaves out runs at chance accuracy)
    study = {
        "name": "tiny",
        "common": ["train.steps=40", "train.progress=false", *small],
        "lrs": [0.1],
        "seeds": [0],
        "cases": {"sync": ["algorithm=sync"]},
    }
    (work / "tiny.yaml").write_text(yaml.safe_dump(study))
    run(bin_ / "dpresearch-study", "run", "tiny.yaml", "--report")
    point = work / "runs" / "tiny" / "runs" / "sync" / "lr0.1" / "seed0"
    assert json.loads((point / "summary.json").read_text())["status"] == "finished"
    assert (work / "results" / "results.md").is_file()

    table = run(bin_ / "dpresearch", "analysis", "runs/tiny", "--by", "case").stdout
    assert table.splitlines()[0].startswith("| case | n |") and "| sync | 1 |" in table

    written = [p for p in venv.rglob("*") if p.name in ("runs", "outputs", "multirun", "results")]
    assert written == [], "the installed package wrote into its environment"
