"""Issue 22, acceptance C: every code block of README.md is parsed, checked or run.

The README's fenced blocks are read from the file itself, so an example that stops working (or
a new one nobody checked) fails here:

- `yaml` blocks parse; the study example loads as a study and every point composes and passes
  the configuration checks;
- `bash` blocks are split into commands (continuation lines joined, comments dropped), and each
  is classified: a training command passes the checks the entry point runs before Hydra starts
  (composition, configuration, data, a build of every component; every point of a sweep);
  `tune_gamma`, analysis and study commands run on tiny inputs (studies as `--dry-run`);
- unlabelled blocks of `$ command` lines with their output (transcripts) print what the README
  shows (`...` stands for text left out);
- `python` blocks: the DDP communication hook runs in a one-process gloo group; the "Add a
  compressor" example (a `ChunkCompressor`) is run by `tests/test_readme_compressor.py`.

`test_readme_commands_run_in_order` (slow) runs every command as written, one after another in
one scratch directory as a reader would, with tiny step counts appended (`TINY`) and the
substitutions in `SUBSTITUTE`. Commands that cannot run here are listed in `SKIPPED`, each with
its reason; every other command must be one this file knows how to check.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import REPO, SHARED, check_command_line, cli_env, load_scaled, ramp, write_run

README = REPO / "README.md"
SUBSET = SHARED / "data" / "cifar10-subset"

# Commands not run here (the normalised text: comments dropped, continuation lines joined).
SKIPPED = {
    "bash scripts/run.sh": "installs into .venv, downloads CIFAR-10 (170 MB) and trains for "
    "hours; the job it starts (experiment=resnet20_cifar10) runs here with tiny step counts "
    "in the checkpoint examples",
    "bash scripts/run.sh data.root=/path/to/parent-of-cifar-10-batches-py data.download=false": (
        "installs into .venv; a placeholder path; the same entry point runs here on the CIFAR "
        "subset (DPRESEARCH_DATA)"
    ),
    "bash scripts/test.sh": "the test suite itself",
    "bash scripts/test.sh --all": "the test suite itself",
    "bash scripts/test.sh -m quick": "the test suite itself",
    "bash scripts/test.sh -m slow": "the test suite itself",
    "bash scripts/test.sh --durations=0 --cpu-durations=0": "the test suite itself",
    "eval $(dpresearch-train -sc install=bash)": "registers a completion in the reader's "
    "shell; the script it evaluates is checked in tests/test_wheel.py (installed console "
    "script) and the completions it offers in tests/test_cli.py",
    "python -m dpresearch.train -m hydra/launcher=slurm hydra.launcher.partition=gpu "
    "backend=nccl workers=4 hydra.launcher.gpus_per_node=4 seed=0,1,2": (
        "needs a SLURM cluster with GPUs; the launcher's settings are checked with --cfg hydra "
        "in tests/test_sweeps.py"
    ),
    "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "
    "$HOST0:29400 --rdzv-id myrun -m dpresearch.train backend=nccl workers=8 "
    "experiment=resnet20_cifar10": (
        "needs two machines with GPUs (NCCL); torchrun across two 'nodes' on one machine is "
        "tested on gloo in tests/test_launch.py and tests/test_gossip.py"
    ),
    "python -m dpresearch.study run my_study.yaml --launcher hydra --hydra-launcher slurm": (
        "needs a SLURM cluster; the hydra launcher is tested with the basic launcher in "
        "tests/test_study.py"
    ),
    "python -m dpresearch.study unpack experiments/compressors_more/hierarchy.yaml --out "
    "runs/hier": "writes into the checkout; the same command on that study runs in "
    "tests/test_study.py::test_unpacked_run_data_packs_back_to_the_same_bytes, and a grown "
    "study after unpack in ::test_a_grown_study_runs_only_what_its_unpacked_run_data_lacks",
    "python experiments/bench/spine_step_time.py": "a benchmark (minutes); its cases are "
    "smoke-tested through experiments/bench's shared harness",
    "python -m dpresearch.study run experiments/compression_subset/study.yaml --jobs 2 "
    "--report": "the shipped study (about 3.5 h on this machine); its YAML composes and "
    "validates in tests/test_study.py",
    "python -m dpresearch.study run experiments/gossip_subset/study.yaml --jobs 2 --report": (
        "the shipped gossip study (111 runs, about 55 min on this machine); its YAML composes "
        "and validates in tests/test_study.py"
    ),
    "python -m dpresearch.study run experiments/async/least_squares.yaml --jobs 2 --report": (
        "the shipped asynchronous study (about 40 points); its YAML composes and validates in "
        "tests/test_study.py"
    ),
    "python experiments/bench/async_overhead.py": "a benchmark (64 workers x 10,000 pushes)",
}
# Appended to each command of a kind in the slow run: tiny step counts.
TINY = {
    "cli": [],
    "train": ["train.steps=2", "train.log_every=1", "backend.threads=1"],
    "tune_gamma": ["steps=5", "gammas=[0.01,0.04]"],
    "study": [],  # the study file itself gets TINY["train"] (see `write_readme_study`)
    "analysis": [],
}
# Text replaced in the slow run's commands: a checkpoint every step, and the checkpoint of
# step 1 (2 steps make no step 3910).
SUBSTITUTE = {
    "train.checkpoint_every=1ep": "train.checkpoint_every=1",
    "checkpoints/step_3910.pt": "checkpoints/step_1.pt",
}
# How the README starts each entry point -> (its kind, the module `python -m` runs).
ENTRY_POINTS = {
    ("python", "-m", "dpresearch.train"): ("train", "dpresearch.train"),
    ("python", "-m", "dpresearch.tune_gamma"): ("tune_gamma", "dpresearch.tune_gamma"),
    ("python", "-m", "dpresearch.study"): ("study", "dpresearch.study"),
    ("python", "-m", "dpresearch.analysis"): ("analysis", "dpresearch.analysis"),
    ("dpresearch", "train"): ("train", "dpresearch.train"),
    ("dpresearch", "tune-gamma"): ("tune_gamma", "dpresearch.tune_gamma"),
    ("dpresearch", "study"): ("study", "dpresearch.study"),
    ("dpresearch", "analysis"): ("analysis", "dpresearch.analysis"),
    ("dpresearch-train",): ("train", "dpresearch.train"),
    ("dpresearch",): ("cli", "dpresearch"),
}


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    text: str


@dataclass(frozen=True)
class Command:
    line: int
    words: tuple[str, ...]
    expected: tuple[str, ...] | None = None  # a transcript's output lines

    @property
    def text(self) -> str:
        return " ".join(self.words)

    def _entry(self) -> tuple[int, tuple[str, str] | None]:
        for n in (3, 2, 1):  # the longest prefix naming an entry point
            if self.words[:n] in ENTRY_POINTS:
                return n, ENTRY_POINTS[self.words[:n]]
        return 0, None

    @property
    def kind(self) -> str | None:
        entry = self._entry()[1]
        return entry[0] if entry else None

    @property
    def args(self) -> list[str]:
        """The arguments after the entry point."""
        return list(self.words[self._entry()[0] :])

    @property
    def module(self) -> str:
        """What `python -m` runs for it."""
        return self._entry()[1][1]

    def __str__(self) -> str:
        return f"README.md:{self.line}: {self.text}"


def blocks() -> list[Block]:
    text = README.read_text()
    return [
        Block(text[: m.start()].count("\n") + 1, m.group(1), m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    ]


def _commands(block: Block) -> list[Command]:
    """A bash block's commands: continuation lines joined, comments dropped."""
    found, pending, start = [], "", 0
    for offset, line in enumerate(block.text.splitlines(), 1):
        if not pending:
            start = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        if words:
            found.append(Command(start, tuple(words)))
    return found


