"""`train.init_from` (issue 40, item 1): a run that starts from another run's model weights
only — the weights equal the source's before any step (a finished run's consensus model, or
worker 0's row of a checkpoint), every worker the same whatever the workers of either run, the
optimizer, schedule, step counter and data order fresh (the run equals one whose initial
weights were replaced by hand), a wrong model refused in one line before anything is created,
a resume of such a run exact, and the same on gloo as simulated."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import (
    CHECKPOINTED,
    SMALL_512,
    build_trainer,
    check_resumed,
    compose_config,
    final_params,
    run_main,
    same,
    train_on_gloo,
)

from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.errors import ConfigError
from dpresearch.models.gpt import GPT
from dpresearch.run import init_from
from dpresearch.run.build import network_model
from dpresearch.run.checkpoint_files import load_checkpoint
from dpresearch.run.trainer import InjectedFailure
from dpresearch.train import train

# BatchNorm: buffers (running statistics, and the integer num_batches_tracked) travel too.
RUN = [
    *SMALL_512,
    "model.batch_norm=true",
    "optimizer.momentum=0.9",
    "backend.threads=1",
    "train.log_every=1",
    "comm.deterministic=true",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A finished 2-worker local-SGD run (period 4) with checkpoints at steps 3 and 6: its
    workers' rows differ at step 3, mid-period."""
    run_dir = tmp_path_factory.mktemp("source") / "run"
    args = [
        "workers=2",
        "algorithm=local_sgd",
        "algorithm.period=4",
        "train.steps=6",
        "train.checkpoint_every=3",
    ]
    train(compose_config(*RUN, *args), run_dir)
    return run_dir


def built(*overrides: str):
    cfg = compose_config(*RUN, *overrides)
    torch.set_num_threads(1)
    return build_trainer(
        cfg, SimulatedCommunicator(cfg.workers, network_model(cfg), deterministic=True)
    )


def test_a_finished_run_gives_its_final_model_to_every_worker(source, one_thread):
    trainer = built("workers=3", f"train.init_from={source}")
    final = torch.load(source / "model_final.pt")
    assert any(".running_mean" in k for k in final) and any("num_batches" in k for k in final)
    for model in trainer.replicas.models:
        assert same(model.state_dict(), final)
    assert all(not opt.state for opt in trainer.optimizers)  # a fresh optimizer
    assert trainer.start_step == 0 and trainer.state.step == 0
    assert trainer.built.setup["init_from"] == {
        "path": str((source / "model_final.pt").resolve()),
        "step": 6,
        "weights": "the consensus model",
    }


def test_a_checkpoint_gives_worker_0s_row_to_every_worker(source, one_thread):
    checkpoint = source / "checkpoints" / "step_3.pt"
    rows = load_checkpoint(checkpoint)["states"][0]["replicas"]
    assert not torch.equal(rows["params"][0], rows["params"][1])  # mid-period: rows differ
    trainer = built("workers=4", f"train.init_from={checkpoint}")
    assert torch.equal(trainer.replicas.params, rows["params"][0].expand(4, -1))
    assert torch.equal(trainer.replicas.buffers, rows["buffers"][0].expand(4, -1))
    ints = [b for b in trainer.replicas.models[3].buffers() if not b.is_floating_point()]
    assert ints and all(
        torch.equal(a, b) for a, b in zip(ints, rows["int_buffers"][0], strict=True)
    )
    assert trainer.built.setup["init_from"]["step"] == 3
    # the run directory's checkpoints/: its latest checkpoint (a finished run writes none at
    # its last step: step 3 of 6; the run directory itself gives its final model)
    latest = built(f"train.init_from={source / 'checkpoints'}").built.setup["init_from"]
    assert latest == {"path": str(checkpoint.resolve()), "step": 3, "weights": "worker 0's row"}


def test_the_run_equals_one_whose_initial_weights_were_replaced(source, tmp_path, one_thread):
    """Only the weights come from the source: optimizer, schedule, step counter, data order
    and the algorithm's state are a fresh run's (the reference: the same run without
    init_from, its replicas overwritten by hand before the first step)."""
    args = [
        "workers=3",
        "schedule=warmup_cosine",
        "train.steps=8",
        "algorithm=local_sgd",
        "algorithm.period=2",
        "outer=nesterov",
    ]
    started = built(*args, f"train.init_from={source}")
    started.run()
    reference = built(*args)
    final = torch.load(source / "model_final.pt")
    for model in reference.replicas.models:
        model.load_state_dict(final)
    reference.algorithm.anchor.params.copy_(reference.replicas.params[:1])  # DiLoCo's outer model
    reference.algorithm.anchor.buffers.copy_(reference.replicas.buffers[:1])
    reference.run()
    assert torch.equal(started.replicas.params, reference.replicas.params)
    assert torch.equal(started.replicas.buffers, reference.replicas.buffers)
    untouched = built(*args)
    untouched.run()
    assert not torch.equal(untouched.replicas.params, started.replicas.params)


def test_a_resumed_init_from_run_equals_an_uninterrupted_one(source, tmp_path, one_thread):
    args = [*CHECKPOINTED, "workers=4", "model.batch_norm=true", f"train.init_from={source}"]
    check_resumed(tmp_path, args, InjectedFailure)
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["init_from"]["path"] == str((source / "model_final.pt").resolve())


