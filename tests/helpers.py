"""Every helper the tests share: the one module a test module imports for what it shares
(no test module imports another: tests/test_suite_layout.py checks it). `conftest.py` holds
pytest's fixtures and hooks only.

Sections: configurations and paths; the command line and processes; gloo sessions (many
real-process checks for the price of one process start); reference trainers written against
torch; equivalence comparisons; checkpoints, resume and stop; batched runs; bad input;
hand-written run directories for the analysis tests; small pieces shared by two modules.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

import dpresearch.train as train_entry  # also registers the structured config schema
from dpresearch import CONF_DIR
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.config.selects import with_selected_choices
from dpresearch.data.synthetic import make_synthetic
from dpresearch.launch.processes import leave_together
from dpresearch.launch.provenance import COMMAND_ENV
from dpresearch.models.mlp import MLP
from dpresearch.run.build import build_communicator, network_model
from dpresearch.run.checkpoint_files import checkpoint_files, latest_checkpoint
from dpresearch.run.trainer import Trainer
from dpresearch.train import train

__all__ = ["CONF_DIR"]  # re-exported: the config directory the tests compose from


# -- the quick core (`-m quick`; conftest.py marks these) --------------------------------------
# The core in under a minute on a 2-core machine (only its modules are collected: conftest.py):
# the sync equivalences (simulated ≡ gloo ≡ DDP ≡ single process: one gloo run), one independent
# reference for each family (gossip, AD-PSGD, asynchronous SGD, the outer optimizers,
# compression), every bad input of the tables, one exact resume, and the suite's own layout.
# Each entry is a test's node id, with or without its parameters ([...]);
# tests/test_suite_layout.py checks that every entry still selects a test of the default suite
# (a slow test named here stays out of it: conftest.py).
QUICK_CORE = (
    "tests/test_equivalence.py::test_sync_simulated_gloo_ddp_and_single_process_agree",
    "tests/test_equivalence.py::test_sync_with_four_workers_equals_single_process_sgd",
    "tests/test_equivalence.py::test_sync_with_batchnorm_matches_ddp_buffer_broadcast",
    "tests/test_equivalence.py::test_local_sgd_period_one_equals_sync",
    "tests/test_equivalence.py::test_same_seed_same_metrics_bit_for_bit",
    "tests/test_gossip.py::test_choco_identity_gamma_one_equals_dpsgd_adapt_then_combine",
    "tests/test_gossip.py::test_dpsgd_on_the_complete_graph_is_exact_averaging",
    "tests/test_adpsgd.py::test_complete_graph_equal_speeds_equals_the_reference",
    "tests/test_async.py::test_fixed_delay_equals_delayed_sgd_reference",
    "tests/test_async.py::test_sync_protocol_is_synchronous_sgd",
    "tests/test_outer.py::test_diloco_equals_algorithm_1_of_the_paper_mlp",
    "tests/test_outer.py::test_outer_sgd_lr_1_is_local_sgd",
    "tests/test_compressed_training.py::test_identity_compression_is_the_plain_allreduce",
    "tests/test_compressed_reduce.py::test_identity_equals_plain_allreduce_mean",
    # (the main bad-input table, ~200 rows, runs in the default suite; the quick core keeps
    # the async and outer tables and the check that every constrained key has a row)
    "tests/test_bad_input.py::test_every_constrained_key_has_a_row",
    "tests/test_bad_input.py::test_bad_async_input_is_one_line",
    "tests/test_bad_input.py::test_bad_outer_input_is_one_line_before_any_worker",
    "tests/test_checkpoint.py::test_killed_and_resumed_equals_uninterrupted_simulated"
    "[sync_qsgd_ef14]",
    "tests/test_suite_layout.py::test_no_test_module_imports_another_test_module_or_conftest",
    "tests/test_suite_layout.py::test_tests_holds_test_modules_and_the_helper_modules_only",
)


# -- slow by measure (conftest.py marks these `slow`: out of the default suite, run by CI) --------
# The default suite is kept well under 10 minutes on a quiet 2-core machine. These tests were the
# slowest by measure (per-test durations of a whole default-suite run, 2026-12-07, scaled by
# a sample measured at low load): the 2nd..nth cases of a parametrised test over ≈ 2 s quiet
# (its cheapest case stays), and single tests over ≈ 3.5 s quiet that repeat a path the default
# suite already covers with a faster test (a real-process or command-line variant, a longer
# training, a benchmark's smoke run, a report regenerated). Every family and feature keeps at
# least one default test of each kind (equivalence or reference, resume, bad input).
# An entry is a node id: with its parameters, one case; without, every case of the function.
SLOW_BY_MEASURE = (
    "tests/test_batched.py::test_every_shipped_model_batches_or_says_why[resnet20]",
    "tests/test_bench_smoke.py::test_gpu_benchmark_skips_cleanly_without_a_gpu_and_runs_on_the_cpu",
    "tests/test_bench_smoke.py::test_gpu_table_script_runs_on_the_cpu",
    "tests/test_bench_smoke.py::test_lm_throughput_tiny",
    "tests/test_bench_smoke.py::test_token_files_bench_runs_and_deletes_its_files",
    "tests/test_bytes_by_purpose.py::test_resnet20_topk_counts_gradient_bytes_only",
    "tests/test_checkpoint.py::test_kill_9_then_resume_equals_uninterrupted",
    "tests/test_checkpoint.py::test_resumed_run_continues_the_same_wandb_run",
    "tests/test_cli.py::test_tab_completion_of_overrides",
    "tests/test_cli.py::test_train_help_is_hydras",
    "tests/test_compressed_training.py::test_ddp_comm_hook_matches_our_sync",
    "tests/test_compressors.py::test_terngrad_is_unbiased_and_ternary",
    "tests/test_config.py::test_cfg_job_prints_composed_config",
    "tests/test_ddp_hook.py::test_ddp_hook_matches_simulated_reducer",
    "tests/test_demo.py::test_algorithm_demo_sweeps_from_the_command_line",
    "tests/test_demo.py::test_simulated_equals_gloo",
    "tests/test_download.py::test_sigterm_mid_download_leaves_nothing",
    "tests/test_eval_bn_stats.py::test_average_simulated_equals_gloo",
    "tests/test_extending.py::test_char_lstm_trains_on_the_shared_corpus",
    "tests/test_gossip.py::test_bad_topology_on_the_command_line_exits_2_before_any_worker",
    "tests/test_gossip.py::test_every_worker_matches_between_simulated_and_gloo",
    "tests/test_gpt.py::test_generate_is_deterministic_per_generator_and_crops_the_context",
    "tests/test_grad_clip.py::test_simulated_equals_gloo",
    "tests/test_launch.py::test_crashing_worker_fails_the_job_fast_with_its_traceback",
    "tests/test_lm_workload.py::test_ddp_hook_trains_the_gpt_as_the_simulated_reducer",
    "tests/test_lm_workload.py::test_kill_9_then_resume_equals_uninterrupted",
    "tests/test_lm_workload.py::test_killed_and_resumed_equals_uninterrupted_simulated[adamw]",
    "tests/test_lm_workload.py::test_killed_and_resumed_equals_uninterrupted_simulated[demo]",
    "tests/test_lm_workload.py::test_killed_and_resumed_equals_uninterrupted_simulated[diloco]",
    "tests/test_lm_workload.py::test_killed_and_resumed_equals_uninterrupted_simulated"
    "[diloco_dropout]",
    "tests/test_lm_workload.py::test_killed_and_resumed_equals_uninterrupted_simulated[muon]",
    "tests/test_lm_workload.py::test_killed_and_resumed_equals_uninterrupted_simulated[sparseloco]",
    "tests/test_lm_workload.py::test_resume_on_another_vocabulary_is_one_line_before_any_worker",
    "tests/test_lm_workload.py::test_simulated_equals_gloo",
    "tests/test_lm_workload.py::test_stacked_workers_with_dropout_equal_the_loop_in_float64"
    "[diloco]",
    "tests/test_more_codecs.py::test_natural_rounds_to_a_neighbouring_power_of_two_unbiased_with_variance_below_an_eighth",
    "tests/test_newcomer.py::test_offline_main_job_names_the_three_ways_out",
    "tests/test_outer.py::test_every_compressor_of_the_library_runs_on_the_pseudo_gradients_with_its_bytes",
    "tests/test_readme.py::test_readme_first_comparison_gives_two_cases_with_bands_in_every_plot",
    "tests/test_readme.py::test_readme_yaml_blocks_parse_and_the_study_composes",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[compression_subset/ef_claim]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[compression_subset/study]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[compressors_more/adam]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[compressors_more/codecs]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[lm_shakespeare/clipped]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[lm_shakespeare/clipped_more]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[lm_shakespeare/gpu]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[lm_shakespeare/probe_clip]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[lm_shakespeare/study]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[local_sgd/study]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[outer/outer_lr]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[outer/study]",
    "tests/test_shipped_studies.py::test_report_regenerates_byte_for_byte_with_readable_figures"
    "[powersgd_table6/study]",
    "tests/test_sparseloco.py::test_simulated_k2_equals_two_gloo_processes",
    "tests/test_sparta.py::test_kill_9_then_resume_auto_is_bit_identical",
    "tests/test_sparta.py::test_simulated_equals_gloo",
    "tests/test_stacked_step.py::test_trained_with_stacked_steps_equals_per_worker_steps[diloco]",
    "tests/test_stacked_step.py::test_trained_with_stacked_steps_equals_per_worker_steps"
    "[diloco_reset_streaming]",
    "tests/test_stacked_step.py::test_trained_with_stacked_steps_equals_per_worker_steps"
    "[sync_adam]",
    "tests/test_stacked_step.py::test_trained_with_stacked_steps_equals_per_worker_steps"
    "[sync_adamw]",
    "tests/test_study.py::test_a_grown_study_runs_only_what_its_unpacked_run_data_lacks",
    "tests/test_study.py::test_a_study_without_grids_says_nothing_was_selected",
    "tests/test_study.py::test_shipped_studies_compose_and_validate"
    "[experiments/gossip_subset/study.yaml]",
    "tests/test_study.py::test_shipped_studies_compose_and_validate"
    "[experiments/lm_shakespeare/study.yaml]",
    "tests/test_study_status.py::test_status_of_a_shipped_study_reads_its_run_data_then_its_unpacked_runs",
    "tests/test_suite_layout.py::test_readme_test_counts_are_pytests",
    "tests/test_sweeps.py::test_slurm_launcher_settings_compose_for_a_gloo_sweep",
    "tests/test_token_files.py::test_an_id_beyond_the_vocabulary_ends_the_run_at_its_batch[gloo]",
)


def slow_by_measure(nodeid: str) -> bool:
    """Whether `nodeid` is one of SLOW_BY_MEASURE's tests."""
    return nodeid in _SLOW or nodeid.split("[")[0] in _SLOW