def _transcript(block: Block) -> list[Command]:
    """`$ command` lines and the output lines after each."""
    found: list[Command] = []
    for offset, line in enumerate(block.text.splitlines(), 1):
        if line.startswith("$ "):
            found.append(Command(block.line + offset, tuple(shlex.split(line[2:])), ()))
        elif found:
            last = found[-1]
            found[-1] = Command(last.line, last.words, (*last.expected, line))
    return found


def commands() -> list[Command]:
    """Every command of the README in order, transcripts included."""
    found: list[Command] = []
    for block in blocks():
        if block.lang == "bash":
            found += _commands(block)
        elif block.lang == "" and block.text.startswith("$ "):
            found += _transcript(block)
    return found


def of_kind(kind: str, transcripts: bool = False) -> list[Command]:
    return [
        c
        for c in commands()
        if c.kind == kind and c.text not in SKIPPED and (c.expected is not None) == transcripts
    ]


def ids(items: list[Command]) -> list[str]:
    return [f"L{c.line}" for c in items]


def matches(expected: str, line: str) -> bool:
    """`line` is `expected` with each `...` standing for any text."""
    pattern = ".*".join(re.escape(part) for part in expected.split("..."))
    return re.fullmatch(pattern, line) is not None


def output_matches(expected: tuple[str, ...], lines: list[str]) -> bool:
    """Every expected line in order; a line `...` stands for any number of lines."""
    if not expected:
        return not lines
    if expected[0] == "...":
        return any(output_matches(expected[1:], lines[i:]) for i in range(len(lines) + 1))
    head = bool(lines) and matches(expected[0], lines[0])
    return head and output_matches(expected[1:], lines[1:])