def one_line(args: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    run_dir = tmp_path / "new"
    code, out, err = run_main([*args, f"hydra.run.dir={run_dir}"], tmp_path, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert not run_dir.exists()
    return lines[0]


def test_another_model_is_one_line_exit_2_and_no_run_directory(
    source, tmp_path, monkeypatch, capsys
):
    line = one_line(
        [*RUN, "model.hidden=[16]", f"train.init_from={source}"], tmp_path, monkeypatch, capsys
    )
    assert "its model differs: model.hidden ([32] → [16])" in line, line
    # the same model node, other tensors: the data's 8 features in place of 16
    line = one_line(
        [*RUN, "data.num_features=8", f"train.init_from={source}"], tmp_path, monkeypatch, capsys
    )
    assert "its net.1.weight is of shape (32, 16), this model's (32, 8)" in line, line
    checkpoint = source / "checkpoints" / "step_3.pt"
    line = one_line(
        [*RUN, "data.num_features=8", f"train.init_from={checkpoint}"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    # 16·32 + 32 + 2·32 (BatchNorm) + 32·10 + 10 = 938; with 8 features 682
    assert "does not fit this one (938 parameters where this model has 682)" in line, line


def test_init_from_with_a_resume_of_another_start_is_one_line(
    source, tmp_path, monkeypatch, capsys
):
    """A resumed run takes its weights from its checkpoint: init_from must be its own."""
    plain = tmp_path / "plain"
    train(compose_config(*RUN, "train.steps=4", "train.checkpoint_every=2"), plain)
    line = one_line(
        [
            *RUN,
            "train.steps=8",
            f"train.resume={plain}",
            "train.resume_allow_changes=[train.steps,train.init_from]",
            f"train.init_from={source}",
        ],
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert f"train.init_from={source} with train.resume: checkpoint" in line, line
    assert "started from a random initialisation" in line, line


# A GPT (its output head tied to its token embedding) on a corpus of 8 characters.
TEXT = [
    "data=text",
    "model=gpt_tiny",
    "train.batch_size=4",
    "train.progress=false",
    "backend.threads=1",
]


def corpus(path: Path, letters: str = "abcdefg\n", seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(rng.choice(letters) for _ in range(20000)))
    return path


def test_a_tied_gpt_starts_from_a_checkpoint_mid_run(tmp_path, monkeypatch, capsys, one_thread):
    """A checkpoint's row holds a tied tensor once: the GPT's `lm_head.weight` (its token
    embedding's) is taken from it, tied still; the weights equal those of a run that finished
    at the checkpoint's step (its model_final.pt, torch's state dict: both names), the
    optimizer fresh. Another GPT is still refused in one line."""
    text = [*TEXT, f"data.root={corpus(tmp_path / 'a.txt')}", "schedule=constant", "workers=1"]
    train(compose_config(*text, "train.steps=4", "train.checkpoint_every=2"), tmp_path / "src")
    train(compose_config(*text, "train.steps=2"), tmp_path / "ref")
    checkpoint = tmp_path / "src" / "checkpoints" / "step_2.pt"
    cfg = compose_config(*text, "workers=2", f"train.init_from={checkpoint}")
    trainer = build_trainer(
        cfg, SimulatedCommunicator(cfg.workers, network_model(cfg), deterministic=True)
    )
    final = torch.load(tmp_path / "ref" / "model_final.pt")
    assert "lm_head.weight" in final and "transformer.wte.weight" in final
    row = load_checkpoint(checkpoint)["states"][0]["replicas"]["params"][0]
    assert torch.equal(trainer.replicas.params, row.expand(2, -1))
    flat = trainer.replicas.params.untyped_storage().data_ptr()
    for model in trainer.replicas.models:
        assert same(model.state_dict(), final)
        assert model.lm_head.weight is model.transformer.wte.weight  # tied still, ...
        assert model.lm_head.weight.untyped_storage().data_ptr() == flat  # ... in the flat row
    assert all(not opt.state for opt in trainer.optimizers)
    assert trainer.start_step == 0
    assert trainer.built.setup["init_from"]["step"] == 2

    other = [*text, "model.n_embd=32", f"train.init_from={checkpoint}"]
    line = one_line(other, tmp_path, monkeypatch, capsys)
    assert "its model differs: model.n_embd (64 → 32)" in line, line
    # past the settings: a GPT whose rows do not fit (the check behind that line)
    source = init_from.resolve(str(checkpoint))
    with pytest.raises(ConfigError, match=r"does not fit this one \(\d+ parameters where"):
        init_from.weights(source, GPT(8, [64], n_layer=2, n_head=2, n_embd=32))


def test_another_vocabulary_is_one_line(tmp_path, monkeypatch, capsys):
    """Two corpora of 8 characters each: the same tensors, other characters."""
    text = [*TEXT, "workers=1", "train.steps=1"]
    train(compose_config(*text, f"data.root={corpus(tmp_path / 'a.txt')}"), tmp_path / "a")
    b = corpus(tmp_path / "b.txt", "hijklmn\n", seed=1)
    line = one_line(
        [*text, f"data.root={b}", f"train.init_from={tmp_path / 'a'}"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert "its model was trained on another vocabulary" in line, line


@pytest.mark.slow  # 11-13 s on a loaded 2-core machine (two gloo processes start)
def test_gloo_equals_simulated(source, tmp_path):
    """Rank 0 reads the weights, the broadcast hands them on: 2 gloo processes train what the
    simulated run trains."""
    args = ["workers=2", "train.steps=4", f"train.init_from={source}"]
    simulated = tmp_path / "simulated"
    train(compose_config(*RUN, *args), simulated)
    (gloo,) = train_on_gloo(2, [(compose_config(*RUN, *args, "backend=gloo"), tmp_path / "gloo")])
    assert same(gloo, final_params(simulated))
    summary = json.loads((tmp_path / "gloo" / "summary.json").read_text())
    assert summary["init_from"]["step"] == 6
