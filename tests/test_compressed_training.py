"""Compressed synchronous training end to end (issue 4, acceptance C and D): every compressor
gives the same parameters simulated and on gloo processes; the DDP comm hook inside a plain
torch DDP program gives the parameters of our own `sync`."""

from __future__ import annotations

import pytest
import torch
from helpers import TOL, TOL64, compose_config, max_diff, run_ddp_many, run_ours, run_ours64
from omegaconf import OmegaConf

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.run.trainer import Trainer

# (compressor overrides, error feedback, tolerance with the default ring allreduce). gloo's
# ring adds in another order than the in-process sum: casts sum in 16 bits, so they agree only
# to the type's rounding; PowerSGD's orthogonalisation amplifies 1-ulp differences. With
# comm.deterministic=true (sums in worker order on every backend) casts and PowerSGD are
# bit-exact and every compressor is within 1e-6.
# These runs are float32 on purpose: the gloo side is the CLI (`train_on_gloo`, `run_ours`),
# which has no float64 switch. Class (b) of issue 33 (a ring against a sum in worker order)
# for the default reduction: its tolerances are the compressors' own rounding (16-bit casts:
# 2e-3 / 2e-2, ~4 ulps of fp16 / bf16 on parameters ~1) or 1e-5 / 1e-6 where a float32
# reordering is amplified or not; these are CPU-dependent and wait for a float64 switch in
# dpresearch (reported, not changed here). With comm.deterministic=true the sums are in
# worker order on both sides (class a): the casts and PowerSGD are exactly equal (0.0).
# Every run uses one torch thread per worker: matrix products round differently otherwise.
ONE_THREAD = "backend.threads=1"
CASES = {
    "identity": (["compressor=identity"], "none", TOL),
    "fp16": (["compressor=fp16"], "none", 2e-3),
    "bf16": (["compressor=bf16"], "none", 2e-2),
    "fp16_allgather": (["compressor=fp16", "algorithm.collective=allgather"], "none", TOL),
    "topk_exact": (["compressor=topk", "compressor.ratio=0.05"], "ef14", 1e-5),
    "topk_sampled": (
        ["compressor=topk", "compressor.ratio=0.05", "compressor.selection=sampled"],
        "ef14",
        TOL,
    ),
    "randomk": (["compressor=randomk", "compressor.ratio=0.05"], "ef14", 1e-5),
    "qsgd": (["compressor=qsgd"], "none", TOL),
    "sign": (["compressor=sign"], "ef14", 1e-5),
    "signum": (["compressor=signum"], "none", TOL),
    "terngrad": (["compressor=terngrad"], "none", TOL),
    "powersgd": (["compressor=powersgd", "compressor.min_compression_rate=1.1"], "ef14", 1e-5),
    "topk_ef21": (["compressor=topk", "compressor.ratio=0.05"], "ef21", TOL),
    "onebit": (["compressor=onebit", "compressor.per=column"], "ef14", 1e-5),
    "natural": (["compressor=natural"], "none", TOL),
    "threshold": (["compressor=threshold", "compressor.threshold=0.005"], "ef14", 1e-5),
    # the sketch's allreduce in worker order: a ring's rounding could reorder near-tied top-k
    "sketch": (["compressor=sketch", "compressor.ratio=0.05", "comm.deterministic=true"], "none",
               TOL),
}  # fmt: skip


def _args(name: str, deterministic: bool) -> tuple[str, ...]:
    overrides, ef, _ = CASES[name]
    extra = ("comm.deterministic=true",) if deterministic else ()
    return ("workers=4", *overrides, f"error_feedback={ef}", *extra, ONE_THREAD)


DETERMINISTIC = ["fp16", "bf16", "powersgd", "topk_exact"]


@pytest.mark.distributed
@pytest.mark.slow
def test_every_compressor_simulated_equals_gloo_in_one_process_group(small_config, tmp_path):
    """The default suite's form of the two parametrized tests below (slow: one launch per
    compressor): every compressor, and the deterministic reduction, trained on the same 4 gloo
    processes one configuration after another (`helpers.train_on_gloo`), each equal to its simulated
    run within its tolerance."""
    from helpers import BATCH, LR, SEED, STEPS, train_on_gloo

    jobs = [(name, False) for name in CASES] + [(name, True) for name in DETERMINISTIC]
    common = (f"seed={SEED}", f"optimizer.lr={LR}", f"train.steps={STEPS}",
              f"train.batch_size={BATCH}", "backend=gloo")  # fmt: skip
    gloo = train_on_gloo(
        4,
        [(small_config(*common, *_args(n, d)), tmp_path / f"gloo-{n}-{d}") for n, d in jobs],
    )
    initial = run_ours(small_config, tmp_path, "init", "workers=4", "train.steps=1")
    for (name, deterministic), theirs in zip(jobs, gloo, strict=True):
        simulated = run_ours(small_config, tmp_path, f"sim-{name}-{deterministic}",
                             *_args(name, deterministic))  # fmt: skip
        assert max_diff(simulated, initial) > 1e-3
        if not deterministic:
            tol = CASES[name][2]
        else:
            tol = 0.0 if name in ("fp16", "bf16", "powersgd") else TOL
        assert max_diff(simulated, theirs) <= tol, (name, deterministic)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_every_compressor_simulated_equals_gloo(small_config, tmp_path, name):
    overrides, ef, tol = CASES[name]
    args = ("workers=4", *overrides, f"error_feedback={ef}", ONE_THREAD)
    simulated = run_ours(small_config, tmp_path, "sim", *args)
    gloo = run_ours(small_config, tmp_path, "gloo", *args, "backend=gloo")
    initial = run_ours(small_config, tmp_path, "init", "workers=4", "train.steps=1")
    assert max_diff(simulated, initial) > 1e-3
    assert max_diff(simulated, gloo) <= tol


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_reduction_brings_every_compressor_within_tolerance(
    small_config, tmp_path, name
):
    """Worker-order sums make the collectives bit-exact: casts and PowerSGD agree exactly;
    top-k's decode adds coordinates chosen by several workers in its own order (within 1e-6)."""
    overrides, ef, _ = CASES[name]
    args = ("workers=4", *overrides, f"error_feedback={ef}", "comm.deterministic=true", ONE_THREAD)
    simulated = run_ours(small_config, tmp_path, "sim", *args)
    gloo = run_ours(small_config, tmp_path, "gloo", *args, "backend=gloo")
    assert max_diff(simulated, gloo) <= (0.0 if name in ("fp16", "bf16", "powersgd") else TOL)


