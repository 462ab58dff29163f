"""What a checkpoint holds and how a run is put back from one.

A checkpoint is one file (`dpresearch/run/checkpoint_files.py` moves the files): a header naming the
run it belongs to (workers, processes, algorithm, parameter count, step), the loop's own
position (`LoopState`) and every process's part of the run (`Run.state_dict`: replicas,
optimizers, algorithm, data cursors and augmentation generators, ledger, random streams),
gathered by the main process. Compressor randomness needs no state: it is seeded by (seed,
worker, chunk, step). A resumed run restores all of it and continues bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dpresearch.algorithms.base import Verdict
from dpresearch.algorithms.outer import algorithm_name
from dpresearch.run.build import Run
from dpresearch.run.checkpoint_files import (
    FORMAT,
    CheckpointError,
    find_resume,
    incompatibility,
    load_checkpoint,
    to_cpu,
    write_checkpoint,
)
from dpresearch.run.loop import Hook, LoopState


class Checkpoints(Hook):
    """Writes `run`'s checkpoints into `run_dir` (None: nowhere) when the step's verdict says so
    (every `train.checkpoint_every` steps; a stop request's final one is written by the caller,
    `save`) and resumes from the one `train.resume` names."""

    def __init__(self, run: Run, state: LoopState, run_dir: Path | None) -> None:
        self.run, self.state, self.run_dir = run, state, run_dir
        self.keep = run.cfg.train.checkpoint_keep

    def after_step(self, done: int, verdict: Verdict) -> None:
        # (a stop request ends the run with its own checkpoint of this step)
        if verdict.checkpoint and not verdict.signum:
            self.save(done)

    def facts(self) -> dict[str, Any]:
        """The header facts a checkpoint must share with the run resuming it."""
        run = self.run
        return {
            "workers": run.cfg.workers,
            "processes": run.processes,
            "algorithm": algorithm_name(run.cfg),
            "num_params": run.replicas.num_params,
            "vocabulary": run.data.facts().get("data/vocab_fingerprint"),
        }

    def save(self, done: int) -> Path | None:
        """Write a checkpoint taken after step `done` (a collective: every process calls it;
        the main process gathers every process's state and writes one file); returns its path
        on the main process, None elsewhere."""
        run = self.run
        state = run.state_dict()
        every = run.comm.gather_objects(to_cpu(state) if run.processes > 1 else state)
        if self.run_dir is None or every is None:
            return None
        payload = {
            "format": FORMAT,
            "step": done,
            **self.facts(),
            # what `resume.check_resume` compares a resuming run's configuration with
            "config": OmegaConf.to_container(run.cfg, resolve=True),
            "loop": self.state.state_dict(),
            "states": every,
            # where the run's first weights came from (train.init_from), for its summary
            "init_from": run.setup.get("init_from"),
        }
        return write_checkpoint(self.run_dir, done, payload, self.keep)

    def resume(self, resume: str) -> int:
        """Find and load `resume`'s checkpoint (main process), hand every process its part,
        restore it; returns the step the run continues after (0: nothing to resume, a fresh
        start). Raises `CheckpointError` (on every process) for one that cannot continue this
        run."""
        run = self.run
        payload: list[Any] | None = None
        if run.comm.is_main_process:
            try:
                path = find_resume(resume, self.run_dir)
                file = load_checkpoint(path) if path is not None else None
                problem = incompatibility(file, path, self.facts()) if file is not None else None
            except CheckpointError as exc:
                problem, file = str(exc), None
            if problem is not None:
                payload = [("error", problem)] * run.processes
            elif file is None:
                payload = [None] * run.processes
            elif file["step"] >= run.total_steps:  # (train.resume_allow_changes let it by)
                problem = (
                    f"checkpoint {path} is at step {file['step']}, past this run's "
                    f"{run.total_steps} steps: nothing is left to train"
                )
                payload = [("error", problem)] * run.processes
            else:
                payload = [("state", file["loop"], file["step"], st) for st in file["states"]]
                if file.get("init_from") is not None:  # (not the source as it is now)
                    run.setup["init_from"] = file["init_from"]
        mine = run.comm.scatter_objects(payload)
        if mine is None:
            return 0
        if mine[0] == "error":
            raise CheckpointError(mine[1])
        _, loop, step, state = mine
        run.load_state_dict(state)
        self.state.load_state_dict(loop, step)
        return step
