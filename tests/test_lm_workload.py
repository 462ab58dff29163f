"""The language-model workload end to end: a GPT trained on the Shakespeare corpus.

The framework's guarantees hold for it as for the image and vector models: simulated workers
and gloo processes give the same parameters (AdamW, DiLoCo, Muon); a run killed after a
checkpoint and resumed equals the uninterrupted run bit for bit; a checkpoint never continues
on another vocabulary; batched workers compute as the loop; bf16 autocast and torch DDP with
the compressed communication hook run it; and a small GPT learns (the acceptance run, slow).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    SHARED,
    compose_config,
    final_params,
    kill_9_and_resume,
    max_diff,
    metric_lines,
    run_cli,
    same,
    untimed,
)

from dpresearch.config.preflight import preflight
from dpresearch.config.validate import ConfigError
from dpresearch.run.checkpoint_files import latest_checkpoint, read_header
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

WORKS = SHARED / "data" / "shakespeare" / "works"
pytestmark = pytest.mark.skipif(not WORKS.is_dir(), reason=f"no Shakespeare corpus at {WORKS}")

TOL = 1e-6
# gpt_tiny on 16-token windows, 2 workers × 8 windows; a 4-step warm-up so that a few steps
# move the parameters (the language-model defaults otherwise: AdamW, warm-up + cosine).
LM = [
    "data=shakespeare", f"data.root={WORKS}", "model=gpt_tiny", "model.block_size=16",
    "data.eval_tokens=256", "data.sample_tokens=20", "schedule.warmup_steps=4", "workers=2",
    "train.batch_size=8", "train.progress=false", "backend.threads=1",
]  # fmt: skip
DILOCO = ["algorithm=local_sgd", "algorithm.period=4", "outer=nesterov"]
# The methods of issue 30 too: SparseLoCo (DiLoCo's round, the error-feedback accumulator and
# 2-bit chunk-wise top-k), DeMo (algorithm=demo: its own optimizer) and SPARTA (5 % of the
# entries averaged every step, so that 12 steps of gpt_tiny reach many of them). And DiLoCo
# with dropout on the per-worker stream (`model.dropout_stream=worker`, the default): each
# worker's masks from its own generator, so one process or two draw the same.
DROPOUT = ["model.dropout=0.1"]
GLOBAL = [*DROPOUT, "model.dropout_stream=global"]  # torch's generator, as nanoGPT
CASES = {
    "adamw": [], "diloco": DILOCO, "muon": ["optimizer=muon"],
    "diloco_dropout": [*DILOCO, *DROPOUT],
    "sparseloco": ["algorithm=local_sgd", "algorithm.period=4", "outer=sparseloco"],
    "demo": ["algorithm=demo", "optimizer.lr=1e-3"],
    "sparta": ["algorithm=sparta", "algorithm.p=0.05"],
}  # fmt: skip


# -- 1. simulated ≡ gloo ------------------------------------------------------------------------
EQUIV = [*LM, "train.steps=12", "train.log_every=4"]


@pytest.fixture(scope="module")
def on_gloo(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Every case trained on the same 2 gloo processes, one after another
    (`helpers.train_on_gloo`: one process start for all); the final parameters by case."""
    from helpers import train_on_gloo

    folder = tmp_path_factory.mktemp("lm-gloo")
    jobs = [
        (compose_config(*EQUIV, *args, "backend=gloo"), folder / name)
        for name, args in CASES.items()
    ]
    return dict(zip(CASES, train_on_gloo(2, jobs), strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_simulated_equals_gloo(case, tmp_path, on_gloo, one_thread):
    """2 simulated workers and 2 gloo processes end with the same GPT parameters (float64 of
    the saved tensors to 1e-6) for AdamW, DiLoCo (local AdamW + outer Nesterov every 4 steps),
    Muon, SparseLoCo, DeMo and SPARTA, and DiLoCo with dropout: the text partition, the windows
    drawn, the dropout masks, the tied head and the optimizers are the same functions of the
    seed in one process and in two."""
    simulated = tmp_path / "sim"
    train(compose_config(*EQUIV, *CASES[case]), simulated)
    initial = tmp_path / "init"
    train(compose_config(*EQUIV, *CASES[case], "train.steps=1"), initial)
    assert max_diff(final_params(simulated), final_params(initial)) > 1e-3  # it trained
    gap = max_diff(final_params(simulated), on_gloo[case])
    print(f"{case}: simulated vs gloo max |Δ| = {gap:.3g}")
    # float32 (the CLI on both sides; it has no float64 switch): with 2 workers every sum is
    # of two values, the same in any order, so the same computation in the same order (issue
    # 33, class a), exact on any CPU that runs both; TOL is a margin, not a rounding budget
    assert gap <= TOL


# -- 2. killed and resumed ≡ uninterrupted ----------------------------------------------------
STEPS, KILL_AT, EVERY = 24, 14, 5
QUICK = [*LM, f"train.steps={STEPS}", "train.log_every=1", "train.eval_every=12"]


def check_killed_and_resumed(tmp_path: Path, args: list[str], failure: type[BaseException]) -> None:
    """Run `args` with a checkpoint every `EVERY` steps until a worker fails at step
    `KILL_AT`, resume with `train.resume=auto`: the parameters equal the uninterrupted run's
    bit for bit, and its metrics lines too (timings aside), each step once."""
    reference = tmp_path / "reference"
    train(compose_config(*args), reference)
    run_dir = tmp_path / "resumed"
    every = [f"train.checkpoint_every={EVERY}"]
    cfg = compose_config(*args, *every, "debug.fail_worker=1", f"debug.fail_at_step={KILL_AT}")
    with pytest.raises(failure):
        train(cfg, run_dir)
    saved = KILL_AT // EVERY * EVERY
    assert latest_checkpoint(run_dir).name == f"step_{saved}.pt"
    assert not (run_dir / "summary.json").exists()
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert json.loads(before[-1])["step"] == KILL_AT  # logged past the checkpoint
    summary = train(compose_config(*args, *every, "train.resume=auto"), run_dir)
    assert summary["status"] == "finished"
    after = (run_dir / "metrics.jsonl").read_text().splitlines()
    kept = [ln for ln in before if json.loads(ln)["step"] <= saved]
    assert after[: len(kept)] == kept  # continued from the checkpoint, not started over
    assert same(final_params(run_dir), final_params(reference))
    lines, ref_lines = metric_lines(run_dir), metric_lines(reference)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert [untimed(m) for m in lines] == [untimed(m) for m in ref_lines]
    assert "test/bpc" in lines[-1] and "tokens" in lines[-1]
    assert (run_dir / "sample.txt").read_text() == (reference / "sample.txt").read_text()


@pytest.mark.parametrize("case", list(CASES))
def test_killed_and_resumed_equals_uninterrupted_simulated(case, tmp_path, one_thread):
    """Sync AdamW, DiLoCo (the checkpoint at step 10 falls inside an outer period: inner
    progress and the outer momentum are in it) and Muon (its momentum buffers), on 2 simulated
    workers."""
    check_killed_and_resumed(tmp_path, [*QUICK, *CASES[case]], InjectedFailure)


@pytest.mark.slow
@pytest.mark.distributed
def test_killed_and_resumed_equals_uninterrupted_gloo(tmp_path):
    """DiLoCo on 2 gloo processes: a worker process dies at step 14; the launcher's failure,
    then `train.resume=auto`, ends with the uninterrupted (simulated ≡ gloo) run's
    parameters."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    check_killed_and_resumed(tmp_path, [*QUICK, *DILOCO, "backend=gloo"], ChildFailedError)


@pytest.mark.parametrize(
    "case",
    ["adamw", *(pytest.param(c, marks=pytest.mark.slow) for c in CASES if c != "adamw")],
)
def test_kill_9_then_resume_equals_uninterrupted(case, tmp_path):
    """A real SIGKILL of a command-line GPT run after its first checkpoint (AdamW; DiLoCo, Muon,
    SparseLoCo, DeMo and SPARTA in the slow suite): the resumed run (`train.resume=auto`) ends
    as an uninterrupted one, parameters bit for bit and metrics line for line, its sample the
    same text."""
    args = [
        *LM,
        *CASES[case],
        "train.steps=200",
        "train.log_every=1",
        "train.eval_every=100",
        "train.checkpoint_every=10",
    ]
    run_dir, reference = kill_9_and_resume(args, tmp_path, kill_after=25)
    assert same(final_params(run_dir), final_params(reference))
    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, 201))
    assert [untimed(m) for m in lines] == [untimed(m) for m in metric_lines(reference)]
    assert (run_dir / "sample.txt").read_text() == (reference / "sample.txt").read_text()


# -- 3. another vocabulary --------------------------------------------------------------------
def test_resume_on_another_vocabulary_is_one_line_before_any_worker(tmp_path):
    """A checkpoint records its vocabulary's fingerprint: resuming it with byte tokens (or on
    a corpus of other characters: `data.root` is not part of the trajectory, so only the
    vocabulary check can catch it) is one `error:` line, exit 2, the run directory untouched."""
    run_dir = tmp_path / "run"
    args = [*LM, "train.steps=6", "train.checkpoint_every=3", f"hydra.run.dir={run_dir}"]
    with pytest.raises(InjectedFailure):
        train(compose_config(*args[:-1], "debug.fail_worker=0", "debug.fail_at_step=4"), run_dir)
    fingerprint = preflight(compose_config(*args[:-1])).facts()["data/vocab_fingerprint"]
    assert read_header(latest_checkpoint(run_dir))["vocabulary"] == fingerprint
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = tmp_path / "other.txt"
    other.write_text("abc def\n" * 400)  # another character set
    text = [a for a in args if not a.startswith("data=")]
    for changed in ([*args, "data.tokenizer=byte"], ["data=text", *text, f"data.root={other}"]):
        out = run_cli([*changed, "train.resume=auto"], cwd=tmp_path)
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert out.returncode == 2, out.stderr[-3000:]
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        assert "was trained on another vocabulary" in lines[0], lines[0]
        assert "data.tokenizer" in lines[0]
        assert "error" not in out.stdout
        after = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        assert after == before  # nothing written, no worker started


# -- 4. batched workers -----------------------------------------------------------------------
def rows_after(*overrides: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The parameter rows after a simulated float64 run of `overrides` with
    `train.batched_workers=mode`, the rows before it, and the compute object."""
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.run.build import network_model
    from dpresearch.run.trainer import Trainer

    cfg = compose_config(*overrides, f"train.batched_workers={mode}", "train.save_model=false")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        trainer = Trainer(
            cfg, SimulatedCommunicator(cfg.workers, network_model(cfg)), torch.device("cpu"), None
        )
    finally:
        torch.set_default_dtype(default)
    assert trainer.replicas.params.dtype == torch.float64
    initial = trainer.replicas.params.clone()
    trainer.run()
    return trainer.replicas.params, initial, trainer.compute


# torch has no batching rule for CPU flash attention: vmap runs it row by row (correct, slower)
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
@pytest.mark.parametrize("case", ["adamw", "diloco"])
def test_batched_workers_equal_the_loop_in_float64(case, one_thread):
    """gpt_tiny (no dropout) on 2 simulated workers: one vmapped forward/backward over the
    stacked parameter rows gives the loop's parameters after 10 steps, in float64 to 1e-10
    (batched kernels only add in another order)."""
    args = [*LM, "train.steps=10", *CASES[case]]
    loop, initial, loop_compute = rows_after(*args, mode="false")
    batched, _, batched_compute = rows_after(*args, mode="true")
    assert loop_compute.batched is None and batched_compute.batched is not None
    assert (loop - initial).abs().max() > 1e-3  # it trained
    gap = (loop - batched).abs().max().item()
    print(f"{case}: batched vs loop max |Δ| = {gap:.3g}")
    assert gap <= 1e-10


@pytest.mark.parametrize("case", ["adamw", "diloco"])
def test_stacked_workers_with_dropout_equal_the_loop_in_float64(case, one_thread):
    """gpt_tiny with dropout 0.1 on the per-worker stream, 2 simulated workers: stacked (each
    row's masks from its worker's generator, site by site) gives the loop's parameters after
    10 steps, in float64 to 1e-10 as without dropout (the stacked kernels round a few ulps
    otherwise; the masks themselves: `tests/test_dropout_stream.py`); dropout moved them."""
    from dpresearch.run.stacked import StackedWorkers

    args = [*LM, "train.steps=10", *CASES[case], *DROPOUT]
    loop, initial, _ = rows_after(*args, mode="false")
    stacked, _, compute = rows_after(*args, mode="stacked")
    assert isinstance(compute.batched, StackedWorkers)
    without, _, _ = rows_after(*LM, "train.steps=10", *CASES[case], mode="false")
    assert (loop - without).abs().max() > 1e-3  # the masks changed the trajectory
    gap = (loop - stacked).abs().max().item()
    print(f"{case} with dropout: stacked vs loop max |Δ| = {gap:.3g}")
    assert gap <= 1e-10


# -- 5. bf16 autocast, the DDP communication hook ----------------------------------------------
def test_bf16_autocast_trains_the_gpt(tmp_path):
    """`train.autocast=bf16` on the CPU: the GPT's forward and backward under autocast, a
    finite training loss and finite bits per character, the loss going down."""
    summary = train(
        compose_config(*LM, "train.steps=20", "train.log_every=5", "train.autocast=bf16"),
        tmp_path / "run",
    )
    lines = metric_lines(tmp_path / "run")
    assert all(math.isfinite(m["train/loss"]) for m in lines)
    assert math.isfinite(summary["test/bpc"]) and summary["test/bpc"] > 0
    assert lines[-1]["train/loss"] < lines[0]["train/loss"]


VOCAB, T, HOOK_STEPS, HOOK_LR = 11, 8, 4, 0.1


def tiny_gpt():
    """Float64: DDP (per-tensor SGD, its buckets) and the reducer on flat rows are different
    computations of the same training (issue 33, class b), compared to 1e-9."""
    from dpresearch.models.gpt import GPT

    torch.manual_seed(3)
    return GPT(VOCAB, (T,), n_layer=1, n_head=2, n_embd=16, block_size=T).double()


def token_batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + worker)
    x = torch.randint(0, VOCAB, (4, T + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def hook_compressor():
    from dpresearch.compress import TopK

    return TopK(ratio=0.1, seed=3)


def ddp_gpt_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: a DDP GPT with the TopK + EF14 communication hook, plain SGD."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dpresearch.compress import make_comm_hook
    from dpresearch.launch.processes import leave_together

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ddp = DistributedDataParallel(tiny_gpt())
        state, hook = make_comm_hook(hook_compressor(), ddp, error_feedback={"mode": "ef14"})
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=HOOK_LR)
        for step in range(HOOK_STEPS):
            opt.zero_grad()
            lm_loss(ddp, *token_batch(rank, step)).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        torch.save((flat, state.comm.ledger.bytes_sent), Path(out_dir) / f"rank{rank}.pt")
        del ddp, state, hook, opt  # the reducer goes while the group is alive
        gc.collect()
    finally:
        leave_together()


@pytest.mark.distributed
def test_ddp_hook_trains_the_gpt_as_the_simulated_reducer(tmp_path, one_thread):
    """torch DDP + the compressed hook (TopK + EF14) on 2 gloo ranks = `CompressedReducer` on 2
    simulated workers for the GPT, whose output head is tied to its token embedding (one
    parameter, one chunk, one error-feedback column range)."""
    from helpers import free_port, spawn_sequence

    from dpresearch.comm.network import NetworkModel
    from dpresearch.comm.simulated import SimulatedCommunicator
    from dpresearch.compress import CompressedReducer, ErrorFeedback, param_layout
    from dpresearch.replicas import Replicas

    spawn_sequence(2, [(ddp_gpt_rank, (2, free_port(), str(tmp_path)))])
    model = tiny_gpt()
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = Replicas(model, 2, torch.device("cpu"))
    comm = SimulatedCommunicator(2, NetworkModel.preset("10gbe"))
    reducer = CompressedReducer(
        hook_compressor(),
        comm,
        param_layout(model),
        ErrorFeedback(mode="ef14"),
        granularity="tensor",
        dtype=torch.float64,
    )
    for step in range(HOOK_STEPS):
        replicas.zero_grad()
        for w, replica in enumerate(replicas.models):
            lm_loss(replica, *token_batch(w, step)).backward()
        reducer.reduce(replicas.grads, step)
        with torch.no_grad():
            replicas.params.sub_(HOOK_LR * replicas.grads)
    assert replicas.params.shape[1] == start.numel()  # the tied head counted once
    assert not torch.equal(replicas.params[0], start)
    for rank in range(2):
        params, sent = torch.load(tmp_path / f"rank{rank}.pt")
        assert sent == comm.ledger.bytes_sent
        assert params.dtype == torch.float64
        assert (params - replicas.params[0]).abs().max() <= 1e-9


# -- 6. acceptance -----------------------------------------------------------------------------
@pytest.mark.slow
def test_small_gpt_learns_shakespeare(tmp_path):
    """Acceptance: a 2-layer, 64-wide GPT on 64-character windows, 4 simulated workers, 300
    steps of the defaults (AdamW, 100 warm-up steps, cosine) reaches test/bpc <= 4.0 (the
    characters' unigram entropy is 4.80 bits: the model uses context) and writes a sample."""
    run_dir = tmp_path / "run"
    summary = train(
        compose_config(
            "data=shakespeare",
            f"data.root={WORKS}",
            "model=gpt",
            "model.n_layer=2",
            "model.n_head=2",
            "model.n_embd=64",
            "model.block_size=64",
            "train.steps=300",
            "train.progress=false",
        ),
        run_dir,
    )
    on_disk = json.loads((run_dir / "summary.json").read_text())
    print(f"test/bpc {on_disk['test/bpc']:.3f}, val/bpc {on_disk['val/bpc']:.3f}")
    assert on_disk["status"] == "finished" and on_disk["test/bpc"] == summary["test/bpc"]
    assert on_disk["test/bpc"] <= 4.0
    assert on_disk["data/unigram_bits_per_char"] == pytest.approx(4.80, abs=0.01)
    assert on_disk["data/vocab_size"] == 84 and on_disk["workers_compute"]
    assert (run_dir / "sample.txt").read_text().strip()


# -- the bad inputs the workload adds ----------------------------------------------------------
def test_batched_workers_with_dropout_is_one_line(tmp_path, monkeypatch, capsys):
    """`train.batched_workers=true` with a GPT whose dropout draws from torch's global
    generator (`model.dropout_stream=global`): one `error:` line through the entry point
    naming the stream that runs stacked, exit 2, nothing written."""
    import dpresearch.train as entry
    from dpresearch.launch.provenance import COMMAND_ENV

    def hydra_started() -> None:
        raise AssertionError("the checks passed: this input was accepted")

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(COMMAND_ENV, raising=False)
    monkeypatch.setattr(entry, "_hydra_main", hydra_started)
    args = [*LM, *GLOBAL, "train.batched_workers=true", f"hydra.run.dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", ["dpresearch.train", *args])
    with pytest.raises(SystemExit) as stopped:
        entry.main()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert stopped.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "train.batched_workers=true but model GPT cannot" in lines[0], lines[0]
    assert "random numbers" in lines[0], lines[0]
    assert "model.dropout_stream=worker runs stacked" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="random numbers"):
        preflight(compose_config(*LM, *GLOBAL, "train.batched_workers=true"))
    # the vmapped ensemble draws no stream: refused with either
    with pytest.raises(ConfigError, match="random numbers"):
        preflight(compose_config(*LM, *DROPOUT, "train.batched_workers=vmap"))