def test_identity_compression_is_the_plain_allreduce(small_config):
    """Identity through the compressor path reproduces the spine exactly: one allreduce of
    the whole gradient row per step, D·4 bytes."""
    cfg = small_config("workers=4", "train.steps=5")
    trainer = Trainer(
        cfg, SimulatedCommunicator(4, NetworkModel.preset("10gbe")), torch.device("cpu"), None
    )
    assert trainer.algorithm.reducer.passthrough
    trainer.run()
    assert trainer.comm.ledger.op_counts == {"allreduce": 5}
    assert trainer.comm.ledger.bytes_sent == 5 * trainer.replicas.num_params * 4


@pytest.mark.parametrize("name", ["topk_exact", "sign", "powersgd", "qsgd"])
def test_recorded_bytes_match_the_reducer_formula(small_config, name):
    overrides, ef, _ = CASES[name]
    cfg = small_config("workers=4", "train.steps=3", *overrides, f"error_feedback={ef}")
    trainer = Trainer(
        cfg, SimulatedCommunicator(4, NetworkModel.preset("10gbe")), torch.device("cpu"), None
    )
    assert not trainer.algorithm.reducer.passthrough
    trainer.run()
    per_step = trainer.algorithm.reducer.payload_bytes()
    assert trainer.comm.ledger.bytes_sent == 3 * per_step
    assert per_step < trainer.replicas.num_params * 4


HOOKED = [("topk", "ef14"), ("qsgd", "none"), ("powersgd", "ef14"), ("randomk", "ef14")]
# QSGD asks torch for float32 norms of its buckets (dpresearch/compress/qsgd.py: vector_norm
# with dtype=float32), which torch refuses for float64 rows: it stays in float32 at TOL (class
# b, a CPU-dependent rounding budget) until the codec takes float64 rows.
FLOAT32_ONLY: set[str] = set()


def _hook_overrides(compressor: str, ef: str) -> list[str]:
    overrides = [f"compressor={compressor}", f"error_feedback={ef}"]
    if compressor in ("topk", "randomk"):
        overrides.append("compressor.ratio=0.05")
    if compressor == "powersgd":
        overrides.append("compressor.min_compression_rate=1.1")
    return overrides


@pytest.fixture(scope="module")
def hooked_ddp(tmp_path_factory) -> dict[str, dict]:
    """Torch DDP with our hook for every case of HOOKED, on the same two gloo processes."""
    variants = {}
    for compressor, ef in HOOKED:
        cfg = compose_config(*_hook_overrides(compressor, ef))
        hook = {
            "compressor": OmegaConf.to_container(cfg.compressor),
            "error_feedback": OmegaConf.to_container(cfg.error_feedback),
        }
        dtype = torch.float32 if compressor in FLOAT32_ONLY else torch.float64
        variants[f"{compressor}-{ef}"] = {"hook": hook, "dtype": dtype}
    return run_ddp_many(2, variants, str(tmp_path_factory.mktemp("hooked")))


@pytest.mark.distributed
@pytest.mark.parametrize("compressor,ef", HOOKED)
def test_ddp_comm_hook_matches_our_sync(small_config, tmp_path, compressor, ef, hooked_ddp):
    """Acceptance D: torch DDP + our hook (2 gloo ranks) = our own sync, same compressor/EF.
    DDP's bucketed allreduce and our sum are different computations of the same mean (class
    b of issue 33): both in float64, to 1e-9."""
    overrides = _hook_overrides(compressor, ef)
    theirs = hooked_ddp[f"{compressor}-{ef}"]
    if compressor in FLOAT32_ONLY:
        ours = run_ours(small_config, tmp_path, "ours", "workers=2", *overrides, ONE_THREAD)
        assert max_diff(ours, theirs) <= TOL
        return
    ours, _ = run_ours64(small_config, "workers=2", *overrides, ONE_THREAD)
    assert next(iter(theirs.values())).dtype == torch.float64
    assert max_diff(ours, theirs) <= TOL64
