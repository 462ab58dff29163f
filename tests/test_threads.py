"""Intra-op threads (issue 16, item 1): a simulated run takes 1 thread unless a worker's
forward is large enough to gain and cores are idle; processes and concurrent sweep/study jobs
divide the cores; `backend.threads` wins; the choice is printed once at the start and
recorded in summary.json."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import SMALL, compose_config

from dpresearch.launch import threads
from dpresearch.study import launcher
from dpresearch.train import train


@pytest.fixture
def two_idle_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "idle_cores", lambda window_s=0.2: 2.0)
    monkeypatch.delenv(threads.JOBS_ENV, raising=False)


def test_small_models_take_one_thread_and_say_why(two_idle_cores):
    cfg = compose_config(*SMALL)
    n, why = threads.choose(cfg, "cpu", 2e5)
    assert n == 1 and "below the 100 M from which a second thread gains" in why
    assert threads.choose(cfg, "cpu", None)[0] == 1  # unknown size: the safe choice


def test_a_large_model_takes_the_idle_cores_of_its_share(two_idle_cores, monkeypatch):
    cfg = compose_config(*SMALL)
    assert threads.choose(cfg, "cpu", 1e9) == (
        2,
        "2 cores ÷ 1 processes; 2.0 cores idle at the start",
    )
    monkeypatch.setattr(threads, "idle_cores", lambda window_s=0.2: 0.3)  # a busy machine
    assert threads.choose(cfg, "cpu", 1e9)[0] == 1
    monkeypatch.setenv(threads.JOBS_ENV, "2")  # two study jobs share the two cores
    monkeypatch.setattr(threads, "idle_cores", lambda window_s=0.2: 2.0)
    assert threads.choose(cfg, "cpu", 1e9)[0] == 1
    assert threads.choose(cfg, "cuda", 1e9) == (1, "a GPU run: the host only launches kernels")


def test_processes_and_jobs_divide_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    monkeypatch.delenv(threads.JOBS_ENV, raising=False)
    gloo = compose_config(*SMALL, "backend=gloo")
    assert threads.choose(gloo, "cpu", None, local_processes=4)[0] == 4
    monkeypatch.setenv(threads.JOBS_ENV, "2")
    assert threads.choose(gloo, "cpu", None, local_processes=4)[0] == 2
    assert threads.choose(gloo, "cpu", None, local_processes=32)[0] == 1
    fixed = compose_config(*SMALL, "backend=gloo", "backend.threads=3")
    assert threads.choose(fixed, "cpu", None, local_processes=4) == (3, "backend.threads")


def test_idle_cores_reads_the_machine():
    idle = threads.idle_cores(0.05)
    assert idle is None or 0.0 <= idle <= (os.cpu_count() or 1) + 1e-9


def test_the_study_harness_tells_its_jobs_how_many_run_at_once(monkeypatch):
    monkeypatch.delenv(threads.JOBS_ENV, raising=False)
    assert threads.JOBS_ENV not in launcher._popen_kwargs()["env"]
    assert launcher._popen_kwargs(3)["env"][threads.JOBS_ENV] == "3"


def test_a_run_prints_its_choice_once_and_records_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(threads.JOBS_ENV, raising=False)
    summary = train(compose_config(*SMALL, "train.steps=2", "train.progress=true"), tmp_path)
    out = capsys.readouterr().out
    assert out.count("threads: 1 (a worker's forward is") == 1
    assert summary["intra_op_threads"] == 1 == torch.get_num_threads()
    summary = train(
        compose_config(*SMALL, "train.steps=2", "backend.threads=2"), tmp_path / "fixed"
    )
    assert summary["intra_op_threads"] == 2