@pytest.fixture
def cifar_subset(monkeypatch):
    """The CIFAR-10 data the README's experiments read: the subset beside the repository."""
    if not SUBSET.is_dir():
        pytest.skip(f"the CIFAR-10 subset is not at {SUBSET}")
    monkeypatch.setenv("DPRESEARCH_DATA", str(SUBSET))
    monkeypatch.setenv("DPRESEARCH_SUBSET", str(SUBSET))
    monkeypatch.setenv("DPRESEARCH_SHAKESPEARE", str(SHARED / "data" / "shakespeare" / "works"))


# -- coverage ---------------------------------------------------------------------------------


def test_every_block_is_one_this_file_checks():
    langs = {b.lang for b in blocks()}
    assert langs <= {"bash", "yaml", "python", ""}, f"a block of a new kind: {langs}"
    for block in blocks():
        if block.lang == "":
            assert block.text.startswith("$ "), f"README.md:{block.line}: not a transcript"
    python = [b for b in blocks() if b.lang == "python"]
    others = [b.line for b in python if b not in (ddp_hook_block(), compressor_block())]
    assert not others, f"python blocks at README.md lines {others}: none of ours runs them"
    unknown = [str(c) for c in commands() if c.kind is None and c.text not in SKIPPED]
    assert not unknown, "commands neither checked nor in SKIPPED (with a reason):\n" + "\n".join(
        unknown
    )
    stale = set(SKIPPED) - {c.text for c in commands()}
    assert not stale, f"SKIPPED names commands the README no longer has: {stale}"
    assert len(commands()) > 30 and of_kind("study") and of_kind("analysis")


# -- training commands: the checks of the entry point, every sweep point -------------------------