_SLOW = frozenset(SLOW_BY_MEASURE)


def in_quick_core(nodeid: str) -> bool:
    """Whether `nodeid` is one of QUICK_CORE's tests (an entry ending in `::` names a module)."""
    return any(
        nodeid.startswith(entry)
        if entry.endswith("::")
        else nodeid.split("[")[0] == entry or nodeid == entry
        for entry in QUICK_CORE
    )


# -- configurations and paths ------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# What of the repository's root is the project's: the packages a subprocess imports from this
# checkout. A user's own folders beside them (`my_research/`, `conf/`, as docs/extending.md
# suggests) are not, and no test imports or scans them.
PACKAGES = ("dpresearch", "hydra_plugins")


def tracked_files(root: Path = REPO) -> set[Path] | None:
    """The files git tracks (or has staged) in the checkout `root`; None outside a git
    checkout (a source archive: every file there is the project's)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"], capture_output=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return {root / name for name in out.stdout.decode().split("\0") if name}


def project_files(pattern: str, root: Path = REPO) -> list[Path]:
    """The project's files matching `pattern` (a glob relative to `root`), sorted: in a git
    checkout only those git tracks or has staged, so that a user's own files beside the
    project's (a study of their own under experiments/, a folder at the root) are never taken
    for the project's (`git add` a new file of the project for the suite to see it)."""
    matches = sorted(root.glob(pattern))
    tracked = tracked_files(root)
    return matches if tracked is None else [p for p in matches if p in tracked]


def importable_checkout(root: Path = REPO) -> Path:
    """A folder holding only links to `root`'s packages (`PACKAGES`), for a subprocess's
    PYTHONPATH in place of `root` itself: the checkout's code is imported, and a user's own
    package at the root (`my_research/`) never shadows the one a test puts on the path. One
    folder per pytest process and root, removed when the process ends."""
    if root not in _IMPORTABLE:
        import atexit
        import shutil
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="dpresearch-tests-path-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        for name in PACKAGES:
            (folder / name).symlink_to(root / name, target_is_directory=True)
        _IMPORTABLE[root] = folder
    return _IMPORTABLE[root]


_IMPORTABLE: dict[Path, Path] = {}

# A small, fast experiment: 1024 synthetic examples, a 16-32-10 MLP.
SMALL = [
    "data.num_train=1024",
    "data.num_test=256",
    "data.num_features=16",
    "model.hidden=[32]",
    "train.progress=false",
    "train.log_every=5",
]


