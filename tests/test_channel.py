"""One compressed channel for every consumer (issue 33): an algorithm declares what its messages
need (`channel = ChannelNeeds...`) and gets the pairing check before any worker starts — a
user's new gossip algorithm included — and a bad pairing is one `error:` line."""

from __future__ import annotations

import textwrap

import pytest
import torch
from helpers import SYNTHETIC_SMALL, compose_config, run_main

from dpresearch.compress import ChannelNeeds, TopK, check_pairing, open_channel
from dpresearch.compress.powersgd import PowerSGD
from dpresearch.config.validate import ConfigError, validate
from dpresearch.models.mlp import MLP

# A user's gossip algorithm in a module of their own: DeepSqueeze-like (compressed models,
# public copies, no error feedback), declaring its channel and opening it in a few lines.
DEEPSQUEEZE = textwrap.dedent(
    """
    import torch
    from dpresearch.algorithms.gossip import Gossip
    from dpresearch.compress import ChannelNeeds, open_channel


    class DeepSqueeze(Gossip):
        channel = ChannelNeeds.gossip("DeepSqueeze")

        def __init__(self, replicas, comm, optimizers, topology=None, compressor=None,
                     error_feedback=None, seed=0, granularity="tensor", bucket_mb=25.0,
                     mix_buffers=True, eval_local_models=True):
            super().__init__(replicas, comm, optimizers, topology, mix_buffers,
                             eval_local_models)
            self.link = open_channel(self.channel, replicas.models[0], replicas.params,
                                     comm.local_workers, compressor, error_feedback, seed,
                                     granularity, bucket_mb)

        def after_backward(self, step):
            self.step_optimizers()
            self.gossip_average(self.replicas.params, step)
    """
)
# its node: the keys of its YAML, set on the command line over algorithm=choco's
USER = [
    "algorithm=choco",
    "algorithm._target_=my_squeeze.DeepSqueeze",
    "~algorithm.gamma",
    "~algorithm.state_dtype",
]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_squeeze.py").write_text(DEEPSQUEEZE)
    monkeypatch.syspath_prepend(str(tmp_path))


def one_error_line(args, tmp_path, monkeypatch, capsys) -> str:
    code, out, err = run_main(
        [*SYNTHETIC_SMALL, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        monkeypatch,
        capsys,
    )
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in out + err and not (tmp_path / "run").exists()
    return lines[0]


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["compressor=powersgd"], "compressor PowerSGD cannot be used for gossip"),
        (["compressor=topk", "error_feedback=ef14"], "with DeepSqueeze, which can only support"),
        (["compressor=threshold"], "no fixed size for a neighbour exchange"),
    ],
)
def test_a_new_gossip_algorithm_gets_the_pairing_check(
    args, fragment, user_module, tmp_path, monkeypatch, capsys
):
    assert fragment in one_error_line([*USER, *args], tmp_path, monkeypatch, capsys)


def test_a_new_gossip_algorithm_with_a_gossip_codec_passes_the_checks(user_module):
    validate(compose_config(*USER, "compressor=topk", "workers=4"))


@pytest.mark.parametrize(
    "algorithm,fragment",
    [
        ("choco", "compressor PowerSGD cannot be used for gossip"),
        ("adpsgd", "compressor PowerSGD cannot be used for gossip"),
        ("async_sgd", "compressor PowerSGD cannot compress a push"),
    ],
)
def test_powersgd_with_gossip_or_pushes_is_one_line(
    algorithm, fragment, tmp_path, monkeypatch, capsys
):
    line = one_error_line(
        [f"algorithm={algorithm}", "compressor=powersgd"], tmp_path, monkeypatch, capsys
    )
    assert fragment in line


def test_the_check_reads_the_declaration_not_the_target():
    """The same config node checked with the sync rules accepts PowerSGD; the declaration
    decides."""
    with pytest.raises(ConfigError, match="cannot be used for gossip"):
        validate(compose_config("algorithm=choco", "compressor=powersgd"))
    validate(compose_config("algorithm=sync", "compressor=powersgd"))
    check_pairing(PowerSGD(), None, ChannelNeeds())
    with pytest.raises(ValueError, match="only support error_feedback=none"):
        from dpresearch.compress import ErrorFeedback

        check_pairing(TopK(), ErrorFeedback("ef14"), ChannelNeeds.gossip("DeepSqueeze"))


def test_the_channel_takes_the_shortcut_only_for_the_identity_without_memory():
    model = MLP(10, (16,), hidden=[8])
    params = torch.zeros(2, sum(p.numel() for p in model.parameters()))
    plain = open_channel(ChannelNeeds.push(), model, params, [0, 1])
    assert plain.plain and plain.codec is None and plain.wire_bytes == 4 * params.shape[1]
    forced = open_channel(ChannelNeeds.gossip(), model, params, [0, 1], shortcut=False)
    assert not forced.plain and forced.codec is not None
    topk = {"_target_": "dpresearch.compress.topk.TopK", "ratio": 0.1}
    assert open_channel(ChannelNeeds.push(), model, params, [0, 1], topk).codec is not None
    with pytest.raises(ValueError, match="build_reducer"):
        open_channel(ChannelNeeds(), model, params, [0, 1])