def _points(args: list[str]) -> list[list[str]]:
    """The command line of each sweep point (a single run: itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dpresearch.config.cli_check import parse_command_line

    overrides = parse_command_line(args).overrides
    parsed = OverridesParser.create().parse_overrides(overrides)
    points: list[list[str]] = [[a for a in args if a not in overrides and a != "-m"]]
    for ov in parsed:
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else None
        if values is None:
            points = [[*p, ov.input_line] for p in points]
        else:
            points = [[*p, f"{ov.get_key_element()}={v}"] for p in points for v in values]
    return points


def train_source(run_dir: str, cwd: Path) -> None:
    """Run the README command that writes `run_dir` (with TINY's steps), as a reader would
    before the command that starts from it (`train.init_from`)."""
    (writer,) = [c for c in of_kind("train") if f"hydra.run.dir={run_dir}" in c.args]
    out = subprocess.run(
        _as_run(writer), cwd=cwd, capture_output=True, text=True, timeout=load_scaled(600)
    )
    assert out.returncode == 0, f"{writer}\n{out.stderr[-3000:]}"


def train_cases() -> list:
    """The README's training commands; one that starts from another command's run trains that
    run first (`train_source`): slow."""
    return [
        pytest.param(
            c,
            id=f"L{c.line}",
            marks=[pytest.mark.slow] if any("train.init_from=" in a for a in c.args) else [],
        )
        for c in of_kind("train")
    ]


@pytest.mark.usefixtures("cifar_subset")
@pytest.mark.parametrize("command", train_cases())
def test_readme_training_command_passes_the_checks(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_readme_files(tmp_path, tiny=False)
    for arg in command.args:  # a checkpoint it resumes from: the checks need it to exist
        if arg.startswith("train.resume=") and arg.endswith(".pt"):
            path = Path(arg.split("=", 1)[1])
            path.parent.mkdir(parents=True)
            path.touch()
        if arg.startswith("train.init_from="):  # the run it starts from: checked against it
            train_source(arg.split("=", 1)[1], tmp_path)
    for point in _points(command.args):
        check_command_line(point)


@pytest.mark.usefixtures("cifar_subset")
@pytest.mark.parametrize(
    "command", of_kind("train", transcripts=True), ids=ids(of_kind("train", transcripts=True))
)
def test_readme_transcript_shows_what_the_checks_print(command):
    """The `error:` lines shown are the ones the checks produce (a sweep: one per bad point,
    then the sweep's last line)."""
    from dpresearch.config.sweep import FailedPoint, report_failures
    from dpresearch.config.validate import ConfigError

    points = _points(command.args)
    lines, failed = [], []
    for point in points:
        try:
            check_command_line(point)
        except ConfigError as exc:
            if "-m" not in command.args:
                lines.append(f"error: {exc}")
                continue
            name = ",".join(a for a in point if "=" in a)
            lines.append(f"error: sweep point {name}: {exc}")
            failed.append(FailedPoint(tuple(a for a in point if "=" in a), str(exc)))
    if failed:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
            report_failures(failed, len(points))
        lines.append(err.getvalue().strip())
    assert output_matches(command.expected, lines), (command.expected, lines)


# -- the other entry points ----------------------------------------------------------------------


@pytest.mark.parametrize("command", of_kind("tune_gamma"), ids=ids(of_kind("tune_gamma")))
def test_readme_tune_gamma_command_runs(command, capsys):
    from dpresearch.tune_gamma import main

    main([*command.args, *TINY["tune_gamma"]])
    out = capsys.readouterr().out
    assert out.startswith("usage: ") if "--help" in command.args else "best gamma:" in out


@pytest.mark.parametrize("command", of_kind("cli"), ids=ids(of_kind("cli")))
def test_readme_dpresearch_command_runs(command, capsys):
    from dpresearch.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(command.args)
    assert exit_.value.code in (0, None)
    assert capsys.readouterr().out.startswith("dpresearch ")


def write_readme_files(folder: Path, tiny: bool) -> None:
    """The files the README's commands name, in `folder`: the study example with its
    published numbers (`write_readme_study`) and a config folder of one's own (`myconf/`)."""
    write_readme_study(folder, tiny)
    sonnets = SHARED / "data" / "shakespeare" / "works" / "sonnets.txt"
    (folder / "my_corpus.txt").write_text(sonnets.read_text())  # the README's own corpus
    (folder / "myconf" / "compressor").mkdir(parents=True, exist_ok=True)
    (folder / "myconf" / "compressor" / "mytopk.yaml").write_text(
        "_target_: dpresearch.compress.topk.TopK\nratio: 0.05\n"
    )


def write_readme_study(folder: Path, tiny: bool) -> Path:
    """The README's study YAML as `folder/my_study.yaml` (with `published.csv` beside it, which
    it names); `tiny`: every point runs TINY's steps."""
    (yaml_block,) = [b for b in blocks() if b.lang == "yaml" and "cases:" in b.text]
    raw = yaml.safe_load(yaml_block.text)
    if tiny:
        raw["common"] = [*raw["common"], *TINY["train"]]
    (folder / "my_study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    from dpresearch.study.tables import PUBLISHED_REQUIRED

    header = ",".join(["case", *PUBLISHED_REQUIRED])  # value, unit, source
    rows = [f"{case},90.0,top-1 test accuracy (%),a paper" for case in raw["cases"]]
    assert len(rows[0].split(",")) == len(PUBLISHED_REQUIRED) + 1
    (folder / "published.csv").write_text("\n".join([header, *rows]) + "\n")
    return folder / "my_study.yaml"


def test_readme_yaml_blocks_parse_and_the_study_composes(tmp_path, cifar_subset):
    """The study example loads; each point composes and validates, and one passes the whole
    preflight (data, model, optimizer, schedule)."""
    from helpers import compose_config

    from dpresearch.config.preflight import preflight
    from dpresearch.config.validate import validate
    from dpresearch.study import load_study

    for block in blocks():
        if block.lang == "yaml":
            assert isinstance(yaml.safe_load(block.text), dict), f"README.md:{block.line}"
    study = load_study(write_readme_study(tmp_path, tiny=False))
    assert len(study.selection_seeds) >= study.min_tune_seeds and len(study.cases) == 2
    points = study.points()
    for point in points:
        validate(compose_config(*point.overrides), point.overrides)
    preflight(compose_config(*points[0].overrides), points[0].overrides)


@pytest.mark.parametrize("command", of_kind("study"), ids=ids(of_kind("study")))
def test_readme_study_command_parses_and_plans(command, tmp_path, monkeypatch, capsys):
    """Each study command, as a dry run (nothing is launched) on the README's study."""
    from dpresearch.study import load_study
    from dpresearch.study.__main__ import main

    monkeypatch.chdir(tmp_path)
    write_readme_files(tmp_path, tiny=True)
    args = command.args
    if args[0] == "report":
        args = ["status", *args[1:]]  # nothing to report yet: its argument parsing and study
    assert main([*args, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    grid = len(load_study(tmp_path / "my_study.yaml").points())
    assert f"== study my_study: {grid} points" in out  # the grid on the tuning seeds first
    assert "== then the final seeds at each case's selected lr(s)" in out


def fixture_runs(root: Path) -> None:
    """Runs like the ones the README's analysis commands read: a study's (`case`) and a
    sweep's (compressor and error feedback in their configs)."""
    for case in ("identity", "top-k 1% + EF"):
        for seed in range(2):
            write_run(
                root / "runs" / "my_study" / case / f"s{seed}",
                lr=0.1,
                seed=seed,
                case=case,
                accs=ramp(0.7),
                final_loss=1.0,
            )
    for i, compressor in enumerate(["identity", "topk"]):
        for folder in ("multirun", "outputs", "multirun/first"):
            run = write_run(root / folder / f"{i}", lr=0.1, seed=0, accs=ramp(0.6), final_loss=1.0)
            config = yaml.safe_load((run / "config.yaml").read_text())
            config["compressor"] = {"_target_": f"dpresearch.compress.{compressor}"}
            config["error_feedback"] = {"mode": "none"}
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            # the config-group choices Hydra records (`choice.*` columns)
            (run / ".hydra").mkdir(exist_ok=True)
            (run / ".hydra" / "hydra.yaml").write_text(
                f"hydra:\n  runtime:\n    choices:\n      compressor: {compressor}\n"
                "      error_feedback: none\n"
            )


@pytest.mark.parametrize("command", of_kind("analysis"), ids=ids(of_kind("analysis")))
def test_readme_analysis_command_runs(command, tmp_path, monkeypatch, capsys):
    from dpresearch.analysis.__main__ import main

    fixture_runs(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(command.args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "cfg.optimizer.lr" in out.split() if "--keys" in command.args else "test accuracy" in out


def test_readme_first_comparison_gives_two_cases_with_bands_in_every_plot(tmp_path, monkeypatch):
    """The README's first sweep + analysis (issue 43, item 4), run as written: two cases of two
    seeds each (the seed, copied into `algorithm.seed` by one method, splits nothing), each in
    every plot with a ± std band."""
    import dpresearch.analysis.plots as plots
    from dpresearch.analysis.__main__ import main

    sweep, analysis = next(
        (c, d)
        for c, d in zip(commands(), commands()[1:], strict=False)
        if c.kind == "train" and "hydra.sweep.dir=multirun/first" in c.args and d.kind == "analysis"
    )
    env = cli_env(WANDB_MODE="disabled", OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="0")
    out = subprocess.run(
        [sys.executable, "-m", sweep.module, *sweep.args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=load_scaled(300),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    drawn, real = [], plots.plot_groups
    monkeypatch.setattr(
        plots, "plot_groups", lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1]
    )
    monkeypatch.chdir(tmp_path)
    assert main(analysis.args) == 0
    table = (tmp_path / "results" / "first" / "table.csv").read_text().splitlines()
    assert [row.split(",")[:2] for row in table[1:]] == [["sync", "2"], ["local_sgd(8)", "2"]]
    assert len(drawn) >= 6
    for fig in drawn:
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["sync (n=2)", "local_sgd(8) (n=2)"], legend
        assert len(fig.axes[0].collections) == 2  # a band per case
        for line in fig.axes[0].get_lines():
            assert len(line.get_xdata()) >= 4  # a curve (evaluated every 10 of 40 steps)


def ddp_hook_block() -> Block:
    (block,) = [b for b in blocks() if b.lang == "python" and "register_comm_hook" in b.text]
    return block


def compressor_block() -> Block:
    """The "Add a compressor" example; `tests/test_readme_compressor.py` runs it."""
    (block,) = [b for b in blocks() if b.lang == "python" and "(ChunkCompressor)" in b.text]
    return block


def test_readme_python_block_runs_in_a_one_process_gloo_group(one_process_group):
    """The DDP communication-hook example, with the model and DDP it assumes."""
    import gc

    import torch
    from torch.nn.parallel import DistributedDataParallel

    block = ddp_hook_block()
    torch.manual_seed(0)
    namespace = {"model": torch.nn.Linear(8, 2), "DistributedDataParallel": DistributedDataParallel}
    exec(compile(block.text, f"README.md:{block.line}", "exec"), namespace)
    ddp, state = namespace["ddp"], namespace["state"]
    ddp(torch.randn(4, 8)).sum().backward()
    sent = state.comm.ledger.bytes_sent
    # The reducer goes while the group is alive (see the fixture), before the assertion can raise.
    del namespace, ddp, state
    gc.collect()
    assert sent > 0  # the hook ran and counted its bytes


# -- every command as a reader runs it -----------------------------------------------------------


def _substituted(word: str) -> str:
    for old, new in SUBSTITUTE.items():
        word = word.replace(old, new)
    return word


def _as_run(command: Command) -> list[str]:
    """The command with this interpreter (`python -m <its module>`), SUBSTITUTE and TINY."""
    args = [_substituted(w) for w in command.args]
    extra = TINY[command.kind] if command.expected is None else []
    return [sys.executable, "-m", command.module, *args, *extra]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # some 40 commands: the default hang guard is per test
@pytest.mark.usefixtures("cifar_subset")
def test_readme_commands_run_in_order(tmp_path):
    """Every command not in SKIPPED, as written (plus TINY and SUBSTITUTE), in README order in
    one scratch directory: exit 0, and a transcript's output as shown. About 5 minutes on a
    quiet 2-core machine."""
    import os

    write_readme_files(tmp_path, tiny=True)
    env = cli_env(
        WANDB_MODE="disabled",
        OMP_NUM_THREADS="1",
        HYDRA_FULL_ERROR="0",
        DPRESEARCH_DATA=os.environ["DPRESEARCH_DATA"],
        DPRESEARCH_SUBSET=os.environ["DPRESEARCH_SUBSET"],
        DPRESEARCH_SHAKESPEARE=os.environ["DPRESEARCH_SHAKESPEARE"],
    )
    ran = []
    for command in commands():
        if command.text in SKIPPED:
            continue
        out = subprocess.run(
            _as_run(command),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=load_scaled(600),
        )
        if command.expected is None:
            assert out.returncode == 0, f"{command}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        else:
            shown = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
            assert out.returncode != 0 and output_matches(command.expected, shown), (
                f"{command}\n{out.stderr[-3000:]}"
            )
        ran.append(command.text)
    assert (tmp_path / "results" / "results.md").is_file()  # the study's report
    status = json.loads((tmp_path / "runs" / "my_study" / "status.json").read_text())
    assert {p["status"] for p in status["points"].values()} == {"finished"}
    print(f"{len(ran)} README commands ran")