def compose_config(*overrides: str) -> DictConfig:
    """The composed config for `overrides`, exactly as `python -m dpresearch.train` builds it."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=with_selected_choices(overrides))


def check_command_line(args: list[str]) -> DictConfig:
    """What `python -m dpresearch.train ARGS` checks before Hydra starts (no directory is
    claimed): raises `ConfigError`. Returns the composed configuration with its `hydra` node
    (`hydra.runtime.choices`: the option taken in each group; a sweep: its first point)."""
    from dpresearch.config.cli_check import compose_command_line, parse_command_line, task_config
    from dpresearch.config.preflight import preflight

    cmd = parse_command_line(with_selected_choices(args))  # as the CLI's main does
    composed = compose_command_line(cmd, CONF_DIR)
    if cmd.runs:
        preflight(task_config(composed), cmd.overrides)
    return composed


SUBSET = SHARED / "data" / "cifar10-subset"  # the CIFAR-10 subset, where present
needs_subset = pytest.mark.skipif(not SUBSET.is_dir(), reason=f"no CIFAR subset at {SUBSET}")
# SMALL with 512 examples and batches of 16 (the outer-optimizer and SparseLoCo tests).
SMALL_512 = [*SMALL, "data.num_train=512", "data.num_test=64", "train.batch_size=16"]


# -- the command line and processes -----------------------------------------------------------
def slowdown() -> float:
    """How much slower than when quiet this machine runs now: the 1-minute load average per
    core, at least 1 (CI and development machines share their few cores with other jobs)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def load_scaled(seconds: float) -> float:
    """`seconds` stretched by the current `slowdown()`: for hang guards and wall-clock bounds,
    which judge the code under test, not the other jobs sharing the cores. On a quiet machine
    it is `seconds` itself."""
    return seconds * slowdown()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def worker_processes(launcher: int) -> list[int]:
    """The worker processes a launching process started (`launch_local`): its children started
    with multiprocessing's spawn, or the processes its fork server forked (forkserver)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    kids = [p for p, parent in parent_of.items() if parent == launcher]
    workers = [p for p in kids if "--multiprocessing-fork" in cmdline(p)]
    servers = {p for p in kids if "multiprocessing.forkserver" in cmdline(p)}
    workers += [p for p, parent in parent_of.items() if parent in servers]
    return sorted(workers)


def free_port() -> int:
    """A port free now (see `free_ports`)."""
    return free_ports(1)[0]


def terminal_signals() -> None:
    """`preexec_fn` of a run a test stops with SIGINT: SIGINT and SIGQUIT at their defaults, as
    in a job a terminal starts. A suite started with them ignored (a script's background job:
    `cmd &` without job control) would pass that on, and a run keeps ignoring an ignored SIGINT
    on purpose (`dpresearch/run/stop.py`) — the test would then wait for a stop that never
    comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def cli_env(**extra: str) -> dict[str, str]:
    """This environment for a CLI subprocess, importing this checkout's package whatever its
    working directory (an editable install elsewhere would otherwise win), and nothing else of
    the repository's root (`importable_checkout`)."""
    path = os.pathsep.join(
        p for p in (str(importable_checkout()), os.environ.get("PYTHONPATH")) if p
    )
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **extra)


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float = 120,
    module: str = "dpresearch.train",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run `python -m <module> args` in `cwd` (`env`: variables added to this environment);
    returns the completed process (text output). `timeout` is a hang guard, stretched by the
    machine's load (`load_scaled`)."""
    env = cli_env(WANDB_MODE="disabled", HYDRA_FULL_ERROR="0", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=load_scaled(timeout),
    )


