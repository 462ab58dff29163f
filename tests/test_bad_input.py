"""Every bad input ends in one `error:` line, exit status 2, before anything is written
(issue 9, acceptance B).

Each row runs the entry point's own `main()` in this process (the checks it makes before Hydra
starts are the whole story for a bad input: compose, preflight, claim the run directory); a few
rows also go through the real command line in a subprocess, gloo included.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from helpers import SHARED, SMALL, SYNTHETIC_SMALL, compose_config, run_cli, run_main

from dpresearch.config.validate import ConfigError, validate

SUBSET = SHARED / "data" / "cifar10-subset"

# (overrides, a fragment the error line must hold). "{tmp}" is the test's own directory.
SHAKESPEARE = SHARED / "data" / "shakespeare" / "works"
TEXT = ["data=shakespeare", f"data.root={SHAKESPEARE}", "model=gpt_tiny"]
NODE_SYNC = ["algorithm=node_sync", "comm.hierarchy.workers_per_node=2", "outer=nesterov",
             "outer.period=4"]  # fmt: skip
BAD = [
    # The 20 that gave tracebacks (issue 9, "Why").
    (["data.partition=foo"], "data.partition=foo; choose one of: iid, dirichlet"),
    (["data.partition=dirichlet", "data.alpha=0"], "data.alpha=0: the Dirichlet concentration"),
    (["data.alpha=0"], "data.alpha=0"),
    (["data.alpha=-1.5", "data.partition=dirichlet"], "data.alpha=-1.5"),
    (["workers=500"], "larger than the 0 examples each of 500 workers holds"),
    (["workers=16"], "the 16 examples each of 16 workers holds (256 in all)"),
    (["optimizer.lr=-1"], "optimizer.lr=-1: must be a number >= 0"),
    (["optimizer=adam", "optimizer.lr=-0.001"], "optimizer.lr=-0.001"),
    (["optimizer.momentum=-0.5"], "optimizer.momentum=-0.5"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay=-1"),
    (["optimizer=adamw", "optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1"),
    (["optimizer=adam", "optimizer.betas=[1.5,0.9]"], "optimizer.betas=[1.5,0.9]: must be two"),
    (["optimizer=adam", "optimizer.betas=[0.9]"], "optimizer.betas=[0.9]"),
    (["optimizer=adamw", "optimizer.betas=[0.9,1.0]"], "optimizer.betas=[0.9,1.0]"),
    (["train.eval_batch_size=0"], "train.eval_batch_size=0: must be at least 1"),
    (["train.eval_bn_stats=avg"], "train.eval_bn_stats=avg; choose one of: consensus, average"),
    (["train.eval_bn_stats=average"], "add algorithm.buffers=local"),
    (["backend.threads=-1"], "backend.threads=-1: must be at least 1"),
    (["backend.timeout_s=0"], "backend.timeout_s=0.0: must be > 0"),
    (["backend.start_method=fork"], "backend.start_method=fork; choose one of: forkserver, spawn"),
    (["schedule=step", "schedule.milestones=abc"], "schedule.milestones=abc: must be a list"),
    (["optimizer.lr=fast"], "optimizer.lr=fast: must be a number"),
    (["model=resnet20"], "cannot take this data set's inputs of shape (32,)"),
    (["model=vgg11"], "cannot take this data set's inputs"),
    (["hydra.run.dir=/proc/dpresearch-run"], "hydra.run.dir=/proc/dpresearch-run cannot be"),
    (["hydra.run.dir={tmp}/a-file/run"], "cannot be written"),
    # Silently accepted before.
    (["train.stepz=5"], "did you mean train.steps?"),
    (["+train.stepz=5"], "train.stepz is not a config key; did you mean train.steps?"),
    (["train.eval_every=-1"], "train.eval_every=-1: must be at least 1"),
    (["train.eval_every=0"], "train.eval_every=0"),
    (["model.hidden=[0]"], "model.hidden=[0]: every hidden width"),
    (["model.hidden=[16,-3]"], "model.hidden=[16, -3]"),
    (["train.steps=5", "train.epochs=3"], "are both given; pass one"),
    # Others found on the way.
    (["optimizer.nesterov=true"], "optimizer: Nesterov momentum requires a momentum"),
    (["schedule=cosine", "schedule.final=abc"], "schedule: unsupported operand"),
    (["schedule=step", "schedule.gamma=-1"], "schedule.gamma=-1"),
    (["backend.heartbeat_s=0"], "backend.heartbeat_s=0"),
    (["+model.widht=3"], "model.widht is not an option of dpresearch.models.mlp.MLP"),
    (["model.widht=3"], "valid options: batch_norm, hidden"),
    (["optimizer.momentun=0.9"], "did you mean optimizer.momentum?"),
    (["workerz=2"], "workerz is not a config key; did you mean workers?"),
    (["-m", "seed=0,1", "--cfg", "hydra"], "--cfg and -m cannot be combined"),
    # Held before, and must keep holding.
    (["algorithm=foo"], "algorithm=foo is not an option; choose one of:"),
    (["not_a_key=1"], "not_a_key is not a config key"),
    (["workers=0"], "set workers=1 or more"),
    (["workers=abc"], "could not be converted to Integer"),
    (["train.lr_scaling=quadratic"], "choose one of: none, linear"),
    (["train.batch_size=0"], "train.batch_size=0: must be at least 1"),
    (["train.steps=0"], "train.steps=0: must be at least 1"),
    (["train.log_every=0"], "train.log_every=0"),
    (["train.autocast=fp8"], "train.autocast=fp8"),
    (["train.device=tpu"], "train.device=tpu: use auto, cpu or cuda"),
    (["logger.mode=sometimes"], "logger.mode=sometimes"),
    (["comm.reduction=tree"], "comm.reduction=tree"),
    (["network=custom", "network.bandwidth_gbit=0"], "network.bandwidth_gbit must be > 0"),
    (["network.allgather_latency_us=-5"], "network.allgather_latency_us=-5.0: must be >= 0"),
    (["algorithm=local_sgd", "compressor=topk"], "does not use compressor/error_feedback"),
    (["compressor=topk", "compressor.ratio=2"], "compressor.ratio"),
    (["algorithm=dpsgd", "workers=1"], "gossip needs at least 2 workers"),
    (["data=cifar10", "data.root={tmp}/nowhere"], "pass data.download=true"),
    (["data=cifar10", f"data.root={SUBSET}", "data.subset=0"], "data.subset=0"),
    (["data=cifar10", "data.download_timeout_s=0"], "data.download_timeout_s=0"),
    # Checkpoints, resume, divergence (issue 9, items 1 and 3).
    (["train.checkpoint_every=-1"], "train.checkpoint_every=-1: must be >= 0"),
    (["train.checkpoint_every=often"], "train.checkpoint_every=often: use a number of steps"),
    (["train.checkpoint_keep=0"], "train.checkpoint_keep=0: must be at least 1"),
    (["train.resume=/nonexistent"], "train.resume=/nonexistent: no such file or directory"),
    (["train.resume={tmp}"], "no complete checkpoint there"),
    # Starting from another run's weights (issue 40; the model checks: tests/test_init_from.py).
    (["train.init_from=/nonexistent"], "train.init_from=/nonexistent: no such file or directory"),
    (["train.init_from={tmp}"], "no finished run's model_final.pt and no complete checkpoint"),
    (["train.init_from={tmp}/a-file"], "a-file cannot be read (RuntimeError: mmap can only"),
    (["train.on_nonfinite=foo"], "train.on_nonfinite=foo; choose one of: stop, skip_step"),
    (["algorithm=async_sgd", "train.on_nonfinite=skip_step"], "skip_step is not supported"),
    # More compressors, compressed Adam, two-level reduction (issue 20).
    (["compressor=threshold", "compressor.threshold=0"], "compressor.threshold=0: must be > 0"),
    (["compressor=threshold", "compressor.threshold=-1e-3"], "compressor.threshold=-0.001"),
    (["compressor=sketch", "compressor.width=0.5"], "set compressor.width >= 1"),
    (["compressor=sketch", "optimizer.momentum=0.9"], "applies momentum itself"),
    (["compressor=sketch", "error_feedback=ef14"], "use error_feedback=none"),
    (["compressor=onebit", "compressor.per=row"], "compressor.per=row; choose one of"),
    (["algorithm=choco", "compressor=threshold"], "no fixed size for a neighbour exchange"),
    (["comm.hierarchy.workers_per_node=3"], "workers_per_node=3 does not divide workers=4"),
    (["comm.hierarchy.workers_per_node=0"], "workers_per_node=0: must be at least 1"),
    (["comm.hierarchy.workers_per_node=2", "algorithm=local_sgd"], "for algorithm=sync"),
    (["comm.hierarchy.workers_per_node=2", "network.intra=infiniband"], "network.intra="),
    (
        ["comm.hierarchy.workers_per_node=2", "comm.hierarchy.intra_algorithm=chain"],
        "comm.hierarchy.intra_algorithm=chain; choose one of: tree, ring",
    ),
    (["comm.hierarchy.intra_algorithm=ring"], "set comm.hierarchy.workers_per_node too"),
    # hierarchical DiLoCo's inner algorithm (tests/test_hier_diloco.py has its own rows)
    ([*NODE_SYNC, "algorithm.bucket_mb=0"], "algorithm.bucket_mb=0: must be a number > 0"),
    ([*NODE_SYNC, "algorithm.overlap=3"], "algorithm.overlap=3: must be true or false"),
    (["optimizer=onebit_adam", "compressor=topk"], "optimizer=onebit_adam compresses its"),
    (["optimizer=zero_one_adam", "error_feedback=ef14"], "drop compressor=/error_feedback="),
    (["optimizer=onebit_adam", "algorithm=local_sgd"], "runs its own algorithm"),
    (["algorithm=zero_one_adam"], "select it with optimizer=zero_one_adam"),
    (["optimizer=onebit_adam", "optimizer.freeze_step=-1"], "freeze_step=-1: must be >= 0"),
    # A plug-in key's value against its parameter's annotation (issue 33, item 5).
    (["algorithm=local_sgd", "outer=nesterov", "outer.period=2.5"], "outer.period=2.5: must be"),
    (
        ["algorithm=local_sgd", "outer=nesterov", "outer.scale_by_inner_lr=maybe"],
        "outer.scale_by_inner_lr=maybe: must be true or false",
    ),
    (["algorithm=dpsgd", "algorithm.mix_buffers=maybe"], "algorithm.mix_buffers=maybe: must be"),
    (["optimizer=onebit_adam", "algorithm.buffers=foo"], "algorithm.buffers=foo; choose one of"),
    # DeMo (tests/test_demo.py)
    (["optimizer=demo", "algorithm.topk=0"], "algorithm.topk=0: must be an integer >= 1"),
    (["optimizer=demo", "algorithm.chunk=0"], "algorithm.chunk=0: must be an integer >= 1"),
    (["optimizer=demo", "algorithm.beta=1.0"], "algorithm.beta=1.0: the momentum decay must"),
    (["optimizer=demo", "algorithm.average=median"], "algorithm.average=median; choose one of"),
    # SPARTA (tests/test_sparta.py)
    (["algorithm=sparta", "algorithm.p=0"], "algorithm.p=0: the fraction of parameter entries"),
    (["algorithm=sparta", "algorithm.selection=topk"], "algorithm.selection=topk; choose one"),
    (["algorithm=desloc", "algorithm.state_periods=3"], "algorithm.state_periods=3: give a"),
    # Asynchrony through the layers, AD-PSGD (issue 17).
    (["algorithm=async_sgd", "protocol=fifo"], "protocol=fifo is not an option; choose one of"),
    (["algorithm=async_sgd", "async.protocol=ssp"], "pass protocol=asgd|ssp|softsync|sync"),
    (["algorithm=sync", "protocol=ssp"], "SyncSGD does not use a protocol"),
    (["algorithm=adpsgd", "topology=exponential"], "its graph must be undirected and static"),
    (["algorithm=adpsgd", "backend=gloo"], "add async.order=seeded"),
    # Issue 21: silently accepted, or a traceback with a run directory left behind.
    (["async.lr_policy=inverse"], "async.lr_policy is set but SyncSGD does not use the async"),
    (["async.tau_max=2"], "async.tau_max is set but SyncSGD does not use the async"),
    # the speed keys are every family's (`time/modeled_s`, issue 41): checked for sync too
    (["async.compute_s=0"], "async.compute_s=0.0: the mean compute time must be > 0"),
    (["topology=torus"], "topology is set but SyncSGD does not use the topology options"),
    (["algorithm=local_sgd", "algorithm.period=0"], "algorithm.period=0: average every N >= 1"),
    (["algorithm=local_sgd", "algorithm.period=-3"], "algorithm.period=-3"),
    (["algorithm=local_sgd", "algorithm.sync_epochs=-1"], "algorithm.sync_epochs=-1"),
    (["algorithm=choco", "algorithm.state_dtype=float16"], "state_dtype=float16; choose one of"),
    (["algorithm=choco", "algorithm.gamma=0"], "algorithm.gamma=0: the consensus step size"),
    (["algorithm=dpsgd", "algorithm.order=foo"], "algorithm.order=foo; choose one of"),
    (["algorithm=dpsgd", "algorithm.global_average_every=0"], "global_average_every=0: average"),
    (["algorithm=dpsgd", "algorithm.global_average_every=-2"], "global_average_every=-2"),
    (["algorithm=dpsgd", "topology.weights=foo"], "topology.weights=foo; choose one of"),
    (["algorithm.buffers=foo"], "algorithm.buffers=foo; choose one of: broadcast, local"),
    (["algorithm.granularity=foo"], "algorithm.granularity=foo; choose one of"),
    (["algorithm.collective=foo"], "algorithm.collective=foo; choose one of"),
    (["hydra.run.dir={tmp}/a,b"], "a comma (or a range) makes a list of values"),
    (["seed=1,2"], "seed=1,2: a comma (or a range) makes a list of values, which only a sweep"),
    (["train.resume_allow_changes=[optimizer.lrr]"], "optimizer.lrr is not a config key"),
    # Every other key with a constraint (issue 21, item 7).
    (["train.loss_scale=0"], "train.loss_scale=0.0: must be > 0"),
    (["train.batched_workers=maybe"], "train.batched_workers=maybe; choose one of"),
    (["train.channels_last=maybe"], "Value 'maybe' is not a valid bool"),
    (["train.epochs=0"], "train.epochs=0.0: must be positive"),
    (["train.val_size=-1"], "train.val_size=-1.0 must be a count of examples"),
    (["train.checkpoint_every=1.5"], "train.checkpoint_every=1.5: a number of steps is whole"),
    (["data.num_classes=1"], "data.num_classes=1: must be at least 2"),
    (["data.num_features=0"], "data.num_features=0: must be at least 1"),
    (["data.noise=-1"], "data.noise=-1: the noise standard deviation must be >= 0"),
    (["comm.p2p_schedule=x"], "comm.p2p_schedule=x; choose one of"),
    (["network.message_overhead_us=-1"], "network.message_overhead_us must be >= 0"),
    (["network.allgather_factor=0"], "network.allgather_factor > 0"),
    (["network.latency_us=-1"], "network.latency_us >= 0"),
    (["logger.init_timeout_s=0"], "logger.init_timeout_s=0.0: must be > 0"),
    (["schedule.warmup_epochs=-1"], "schedule.warmup_epochs=-1: must be a number >= 0"),
    (["schedule.warmup_from=-1"], "schedule.warmup_from=-1"),
    (["optimizer=adam", "+optimizer.eps=-1"], "optimizer.eps=-1: must be a number >= 0"),
    (["compressor=qsgd", "compressor.levels=0"], "compressor.levels=0: must be in 1..127"),
    (["compressor=randomk", "compressor.ratio=0"], "compressor.ratio=0: must be in (0, 1]"),
    (["compressor=powersgd", "compressor.rank=0"], "compressor.rank=0: must be >= 1"),
    (["error_feedback=ef14", "error_feedback.momentum=-1"], "error_feedback.momentum=-1"),
    (["error_feedback.mode=foo"], "error_feedback.mode"),
    (["model.hidden=abc"], "model.hidden"),
    (["network=nonexistent"], "network=nonexistent is not an option"),
    (["algorithm._target_=dpresearch.models.mlp.MLP"], "is not an Algorithm subclass"),
    (["model=resnet20", "model.depth=21"], "model.depth=21 is not 6n+2"),
    (["model=resnet18", "model.width=0"], "model.width=0: must be a positive number of channels"),
    (["model=resnet20", "model.shortcut=x"], "model.shortcut='X' is not known"),
    (["model=vgg11", "model.depth=12"], "model.depth=12 is not a VGG depth"),
    (["algorithm=dpsgd", "topology=random", "topology.p=0"], "topology.p=0 must be in (0, 1]"),
    (["algorithm=dpsgd", "topology=torus", "topology.rows=3"], "topology.rows=3 does not divide"),
    (["algorithm=async_sgd", "async.speed=lognormal", "async.cv=-1"], "async.cv=-1"),
    (["algorithm=async_sgd", "async.delay_compensation=-1"], "async.delay_compensation=-1.0"),
    (["algorithm=async_sgd", "async.inject_delay=-1"], "async.inject_delay=-1.0"),
    (
        ["algorithm=async_sgd", "protocol=ssp", "protocol.max_staleness=-1"],
        "protocol.max_staleness=-1",
    ),
    (["algorithm=adpsgd", "algorithm.pairing=nearest"], "algorithm.pairing=nearest; choose one"),
    (["train.batched_workers=maybe"], "train.batched_workers=maybe; choose one of"),
    (["algorithm=async_sgd", "async.slowdown=0"], "async.slowdown=0.0: must be > 0"),
    (["algorithm=async_sgd", "async.straggler_factor=0"], "async.straggler_factor=0.0"),
    (["algorithm=async_sgd", "async.straggler_prob=2"], "async.straggler_prob=2.0"),
    (
        ["algorithm=async_sgd", "async.lr_policy=drop", "async.tau_max=-1"],
        "async.tau_max=-1: must be >= 0",
    ),
    (["algorithm=async_sgd", "async.timeout_s=0"], "async.timeout_s=0.0: must be > 0"),
    (["network.compute_step_s=-1"], "network.compute_step_s=-1"),
    (["train.batched_workers=sometimes"], "train.batched_workers=sometimes; choose one of"),
    ([*TEXT, "data.block_size=0"], "data.block_size=0 must be a positive integer"),
    ([*TEXT, "+data.dtype=float16"], "data.dtype=float16; choose one of: uint16"),
    ([*TEXT, "data.eval_tokens=1"], "data.eval_tokens=1 must be an integer >= data.block_size"),
    ([*TEXT, "data.piece=8"], "data.piece=8 must be an integer >= data.block_size+1=65"),
    ([*TEXT, "data.tokenizer=words"], "data.tokenizer=words; choose one of: char, byte, gpt2"),
    ([*TEXT, "model.block_size=32", "data.block_size=64"], "model.block_size=32 is shorter"),
    ([*TEXT, "model.dropout=1"], "model.dropout=1: must be in [0, 1)"),
    ([*TEXT, "model.dropout_stream=fast"], "model.dropout_stream=fast: choose one of: worker"),
    (
        [
            *TEXT,
            "model.dropout=0.1",
            "model.dropout_stream=global",
            "train.batched_workers=stacked",
        ],
        "(model.dropout_stream=global), which stacked rows would draw differently; "
        "model.dropout_stream=worker runs stacked",
    ),
    ([*TEXT, "model.n_embd=65"], "model.n_embd=65 must be a multiple of model.n_head=2"),
    (["data=cifar10", f"data.root={SUBSET}", "model=gpt_tiny"], "not inputs of shape [3, 32, 32]"),
    ([*TEXT, "optimizer=muon", "optimizer.adamw_betas=[2]"], "optimizer.adamw_betas=[2]"),
    ([*TEXT, "optimizer=muon", "optimizer.adjust_lr_fn=x"], "optimizer.adjust_lr_fn=x: choose"),
    ([*TEXT, "optimizer=muon", "+optimizer.ns_coefficients=[1]"], "optimizer.ns_coefficients"),
    ([*TEXT, "schedule.warmup_steps=-1"], "schedule.warmup_steps=-1: must be an integer >= 0"),
    (["train.grad_clip=-1"], "train.grad_clip=-1.0: must be a positive number"),
    (
        ["algorithm=async_sgd", "+train.time_scenarios={slow:{slowdown:2}}"],
        "train.time_scenarios is set but AsyncSGD keeps its own event clock",
    ),
    (
        ["+train.time_scenarios={wan:{network:wan_10mbit}}"],
        "train.time_scenarios.wan: network: wan_10mbit is not a network preset",
    ),
]
# Issue 43, item 7: each tried by hand, each a traceback, silently accepted or printed over
# several lines before.
FIRST_HOUR = [
    (["data=text"], "data.root must be given (this config has no default); pass data.root=<"),
    (["data=text", "data.root=play.txt", "data.val_fraction=half"], "data.val_fraction=half"),
    ([*TEXT, "data.sample_tokens=-5"], "data.sample_tokens=-5 must be an integer >= 0"),
    (["data=text", "data.root=play.txt", "data.memmap=maybe"], "data.memmap=maybe: must be true"),
    (["optimizer=muon", "optimizer.ns_steps=0"], "optimizer.ns_steps=0: must be an integer >= 1"),
    (["optimizer.momentum=1.5"], "optimizer.momentum=1.5: must be in [0, 1)"),
    (
        ["optimizer.exclude_bn_bias_from_weight_decay=maybe"],
        "optimizer.exclude_bn_bias_from_weight_decay=maybe: must be true or false",
    ),
    (
        ["optimizer=demo", "algorithm.topk=5000", "algorithm.chunk=64"],
        "algorithm.topk=5000 keeps every coefficient: a block holds at most chunk² = 4096",
    ),
    (
        ["optimizer=demo", "model.hidden=[30,30]", "algorithm.topk=1000"],
        "algorithm.topk=1000 sends every coefficient: this model's largest DCT block holds 960",
    ),
    (
        ["compressor=dct_topk", "error_feedback=ef14", "algorithm.granularity=bucket"],
        "compressor.topk=32 sends every coefficient: this model's largest DCT block holds 6",
    ),
    (["algorithm._target_=nowhere.Algo"], "algorithm._target_=nowhere.Algo cannot be imported"),
    (["model._target_=dpresearch.models.Nope"], "'Nope' is importable from module"),
]
BAD += FIRST_HOUR
# Keys the source names in a `key=...` message that are not constraints of the user's:
# overrides the study launcher writes itself.
NOT_CONSTRAINTS = {"logger.group", "logger.name", "logger.tags", "train.progress"}
if not torch.cuda.is_available():
    BAD.append((["backend=nccl"], "use backend=gloo"))


def test_table_is_big_enough() -> None:
    assert len(BAD) >= 40


def test_every_constrained_key_has_a_row() -> None:
    """Every config key that some check names in its error (`"<node>.<key>=..."` or
    `"<node>.<key>:"` in the source) is set by at least one row above (or by the asynchronous
    options' and the outer optimizers' own tables): a new check without a row fails here."""
    import re

    from helpers import REPO

    nodes = "|".join(
        (
            "train",
            "backend",
            "network",
            "comm",
            "logger",
            "debug",
            "data",
            "model",
            "optimizer",
            "schedule",
            "algorithm",
            "compressor",
            "error_feedback",
            "topology",
            "async",
        )
    )
    named = re.compile(rf'f?"((?:{nodes})\.[a-z_]+)[=:]')
    constrained = {
        match.group(1)
        for path in (REPO / "dpresearch").rglob("*.py")
        for match in named.finditer(path.read_text())
    }
    rows = [*BAD, *ASYNC_BAD, *OUTER_BAD]
    covered = {a.lstrip("+~").split("=", 1)[0] for args, _ in rows for a in args}
    assert len(constrained) > 50  # the scan finds the checks
    assert sorted(constrained - covered - NOT_CONSTRAINTS) == []


@pytest.mark.parametrize("args,fragment", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_no_run_directory(
    args, fragment, tmp_path, monkeypatch, capsys
):
    (tmp_path / "a-file").write_text("not a directory")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    run_dir = tmp_path / "run"
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={run_dir}")
    small = [] if any(a.startswith("data=") for a in args) else SYNTHETIC_SMALL
    code, out, err = run_main([*small, *args], tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert "error" not in out and "Traceback" not in out + err
    if "train.stepz=5" in args:
        assert "+train.stepz" not in lines[0]  # never suggest adding a key the schema lacks
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing else written


def test_real_mode_resume_of_another_world_size_is_one_line(tmp_path):
    """A real asynchronous run's checkpoint (4 workers + the server: 5 processes) resumed with
    3 workers: refused from the checkpoint's header, before any process starts."""
    from helpers import compose_config

    from dpresearch.config.validate import ConfigError
    from dpresearch.run.checkpoint_files import FORMAT
    from dpresearch.train import train

    checkpoint = tmp_path / "step_10.pt"
    header = {
        "format": FORMAT,
        "step": 10,
        "workers": 4,
        "processes": 5,
        "algorithm": "dpresearch.algorithms.async_sgd.AsyncSGD",
        "num_params": 1,
    }
    torch.save({**header, "loop": {}, "states": []}, checkpoint)
    cfg = compose_config(
        *SYNTHETIC_SMALL,
        "algorithm=async_sgd",
        "backend=gloo",
        "workers=3",
        f"train.resume={checkpoint}",
    )
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    assert "was written with workers=4, this run has workers=3" in str(err.value)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_rerun_into_a_directory_holding_a_run_is_refused(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    args = [*SYNTHETIC_SMALL, f"hydra.run.dir={run_dir}"]
    code, _, err = run_main(args, tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "already holds another run (metrics.jsonl); pass a new directory" in lines[0]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_directory_locked_by_another_run_is_refused(tmp_path, monkeypatch, capsys):
    from dpresearch.launch.run_dir import claim_run_dir

    run_dir = tmp_path / "run"
    with claim_run_dir(run_dir):  # as if another process held it: flock is per open file
        import fcntl
        import os

        fd = os.open(run_dir / ".lock", os.O_RDWR)
        try:
            # A second, independent open file description on the same lock: what another
            # process would have. Taking it must fail while the claim holds.
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not (run_dir / ".lock").exists()  # released: the lock file is gone


# The real command line: the same one line, also where workers would be processes.
CLI_CASES = [
    (["optimizer.lr=-1"], "optimizer.lr=-1"),
    (["backend=gloo", "workers=2", "model=resnet20"], "cannot take this data set's inputs"),
    (["backend=gloo", "workers=2", "data=cifar10", "data.root={tmp}/nowhere"], "not found"),
    (["train.stepz=5"], "did you mean train.steps?"),
]


@pytest.mark.parametrize("args,fragment", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_bad_input_on_the_command_line(args, fragment, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    small = [] if any(a.startswith("data=") for a in args) else SYNTHETIC_SMALL
    out = run_cli([*small, *args], cwd=tmp_path, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert "error" not in out.stdout
    assert list(tmp_path.iterdir()) == []  # no outputs/, no run directory


# A torchrun environment left over (issue 21, item 6): (variables, overrides, fragment).
# "{free}" / "{held}": a free port, and one another process listens on.
STALE = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
ENV_BAD = [
    ({**STALE, "MASTER_PORT": "{free}"}, [], "are set in this shell (left over from a torchrun"),
    (
        {**STALE, "MASTER_PORT": "{held}"},
        ["backend=gloo", "workers=2"],
        "is held by another process, so rank 0 cannot host the rendezvous",
    ),
    ({**STALE, "MASTER_PORT": "x"}, ["backend=gloo", "workers=2"], "MASTER_PORT=x is not a port"),
]


@pytest.mark.parametrize("env,args,fragment", ENV_BAD, ids=[f for _, _, f in ENV_BAD])
def test_a_torchrun_environment_left_over_is_one_line(
    env, args, fragment, tmp_path, monkeypatch, capsys
):
    import socket

    from helpers import free_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports = {"{free}": str(free_port()), "{held}": str(held.getsockname()[1])}
        for name, value in env.items():
            monkeypatch.setenv(name, ports.get(value, value))
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        run_dir = tmp_path / "run"
        code, out, err = run_main(
            [*SYNTHETIC_SMALL, *args, f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch, capsys
        )
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0] and "unset RANK WORLD_SIZE" in lines[0], lines[0]
    assert not run_dir.exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_peers_that_never_come_are_one_line_after_the_timeout(tmp_path):
    """RANK/WORLD_SIZE/... left in the environment with a free port: rank 0 hosts the
    rendezvous and waits `backend.timeout_s` for the peer, then says so in one line (before:
    a 27-line DistNetworkError, or a wait of 10 minutes)."""
    from helpers import free_port

    env = {**STALE, "MASTER_PORT": str(free_port())}
    out = run_cli(
        [
            *SYNTHETIC_SMALL,
            "backend=gloo",
            "workers=2",
            "backend.timeout_s=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        timeout=180,
        env=env,
    )
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert "rank 0 could not join the other processes at 127.0.0.1:" in errors[0]
    assert "the variables came from the environment" in errors[0]
    assert "Traceback" not in out.stderr


# -- the asynchronous options' bad inputs (the config check alone) ---------------------------
ASYNC_BAD = [
    (["async.delay=-1"], "the fixed delay τ must be >= 0"),
    (["protocol=ssp"], "needs protocol.max_staleness"),
    (["async.lr_policy=sqrt"], "choose one of: constant, inverse, delay_adaptive, drop"),
    (["async.lr_policy=drop"], "needs async.tau_max"),
    (["protocol=softsync"], "needs protocol.c"),
    (["async.slow_workers=[7]"], "workers are 0..3"),
    (["async.speed=gamma"], "choose one of: constant, exponential"),
    (["compressor=powersgd"], "cannot compress a push"),
    (["error_feedback=ef21"], "support error_feedback=none or ef14"),
    (["async.delay=2", "backend=gloo"], "use backend=simulated"),
    (["train.on_nonfinite=skip_step"], "skip_step is not supported"),
    (
        ["algorithm=async_local_sgd", "algorithm.dynamic_local_updates=2"],
        "algorithm.dynamic_local_updates=2: must be true or false",
    ),
]


@pytest.mark.parametrize("args,fix", ASYNC_BAD)
def test_bad_async_input_is_one_line(args, fix):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(*SMALL, "algorithm=async_sgd", *args))
    message = str(err.value)
    assert fix in message and "\n" not in message


# -- the outer optimizers' bad inputs: one line naming the fix, before any worker starts ------
DRIFT = ["algorithm=local_sgd", "outer=nesterov"]


OUTER_BAD = [
    (["outer=nesterov"], "SyncSGD is not one; use algorithm=local_sgd (period 1 is synchronous"),
    (["algorithm=async_sgd", "outer=nesterov"], "AsyncSGD is not one"),
    (["algorithm=sgp", "outer=slowmo"], "outer.period is required: SGP has no averaging period"),
    ([*DRIFT, "outer.fragments=4"], "outer.fragments=4: the model has 3 blocks of layers"),
    ([*DRIFT, "algorithm.period=8", "outer.overlap=8"], "use 0 <= overlap < period"),
    ([*DRIFT, "algorithm.period=2", "outer.fragments=3"], "at most one fragment starts per step"),
    ([*DRIFT, "outer.mix=1"], "outer.mix=1: the share of local progress kept at a merge"),
    ([*DRIFT, "outer.inner_state=zero"], "outer.inner_state=zero; choose one of: keep, reset"),
    ([*DRIFT, "outer.fragment_pattern=random"], "choose one of: sequential, strided"),
    ([*DRIFT, "outer.optimizer.lr=-1"], "outer.optimizer.lr=-1: must be a number >= 0"),
    ([*DRIFT, "outer.optimizer.momentum=0"], "outer: Nesterov momentum requires a momentum"),
    ([*DRIFT, "outer.perod=4"], "outer.perod is not an option of"),
    ([*DRIFT, "algorithm.sync_epochs=1"], "set algorithm.sync_epochs=0"),
    ([*DRIFT, "algorithm.average_optimizer_state=true"], "outer.inner_state=average"),
    (
        [*DRIFT, "compressor@outer.compressor=topk", "outer.compressor.ratio=2"],
        "outer.compressor.ratio=2: must be in (0, 1]",
    ),
    (
        [*DRIFT, "compressor@outer.compressor=signum", "error_feedback@outer.error_feedback=ef14"],
        "use error_feedback@outer.error_feedback=none",
    ),
]


@pytest.mark.parametrize("args,fragment", OUTER_BAD, ids=[" ".join(a) for a, _ in OUTER_BAD])
def test_bad_outer_input_is_one_line_before_any_worker(
    args, fragment, tmp_path, monkeypatch, capsys
):
    run_dir = tmp_path / "run"
    args = [*SYNTHETIC_SMALL, *args, f"hydra.run.dir={run_dir}"]
    code, out, err = run_main(args, tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert fragment in lines[0], lines[0]
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_study_dry_run_refuses_a_case_train_refuses(tmp_path, monkeypatch, capsys):
    """`study run --dry-run` runs the checks `train` runs before any worker (issue 43): a case
    whose model is shorter than its data's windows is one line naming the case, exit 2."""
    from dpresearch.study.__main__ import main

    path = tmp_path / "study.yaml"
    path.write_text(
        "name: s\ncommon: [" + ", ".join(TEXT) + "]\nlrs: [0.001]\nseeds: [0]\n"
        "cases:\n  short: [model.block_size=16, data.block_size=32]\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(path), "--dry-run"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == [
        "error: case 'short': model.block_size=16 is shorter than the data's windows of 32; "
        "raise model.block_size or lower data.block_size"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.yaml"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_killed_worker_is_one_line_naming_its_rank_and_the_signal(tmp_path):
    """A gloo worker SIGKILLed mid-run: the console's last line names its rank and the
    signal; torch's report of it (its 15-line block) is in train.log only (issue 43)."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import cli_env, load_scaled, worker_processes

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dpresearch.train",
            "backend=gloo",
            "workers=2",
            "train.steps=1000000",
            "train.log_every=1",
            *SYNTHETIC_SMALL,
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        env=cli_env(WANDB_MODE="disabled", OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + load_scaled(120)
        while not (run_dir / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.5)
        workers = worker_processes(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=load_scaled(60))
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode != 0
    # torch names the signal where its agent saw the killed process fail; where it saw only the
    # peer's broken connection, the killed worker is found by the heartbeat file it left
    named = re.fullmatch(
        r"error: worker process failed: rank [01] \(pid (\d+)\) (was killed by SIGKILL|died "
        r"without a report \(killed by a signal such as SIGKILL, or crashed\)); the job was "
        r"stopped \(torch's report(?: of its peers)?: train.log\)",
        lines[-1],
    )
    assert named and int(named.group(1)) == workers[1], err
    assert "Root Cause" not in err and "=====" not in err
    log = (run_dir / "train.log").read_text()
    assert "Root Cause (first observed failure)" in log and "SIGKILL" in log