def torchrun_two_nodes(
    cwd: Path, args: list[str], timeout: float = 240
) -> tuple[list[int], list[str]]:
    """Run `torchrun -m dpresearch.train args` as 2 "nodes" × 2 processes with a c10d rendezvous
    on 127.0.0.1; returns each node's exit code and output."""
    port = free_port()
    env = cli_env(WANDB_MODE="disabled")
    nodes = []
    for node_rank in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node_rank),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "dpresearch-test", "--max-restarts", "0",
            "-m", "dpresearch.train", *args,
        ]  # fmt: skip
        nodes.append(
            subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [p.communicate(timeout=load_scaled(timeout))[0] for p in nodes]
    return [p.returncode for p in nodes], outputs


# -- gloo sessions ----------------------------------------------------------------------------
#
# Starting gloo worker processes (each joins a rendezvous; spawned, each imports torch) costs
# seconds per process on a small machine, far more than the tiny trainings the equivalence tests
# run in them. `spawn_sequence` starts `world` processes once and runs a list of calls in them, one
# after another; each call sets up and tears down its own process group, exactly as a launched
# worker does, so the checks stay independent. `train_on_gloo` trains several configurations that
# way through `dpresearch.launch.run_as_worker`, the code a launched worker runs (the launcher
# itself, torch's elastic agent, is exercised by the tests that start runs through `train()` or
# the command line).
def free_ports(n: int) -> list[int]:
    """`n` distinct ports free now (all held open until every one is chosen), drawn below the
    kernel's ephemeral range where it says: a port chosen by binding port 0 is free again once
    closed, so the kernel may hand it to the next bind(0) anywhere on the machine (gloo's pair
    sockets, another test process) before a rank binds it (EADDRINUSE, seen in the suite);
    ports the kernel never picks by itself leave only other explicit picks to collide with."""
    low = _ephemeral_low()
    rng = random.Random()  # the suite seeds the global generator; ports must not repeat
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < n:
            s = socket.socket()
            sockets.append(s)
            try:
                s.bind(("127.0.0.1", rng.randrange(10_000, low) if low > 12_000 else 0))
            except OSError:
                sockets.pop().close()
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _ephemeral_low() -> int:
    """The lowest port the kernel picks by itself (Linux's ip_local_port_range), else 0."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _run_calls(rank: int, calls: Sequence[tuple[Callable[..., Any], tuple]], context) -> None:
    from dpresearch.launch.forkserver import adopt

    adopt(context)
    for fn, args in calls:
        fn(rank, *args)


def spawn_sequence(world: int, calls: Sequence[tuple[Callable[..., Any], tuple]]) -> None:
    """Start `world` processes once; each runs `fn(rank, *args)` for every call in order
    (functions importable by the children: module-level in a test module). They start as the
    launcher starts workers: forked from its fork server where it can (the same server, so it
    is started once per test session), else spawned (`dpresearch.launch.forkserver`)."""
    from dpresearch.launch.forkserver import choose

    method, context = choose("forkserver")
    torch.multiprocessing.start_processes(
        _run_calls, args=(list(calls), context), nprocs=world, join=True, start_method=method
    )


def reference_start(cfg: DictConfig) -> tuple[Any, Any, int, torch.nn.Module]:
    """What a reference written against torch starts from, as the run does: the data set (its
    validation split held out), the IID partitioner over `cfg.workers`, the batches per
    epoch, and the initial model (built under torch's default dtype now)."""
    from hydra.utils import instantiate

    torch.manual_seed(cfg.seed)
    data = instantiate(cfg.data, device="cpu").hold_out(cfg.train.val_size)
    partitioner = data.make_partitioner(cfg.workers, cfg.seed)
    per_epoch = partitioner.samples_per_worker // cfg.train.batch_size
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model, num_classes=data.num_classes, input_shape=data.input_shape)
    return data, partitioner, per_epoch, model


def trainers_on_gloo(
    rank: int,
    world: int,
    port: int,
    out: str,
    cases: dict[str, list[str]],
    keep: Callable[[Trainer, dict], Any],
    dtype: torch.dtype = torch.float64,
    base: Sequence[str] = SMALL_512,
) -> None:
    """This process as rank `rank` of `world` gloo processes (for `spawn_sequence`): each case
    of `cases` (overrides of `base`) trained in `dtype` (`build_trainer`), `keep(trainer,
    summary)` of each saved to `out/rank{rank}.pt` as {case: kept}."""
    from dpresearch.comm.distributed import DistributedCommunicator

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = {}
    for name, args in cases.items():
        cfg = compose_config(*base, *args)
        trainer = build_trainer(cfg, DistributedCommunicator(network_model(cfg)), dtype)
        results[name] = keep(trainer, trainer.run())
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def cases_on_gloo(
    world: int,
    out: Path,
    cases: dict[str, list[str]],
    keep: Callable[[Trainer, dict], Any],
    dtype: torch.dtype = torch.float64,
    base: Sequence[str] = SMALL_512,
) -> list[dict]:
    """`trainers_on_gloo` on `world` processes: what each rank kept, rank by rank."""
    args = (world, free_port(), str(out), cases, keep, dtype, list(base))
    spawn_sequence(world, [(trainers_on_gloo, args)])
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


def row_and_buffers(trainer: Trainer, summary: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A `keep` for `cases_on_gloo`: this rank's parameter row, its buffer row, the summary."""
    return trainer.replicas.params[0].clone(), trainer.replicas.buffers[0].clone(), summary


def train_rank(rank: int, world: int, cfg: dict, run_dir: str, port: int) -> None:
    """This process as rank `rank` of a `world`-process run of `cfg` (rank 0 writes
    `run_dir`): the environment torch's launcher would give it, then `run_as_worker`."""
    from dpresearch.launch.processes import run_as_worker

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    run_as_worker(OmegaConf.create(cfg), Path(run_dir) if rank == 0 else None)


def train_on_gloo(world: int, jobs: Sequence[tuple[DictConfig, Path]]) -> list[dict]:
    """Train every (config, run directory) on the same `world` gloo processes, one after
    another; returns each run's final model (`model_final.pt`)."""
    ports = free_ports(len(jobs))
    calls = [
        (train_rank, (world, OmegaConf.to_container(cfg, resolve=True), str(run_dir), port))
        for (cfg, run_dir), port in zip(jobs, ports, strict=True)
    ]
    for _, run_dir in jobs:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    spawn_sequence(world, calls)
    return [torch.load(Path(run_dir) / "model_final.pt") for _, run_dir in jobs]


# -- reference trainers written against torch, independent of dpresearch's loop: torch DDP with
# DistributedSampler, and single-process SGD on the concatenated global batch ----------------
# Must match SMALL and the overrides the tests pass.
DATA = dict(num_train=1024, num_test=256, num_features=16, num_classes=10, noise=1.0, seed=0)
SEED, LR, STEPS, BATCH = 0, 0.1, 20, 16


def reference_model(batch_norm: bool) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return MLP(10, (16,), hidden=[32], batch_norm=batch_norm)


def shard_batches(world: int, rank: int, n: int):
    """DistributedSampler(shuffle, seed, drop_last) batches of BATCH, epoch after epoch."""
    sampler = DistributedSampler(
        range(n), num_replicas=world, rank=rank, shuffle=True, seed=SEED, drop_last=True
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(sampler))
        for b in range(len(idx) // BATCH):
            yield idx[b * BATCH : (b + 1) * BATCH]
        epoch += 1


def ddp_worker(
    rank: int,
    world: int,
    port: int,
    out_path: str,
    batch_norm: bool,
    hook: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """One rank of a torch DDP run; rank 0 saves the final state dict to `out_path`.

    hook: {"compressor": node, "error_feedback": node} registers dpresearch's compressed comm
    hook (the compressor seeded like our run: SEED; rank r draws worker r's streams).
    dtype: data and model made under torch's default dtype `dtype`, as `build_trainer`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with default_dtype(dtype):
        data = make_synthetic(**DATA)
        model = reference_model(batch_norm)
    ddp = DistributedDataParallel(model)
    if hook is not None:
        from dpresearch.compress import build_compressor, make_comm_hook

        state, fn = make_comm_hook(
            build_compressor(hook["compressor"], SEED), ddp, error_feedback=hook["error_feedback"]
        )
        ddp.register_comm_hook(state, fn)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    batches = shard_batches(world, rank, DATA["num_train"])
    for _ in range(STEPS):
        x, y = data.train_batch(next(batches))
        x = x.to(dtype)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save(model.state_dict(), out_path)
    # The reducer's reference to the group goes first, while the group is alive, so that the
    # group's destructor runs inside `leave_together` with gloo's threads idle (see there).
    del ddp, opt
    if hook is not None:
        del state, fn
    gc.collect()
    leave_together()


def run_ddp(
    world: int,
    out_path: str,
    port: int,
    batch_norm: bool = False,
    hook: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    spawn_sequence(world, [(ddp_worker, (world, port, out_path, batch_norm, hook, dtype))])
    return torch.load(out_path)


def run_single_process(world: int, dtype: torch.dtype = torch.float32) -> dict:
    """Plain SGD on the concatenation of the `world` workers' shards of each global batch; data
    and model made under torch's default dtype `dtype`, as `build_trainer`."""
    with default_dtype(dtype):
        data = make_synthetic(**DATA)
        model = reference_model(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    streams = [shard_batches(world, r, DATA["num_train"]) for r in range(world)]
    for _ in range(STEPS):
        x, y = data.train_batch(torch.cat([next(s) for s in streams]))
        x = x.to(dtype)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


def run_ddp_many(world: int, variants: dict[str, dict], folder: str) -> dict[str, dict]:
    """Several DDP runs (`variants`: name -> ddp_worker's keyword arguments `batch_norm`,
    `hook`, `dtype`) on the same `world` processes, started once (`spawn_sequence`); name ->
    final state dict."""
    ports = free_ports(len(variants))
    paths = {name: os.path.join(folder, f"ddp-{name}.pt") for name in variants}
    calls = []
    for (name, v), port in zip(variants.items(), ports, strict=True):
        options = (v.get("batch_norm", False), v.get("hook"), v.get("dtype", torch.float32))
        calls.append((ddp_worker, (world, port, paths[name], *options)))
    spawn_sequence(world, calls)
    return {name: torch.load(path) for name, path in paths.items()}


# -- equivalence comparisons -------------------------------------------------------------------
TOL = 1e-6


def run_ours(small_config, tmp_path: Path, name: str, *overrides: str) -> dict:
    run_dir = tmp_path / name
    cfg = small_config(
        f"seed={SEED}",
        f"optimizer.lr={LR}",
        f"train.steps={STEPS}",
        f"train.batch_size={BATCH}",
        *overrides,
    )
    train(cfg, run_dir)
    return torch.load(run_dir / "model_final.pt")


def run_ours64(small_config, *overrides: str) -> tuple[dict, dict]:
    """`run_ours` in float64 (`build_trainer`), in this process: the consensus model's state
    dict, as `model_final.pt` would hold it, and the run's summary."""
    cfg = small_config(
        f"seed={SEED}",
        f"optimizer.lr={LR}",
        f"train.steps={STEPS}",
        f"train.batch_size={BATCH}",
        *overrides,
    )
    return final_state64(cfg)


def final_state64(cfg: DictConfig) -> tuple[dict, dict]:
    """`cfg` trained on simulated workers in float64 (`build_trainer`), in this process, with
    the communicator the CLI builds: the consensus model's state dict, as `model_final.pt`
    would hold it, and the run's summary."""
    assert cfg.backend.name == "simulated"
    torch.set_num_threads(1)
    trainer = build_trainer(cfg, build_communicator(cfg), torch.float64)
    summary = trainer.run()
    return {k: v.clone() for k, v in trainer.eval_model.state_dict().items()}, summary


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# -- checkpoints, resume and stop --------------------------------------------------------------
RESUME_STEPS, KILL_AT, EVERY = 60, 35, 10
CHECKPOINTED = [
    *SMALL,
    "data.num_train=512",
    "data.num_test=64",
    "train.batch_size=16",
    "train.log_every=1",
    "train.eval_every=20",
    f"train.steps={RESUME_STEPS}",
]
# Lines that differ between two runs of the same computation: wall-clock timings.
TIMED = ("time/", "tokens_per_s")  # wall-clock figures: differ between runs of the same computation

CHECKPOINT_CASES = {
    "sync_qsgd_ef14": ["compressor=qsgd", "error_feedback=ef14"],
    "topk_ef21": ["compressor=topk", "compressor.ratio=0.1", "error_feedback=ef21"],
    "powersgd_ef": [
        "compressor=powersgd",
        "error_feedback=ef14",
        "compressor.min_compression_rate=1.0",
        "model.hidden=[32,32]",
    ],
    "local_sgd": ["algorithm=local_sgd", "algorithm.period=4", "optimizer.momentum=0.9"],
    "choco": ["algorithm=choco", "compressor=topk", "compressor.ratio=0.25"],
    "dpsgd": ["algorithm=dpsgd", "optimizer.momentum=0.9"],
    "sgp": ["algorithm=sgp", "topology=one_peer_exponential"],
    # issue 20: aggregator state in sketch space, node leaders' memories, compressed Adam
    # (checkpoints at 30 after the freeze; 0/1 Adam checkpointed with local steps pending)
    "sketch": ["compressor=sketch", "compressor.ratio=0.05"],
    "two_level_onebit": [
        "comm.hierarchy.workers_per_node=2", "compressor=onebit", "error_feedback=ef14",
    ],
    "onebit_adam": ["optimizer=onebit_adam", "optimizer.lr=0.01", "optimizer.freeze_step=20"],
    "zero_one_adam": [
        "optimizer=zero_one_adam", "optimizer.lr=0.01", "optimizer.var_freeze_step=20",
        "optimizer.var_update_scaler=4", "optimizer.local_step_scaler=3",
        "optimizer.local_step_clipper=4",
    ],
    # AD-PSGD: reads, event queue, speed and pairing streams, staleness counts
    "adpsgd": ["algorithm=adpsgd", "async.speed=exponential", "optimizer.momentum=0.9"],
    "adpsgd_topk": ["algorithm=adpsgd", "compressor=topk", "compressor.ratio=0.25",
                    "algorithm.gamma=0.5", "async.speed=exponential"],  # + the edges' copies
    # stacked optimizer state (issue 42): AdamW's packed moments and counters under DiLoCo's
    # outer Nesterov (its momentum packed on the anchor's row); MuonAdamW's Muon momentum
    "diloco_adamw": ["optimizer=adamw", "optimizer.lr=0.01", "algorithm=local_sgd",
                     "algorithm.period=4", "outer=nesterov"],
    "muon": ["optimizer=muon", "optimizer.lr=0.01"],
}  # fmt: skip


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model_final.pt")


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def untimed(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith(TIMED)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def kill_and_resume(tmp_path: Path, args: list[str], failure: type[BaseException]) -> Path:
    """Run with a checkpoint every `EVERY` steps until the injected failure at step
    `KILL_AT`, then resume; returns the run directory."""
    run_dir = tmp_path / "resumed"
    every = [f"train.checkpoint_every={EVERY}"]
    cfg = compose_config(*args, *every, "debug.fail_worker=1", f"debug.fail_at_step={KILL_AT}")
    with pytest.raises(failure):
        train(cfg, run_dir)
    assert latest_checkpoint(run_dir).name == f"step_{KILL_AT // EVERY * EVERY}.pt"
    assert not (run_dir / "summary.json").exists()
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert json.loads(before[-1])["step"] == KILL_AT  # logged past the checkpoint
    summary = train(compose_config(*args, *every, "train.resume=auto"), run_dir)
    assert summary["status"] == "finished"
    # The lines up to the checkpoint are the first attempt's own (timings included): the run
    # continued from the checkpoint rather than starting over.
    kept = [ln for ln in before if json.loads(ln)["step"] <= KILL_AT // EVERY * EVERY]
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert after[: len(kept)] == kept
    return run_dir


def check_resumed(tmp_path: Path, args: list[str], failure: type[BaseException]) -> None:
    reference = tmp_path / "reference"
    train(compose_config(*args), reference)
    resumed = kill_and_resume(tmp_path, args, failure)
    assert same(final_params(resumed), final_params(reference))
    lines, ref_lines = metric_lines(resumed), metric_lines(reference)
    assert [m["step"] for m in lines] == list(range(1, RESUME_STEPS + 1))  # each step exactly once
    assert [untimed(m) for m in lines] == [untimed(m) for m in ref_lines]
    summary = json.loads((resumed / "summary.json").read_text())
    ref_summary = json.loads((reference / "summary.json").read_text())
    assert summary["comm/bytes"] == ref_summary["comm/bytes"]
    assert summary["comm/ops"] == ref_summary["comm/ops"]
    assert summary["status"] == "finished"
    assert len(checkpoint_files(resumed / "checkpoints")) == 2  # train.checkpoint_keep=2


def start_cli(args: list[str], cwd: Path) -> subprocess.Popen:
    """Start `python -m dpresearch.train args` in `cwd` in a session of its own (stop the whole
    job with `os.killpg(proc.pid, ...)`), output piped as text, W&B off."""
    return subprocess.Popen(
        [sys.executable, "-m", "dpresearch.train", *args],
        cwd=cwd,
        env=cli_env(WANDB_MODE="disabled"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=terminal_signals,
    )


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float) -> None:
    """Return once the running `proc` has logged `step` in `run_dir`'s metrics.jsonl."""
    deadline = time.monotonic() + load_scaled(timeout)
    path = run_dir / "metrics.jsonl"
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        text = path.read_text() if path.exists() else ""
        # complete lines only: the trainer may be halfway through writing the last one
        lines = text[: text.rfind("\n") + 1].splitlines()
        if lines and json.loads(lines[-1])["step"] >= step:
            return
        assert time.monotonic() < deadline, "the run logged too few steps in time"
        time.sleep(0.1)


def kill_9_and_resume(
    args: list[str],
    cwd: Path,
    kill_after: int,
    before_resume: Callable[[Path], None] | None = None,
) -> tuple[Path, Path]:
    """Run `python -m dpresearch.train args` (a run that checkpoints), SIGKILL it once it has
    logged step `kill_after`, check it left a checkpoint and no summary, call
    `before_resume(run_dir)` if given (to inspect or tamper with what the kill left), resume
    it with `train.resume=auto` to the end, and train the same configuration uninterrupted in
    this process; returns (the resumed run's directory, the uninterrupted one's)."""
    run_dir = cwd / "run"
    proc = start_cli([*args, f"hydra.run.dir={run_dir}"], cwd)
    try:
        wait_for_step(run_dir, proc, kill_after, timeout=240)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=load_scaled(60))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert latest_checkpoint(run_dir) is not None and not (run_dir / "summary.json").exists()
    if before_resume is not None:
        before_resume(run_dir)
    out = run_cli([*args, f"hydra.run.dir={run_dir}", "train.resume=auto"], cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = cwd / "reference"
    train(compose_config(*args), reference)
    return run_dir, reference


def stop_and_resume(
    tmp_path: Path, args: list[str], signum: int, bound_s: float
) -> tuple[Path, str]:
    """Start `args` on the command line, send `signum` once it has logged a few steps, check
    the clean stop (exit 128 + signum within `bound_s` on a quiet machine, longer in
    proportion to the load; one line, checkpoint, status), then
    resume with train.resume=auto to the end; returns the run directory and the stop's
    stderr."""
    run_dir = tmp_path / "run"
    proc = start_cli([*args, f"hydra.run.dir={run_dir}"], tmp_path)
    try:
        wait_for_step(run_dir, proc, 3, timeout=240)
        os.kill(proc.pid, signum)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=load_scaled(120))
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"stopped {took:.1f} s after {signal.Signals(signum).name}")
    assert proc.returncode == 128 + signum, err[-3000:]
    assert took <= load_scaled(bound_s), f"the run took {took:.1f} s to stop"
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted at step "), err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    step = summary["interrupted_at_step"]
    assert latest_checkpoint(run_dir).name == f"step_{step}.pt"
    # The line names the checkpoint and the exact command that continues this run (its run
    # directory pinned: train.resume=auto alone would start afresh in a new directory).
    head, _, command = lines[0].partition("; resume with: ")
    assert head.startswith(f"interrupted at step {step}/{summary['total_steps']} after "), head
    assert head.endswith(f": checkpoint {latest_checkpoint(run_dir)}"), head
    words = shlex.split(command)
    # the interpreter that ran (its bare name only where PATH finds that very file)
    assert words[0] in (sys.executable, Path(sys.executable).name), command
    assert words[1:3] == ["-m", "dpresearch.train"], command
    assert words[3:] == [*args, f"hydra.run.dir={run_dir.resolve()}", "train.resume=auto"]
    assert not (run_dir / "model_final.pt").exists()
    out = subprocess.run(
        [sys.executable, *words[1:]],  # the printed command, run as printed
        cwd=tmp_path,
        env=cli_env(WANDB_MODE="disabled"),
        capture_output=True,
        text=True,
        timeout=load_scaled(300),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    return run_dir, err


# -- batched runs -------------------------------------------------------------------------------
MLP_RUN = [
    *SMALL,
    "workers=4",
    "train.batch_size=8",
    "train.steps=20",
    "model.batch_norm=true",
    "backend.threads=1",
]
RESNET_RUN = [
    "data=cifar10", f"data.root={SUBSET}", "data.subset=512",
    "model=resnet20", "model.width=4", "workers=3", "train.batch_size=4", "train.steps=20",
    "train.log_every=5", "train.progress=false", "train.eval_batch_size=64",
    "backend.threads=1", "optimizer.lr=0.05", "optimizer.momentum=0.9",
]  # fmt: skip


# Float64 runs. An equivalence between two *different* computations of the same math (batched
# against the loop, an algorithm against a reference written apart, one composition against
# another) differs by rounding in float32: sums in another order, a fused kernel or a vector
# tail, each CPU's own choice. Over a run that is a few ulps per step, amplified by training, so
# a fixed float32 tolerance passes on one CPU and fails on another (issue 33: 2.4e-6 seen
# against 1e-6). In float64 the same reordering is ~1e-16 per step: such comparisons run in
# float64 at TOL64, nine orders of magnitude below what a wrong row, step or order moves
# (> 1e-3), and far above float64 rounding (~1e-13 after a test's runs).
TOL64 = 1e-9


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype `dtype` inside (models built, tensors created), restored after."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(default)


def build_trainer(
    cfg: DictConfig,
    comm: Any,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> Trainer:
    """`Trainer(cfg, comm, device, None)` with its model (hence its rows, optimizer state and
    compressor memories) built in `dtype` (torch's default dtype while it is built: the same
    initialisation draws) and its training and test inputs cast to `dtype`."""
    with default_dtype(dtype):
        trainer = Trainer(cfg, comm, device or torch.device("cpu"), None)
    if dtype != torch.float32:
        data = trainer.data
        one, many, test = data.transform_train, data.transform_batches, data.transform_test
        data.transform_train = lambda x, g: one(x, g).to(dtype)  # type: ignore[method-assign]
        data.transform_batches = lambda x, gs: many(x, gs).to(dtype)  # type: ignore[method-assign]
        data.transform_test = lambda x: test(x).to(dtype)  # type: ignore[method-assign]
    return trainer


def trainer_for(*overrides: str, mode: str, dtype: torch.dtype = torch.float32) -> Trainer:
    """The simulated run of `rows_after`, built, not yet run."""
    cfg = compose_config(*overrides, f"train.batched_workers={mode}", "train.save_model=false")
    torch.set_num_threads(1)
    device = torch.device("cuda" if cfg.train.device.startswith("cuda") else "cpu")
    comm = SimulatedCommunicator(cfg.workers, network_model(cfg))
    trainer = build_trainer(cfg, comm, dtype, device)
    trainer.metrics.evaluate = lambda: {"test/loss": 0.0, "test/acc": 0.0}  # type: ignore[method-assign]
    return trainer


# -- bad input -----------------------------------------------------------------------------------
SYNTHETIC_SMALL = ["data.num_train=256", "data.num_test=64"]


def run_main(args: list[str], tmp_path: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """`python -m dpresearch.train args` in this process, from `tmp_path`; Hydra never starts
    (a case that passes every check would be a failure of this test)."""

    def hydra_started() -> None:
        raise AssertionError("the checks passed: this input was accepted")

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(COMMAND_ENV, raising=False)  # main() records its command line there
    monkeypatch.setattr(train_entry, "_hydra_main", hydra_started)
    monkeypatch.setattr(sys, "argv", ["dpresearch.train", *args])
    with pytest.raises(SystemExit) as stopped:
        train_entry.main()
    out = capsys.readouterr()
    return stopped.value.code, out.out, out.err


def refused_before_start(args: list[str], fragment: str, tmp_path: Path, monkeypatch, capsys):
    """`run_main(args)` with its run directory under `tmp_path`: exit code 2, one `error: `
    line holding `fragment`, and nothing written (`tmp_path` stays empty)."""
    argv = [*args, f"hydra.run.dir={tmp_path / 'run'}"]
    code, _, err = run_main(argv, tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []


# -- hand-written run directories with answers known in advance (the analysis tests) ------------
STEPS_PER_EPOCH = 5
OPS = [["allreduce", 1000, 4, 0, 10]]  # 10 steps × one allreduce of 1000 bytes, K = 4


def _dumps(row: dict[str, Any]) -> str:
    # As the trainer's logger writes them: non-finite floats as strings.
    return json.dumps(
        {
            k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
    )


def write_run(
    path: Path,
    *,
    lr: float,
    seed: int,
    accs: list[float],
    final_loss: float,
    case: str | None = None,
    finished: bool = True,
    status: str | None = None,
    network: tuple[float, float] = (20.0, 10.0),
) -> Path:
    """A run of len(accs) logged steps (one per step): epoch = step/5, comm/bytes = 1000·step,
    comm/modeled_s = 0.01·step, time/wall_s = 2·step, test/acc = accs[step-1]; the final
    training loss `final_loss` (NaN: diverged). `finished=False` writes no summary."""
    path.mkdir(parents=True)
    config = {
        "workers": 4,
        "seed": seed,
        "optimizer": {"_target_": "torch.optim.SGD", "lr": lr},
        "network": {"name": "10gbe", "latency_us": network[0], "bandwidth_gbit": network[1]},
        "model": {"hidden": [32]},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    if case is not None:
        (path / "study_point.json").write_text(json.dumps({"study": "fixture", "case": case}))
    rows = []
    for step, acc in enumerate(accs, 1):
        rows.append(
            {
                "step": step,
                "epoch": step / STEPS_PER_EPOCH,
                "train/loss": 2.0 / step,
                "comm/bytes": 1000.0 * step,
                "comm/modeled_s": 0.01 * step,
                "time/wall_s": 2.0 * step,
                "test/acc": acc,
            }
        )
    rows[-1]["train/loss"] = final_loss
    (path / "metrics.jsonl").write_text("".join(_dumps(r) + "\n" for r in rows))
    if finished:
        summary = {
            **rows[-1],
            "best/test_acc": max(accs),
            "comm/ops": OPS,
            "comm/bytes_per_epoch": 1000.0 * STEPS_PER_EPOCH,
            **({"status": status} if status else {}),
        }
        (path / "summary.json").write_text(_dumps(summary))
    return path


def ramp(final: float, n: int = 10) -> list[float]:
    """n accuracies rising linearly from final/n to final."""
    return [final * (i + 1) / n for i in range(n)]


# -- stub study runs: the study harness on objectives known in advance -------------------------
# (tests/test_study_protocol.py, tests/test_study_two_keys.py)
STUB_VAL_EXAMPLES = 500
STUB_STEPS = 4  # logged steps per stub run, one per epoch


def stub_study(tmp_path, cases: dict, **extra) -> object:
    """The study of `cases` (+ `extra` keys) on seeds 0-3, tuned on 0 and 1 by val/acc."""
    from dpresearch.study import load_study

    body = {
        "name": "stub",
        "title": "Stub objective",
        "seeds": [0, 1, 2, 3],
        "tune_seeds": [0, 1],
        "select": "val/acc:max",
        "common": ["train.val_size=0.1"],  # a validation split: the checks before a study
        "cases": cases,
        **extra,
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return load_study(path)


def stub_runner(
    objective, ran: list, curve=lambda acc, epoch: acc * epoch / STUB_STEPS, lr_key="optimizer.lr"
):
    """A runner writing the files the trainer writes, with val/acc at epoch e =
    curve(objective(case, lr, seed), e) (test/acc 0.01 below it; a point tuning other keys
    too, `tune_also`: objective(case, (lr, their values), seed)), the point's lr under `lr_key`
    and its other tuned values under their keys in its configuration; `ran` records each
    point."""

    def run(point, run_dir, overrides):
        ran.append(point.id)
        acc = objective(point.case, point.setting if point.also else point.lr, point.seed)
        config = {
            "seed": point.seed,
            "train": {"epochs": STUB_STEPS},
            "schedule": {"_target_": "dpresearch.schedules.Constant"},
        }
        for dotted, value in ((lr_key, point.lr), *point.also):
            *parents, leaf = dotted.split(".")
            node = config
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
        curves = {
            s: curve(acc, s) if callable(curve) else curve[point.case](acc, s)
            for s in range(1, STUB_STEPS + 1)
        }
        lines = [
            {
                "step": s,
                "epoch": float(s),
                "train/loss": 2.0 - 0.3 * s,
                "val/acc": curves[s],
                "test/acc": curves[s] - 0.01,
            }
            for s in range(1, STUB_STEPS + 1)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        summary = {
            **lines[-1],
            "status": "finished",
            "data/classes": 10,
            "data/val_examples": STUB_VAL_EXAMPLES,
            "data/test_examples": 1000,
            "total_steps": STUB_STEPS,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return 0

    return run


def peak_at(best_lr: float):
    """Validation accuracy 0.8 at `best_lr`, falling by 0.1 per decade² away from it."""
    return lambda case, lr, seed: 0.8 - 0.1 * (math.log10(lr / best_lr)) ** 2 + 0.001 * seed


# -- small pieces shared by two modules --------------------------------------------------------
def finished_run(*overrides: str, dtype: torch.dtype = torch.float32) -> Trainer:
    """A finished simulated run of SMALL_512 (the synthetic data set; not with an experiment) +
    overrides, one thread, deterministic sums, in `dtype` (`build_trainer`); the trainer after
    it."""
    torch.set_num_threads(1)
    own = any(o.startswith("experiment=") for o in overrides)
    cfg = compose_config(*(["train.progress=false"] if own else SMALL_512), *overrides)
    comm = SimulatedCommunicator(cfg.workers, network_model(cfg), deterministic=True)
    trainer = build_trainer(cfg, comm, dtype)
    trainer.summary = trainer.run()
    return trainer


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def write_md5sums(folder: Path) -> None:
    """Ship an MD5SUMS with a fake folder, as a subset or variant of a data set does (its files
    are not the official release, so they verify against this list)."""
    files = sorted(folder.iterdir())
    lines = [f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.name}" for p in files]
    (folder / "MD5SUMS").write_text("\n".join(lines) + "\n")


def layout_of(shapes):
    layout, offset = [], 0
    for shape in shapes:
        layout.append((offset, shape))
        offset += math.prod(shape)
    return layout, offset


def four_worker_config(*overrides: str) -> DictConfig:
    return compose_config(
        *SMALL,
        "workers=4",
        "train.steps=20",
        "train.batch_size=16",
        "backend.threads=1",
        *overrides,
    )


def trained_four_workers(tmp_path, name: str, *overrides: str) -> dict:
    train(four_worker_config(*overrides), tmp_path / name)
    return torch.load(tmp_path / name / "model_final.pt")


def four_workers_rows64(*overrides: str) -> torch.Tensor:
    """Every worker's parameters after `four_worker_config(*overrides)` on simulated workers in
    float64 (`build_trainer`), in this process, with the communicator the CLI builds (a
    two-level cluster too)."""
    torch.set_num_threads(1)
    cfg = four_worker_config(*overrides)
    assert cfg.backend.name == "simulated"
    trainer = build_trainer(cfg, build_communicator(cfg), torch.float64)
    trainer.run()
    return trainer.replicas.params


def float32_mean_bound(rows: torch.Tensor) -> torch.Tensor:
    """Entry by entry, how far a float32 computation of `rows.mean(0)` (K rows) can be from the
    exact mean, whatever its order or tree: K − 1 additions and at most 4 divisions or
    multiplications by a rounded 1/size, each rounding by at most u = 2^-24 of a partial result
    whose share of the final mean is ≤ Σ|x_i|/K (to first order; Higham, Accuracy and Stability
    of Numerical Algorithms, §4.2). A bound derived from the values, not a fixed tolerance: two
    such computations in different orders (issue 33, class b) each stay within it."""
    k = rows.shape[0]
    u = torch.finfo(torch.float32).eps / 2
    return (k + 3) * u * rows.double().abs().sum(0) / k


# -- FP4 written out (tests/test_fp4.py, tests/test_codecs.py) ---------------------------------
FP4_FIELDS = {"e3m0": (3, 0, 3), "e2m1": (2, 1, 1)}  # exponent bits, mantissa bits, bias


def fp4_values(fmt: str) -> list[float]:
    """The 16 values of a 4-bit float s|e|m of `fmt`, by the IEEE rule for its fields (exponent
    0: subnormal 2^(1−bias)·m/2^M; else 2^(e−bias)·(1 + m/2^M); no infinity, no NaN): the value
    of code c at index c."""
    exponent_bits, mantissa_bits, bias = FP4_FIELDS[fmt]
    values = []
    for code in range(16):
        sign = -1.0 if code >> 3 else 1.0
        e, m = (code & 7) >> mantissa_bits, code & ((1 << mantissa_bits) - 1)
        if e == 0:
            values.append(sign * 2.0 ** (1 - bias) * m / 2**mantissa_bits)
        else:
            values.append(sign * 2.0 ** (e - bias) * (1 + m / 2**mantissa_bits))
    assert len({abs(v) for v in values}) == 8 and max(values) < 2 ** (2**exponent_bits)
    return values


def fp4_reference(
    v: torch.Tensor, fmt: str, bucket: int, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP4 of one chunk `v` (1-D fp32) by brute force: (codes, scales, decoded). Per bucket the
    scale s = fp32(max|v| / top), then y = |v|/s divided in fp32 as the codec's contract says
    (the one fp32 step; an all-zero bucket keeps y = 0) and in float64 from there: with `u`
    None, the magnitude nearest y among the format's eight (a tie: the larger); else the
    magnitudes lo ≤ y < hi around it and hi iff u < p, p = (y − lo)/(hi − lo) formed in fp32 as
    the contract says. Code: magnitude index + 8 if v < 0; decoded: fp32(value·s) (the float64
    product of two fp32 numbers with ≤ 2 significant bits is exact: one rounding)."""
    values = torch.tensor(fp4_values(fmt), dtype=torch.float64)
    mags = values[:8]
    codes = torch.empty(v.numel(), dtype=torch.long)
    scales = []
    for start in range(0, v.numel(), bucket):
        part = v[start : start + bucket]
        scale = torch.tensor(part.double().abs().max().item() / mags.max().item()).float()
        scales.append(scale)
        y32 = part.abs() / scale if scale > 0 else torch.zeros_like(part)
        y = y32.double()
        dist = (y[:, None] - mags[None, :]).abs()
        if u is None:
            nearest = dist == dist.min(1, keepdim=True).values
            index = (nearest * torch.arange(8)).max(1).values  # the largest of the nearest
        else:
            index = (y[:, None] >= mags[None, :]).sum(1) - 1
            lo, hi = mags[index], mags[(index + 1).clamp(max=7)]
            p = ((y32 - lo.float()) / (hi - lo).float()).double()
            p[index == 7] = 0.0
            index = index + (u[start : start + bucket].double() < p).long()
        codes[start : start + bucket] = index + 8 * (part < 0).long()
    scales = torch.stack(scales)
    per_entry = torch.repeat_interleave(scales.double(), bucket)[: v.numel()]
    return codes, scales, (values[codes] * per_entry).float()


def tiny_tanh_model() -> torch.nn.Module:
    """6 → 24 → 3 (tanh), float64, seeded: tensors of 144, 24, 72, 3 (the outer methods'
    from-paper reference tests)."""
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3)
    ).double()


def tiny_tanh_forward(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`tiny_tanh_model`'s output from its flat parameter vector (W1, b1, W2, b2), written on
    plain tensors (x @ W.T + b)."""
    w1, b1, w2, b2 = flat.split([144, 24, 72, 3])
    return torch.tanh(x @ w1.view(24, 6).T + b1) @ w2.view(3, 24).T + b2


def tiny_sgd_steps(
    flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, lr: float, steps: int
) -> torch.Tensor:
    """`steps` plain-SGD steps at `lr` of `tiny_tanh_forward`'s mean squared error on (x, y)
    from the flat parameters `flat`, written on plain tensors (autograd for the gradient)."""
    for _ in range(steps):
        leaf = flat.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(F.mse_loss(tiny_tanh_forward(leaf, x), y), leaf)
        flat = flat - lr * grad
    return flat


def tiny_local_sgd(workers: int, lr: float, period: int) -> tuple[torch.Tensor, Any, list, Any]:
    """The base an outer method's from-paper test wraps: `workers` replicas of
    `tiny_tanh_model` on a deterministic simulated 10 GbE communicator, each its own plain
    SGD at `lr`, under local SGD with H = `period`. Returns (the flat start vector, the
    replicas, the inner optimizers, the local SGD algorithm; its `comm` is the
    communicator)."""
    from dpresearch.algorithms.local_sgd import LocalSGD
    from dpresearch.comm.network import NetworkModel
    from dpresearch.replicas import Replicas

    model = tiny_tanh_model()
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = Replicas(model, workers, torch.device("cpu"))
    comm = SimulatedCommunicator(workers, NetworkModel.preset("10gbe"), deterministic=True)
    inner = [torch.optim.SGD(list(m.parameters()), lr=lr) for m in replicas.models]
    return start, replicas, inner, LocalSGD(replicas, comm, inner, period=period)


def train_on_shards(algorithm: Any, data: list, steps: int, per_epoch: int) -> None:
    """Drive `algorithm` as the trainer does for `steps` steps (`per_epoch` of them an epoch):
    each step its replica k's gradient of the mean squared error on `data[k]` (x, y), then
    `after_backward`."""
    algorithm.set_run_length(per_epoch, steps)
    replicas = algorithm.replicas
    for step in range(steps):
        replicas.grads.zero_()
        for m, (x, y) in zip(replicas.models, data, strict=True):
            F.mse_loss(m(x), y).backward()
        algorithm.after_backward(step)


def least_squares_shards(workers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per worker, 32 float64 samples (6 inputs, 3 targets) of its own, seeded."""
    gen = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(32, 6, generator=gen, dtype=torch.float64),
            torch.randn(32, 3, generator=gen, dtype=torch.float64),
        )
        for _ in range(workers)
    ]


SHAKESPEARE_WORKS = SHARED / "data" / "shakespeare" / "works"


def gpt_shakespeare_losses(run_dir: Path, *overrides: str) -> tuple[list[float], dict]:
    """A 100-step gpt_tiny run on the Shakespeare corpus (block 16, batch 8, lr 0.003, local
    SGD with H = 5) + `overrides` (the workers, the outer method), written to `run_dir`: its
    training losses (every 10 steps) and summary."""
    from dpresearch.train import train

    args = ["data=shakespeare", f"data.root={SHAKESPEARE_WORKS}", "model=gpt_tiny",
            "model.block_size=16", "data.eval_tokens=256", "data.sample_tokens=0",
            "train.batch_size=8", "train.progress=false", "backend.threads=1",
            "schedule.warmup_steps=5", "optimizer.lr=0.003", "train.steps=100",
            "train.log_every=10", "train.eval_every=100", "algorithm=local_sgd",
            "algorithm.period=5", *overrides]  # fmt: skip
    train(compose_config(*args), run_dir)
    losses = [m["train/loss"] for m in metric_lines(run_dir) if "train/loss" in m]
    return losses, json.loads((run_dir / "summary.json").read_text())


def reference_workers(cfg: DictConfig) -> tuple[Any, Any, int, torch.nn.Module, list, list]:
    """`reference_start` and, for a drifting method, K copies of the initial model and each
    copy's own inner optimizer of `cfg.optimizer`'s class and options."""
    data, partitioner, per_epoch, model = reference_start(cfg)
    workers = [copy.deepcopy(model) for _ in range(cfg.workers)]
    options = {n: v for n, v in cfg.optimizer.items() if not n.startswith(("_", "exclude"))}
    inner_class = getattr(torch.optim, cfg.optimizer._target_.rsplit(".", 1)[-1])
    inner = [inner_class(m.parameters(), **options) for m in workers]
    return data, partitioner, per_epoch, model, workers, inner
