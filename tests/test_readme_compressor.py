"""The README's "Add a compressor" example, executed: its code block defines a `ChunkCompressor`
that then runs through the generic codec in every place a compressor goes — the synchronous
reducer with error feedback (bytes = its docstring's formula), a training run from the config
(`compressor._target_`), and CHOCO-SGD's weighted decoding."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.compress import Chunk, CompressedReducer, ErrorFeedback, check_pairing

README = Path(__file__).resolve().parents[1] / "README.md"
NET = NetworkModel.preset("10gbe")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def example() -> types.ModuleType:
    """The README's example as an importable module `readme_compressor`."""
    text = README.read_text()
    section = text[text.index("**Add a compressor:**") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    module = types.ModuleType("readme_compressor")
    exec(compile(code, str(README), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_example_reduces_with_error_feedback_and_exact_bytes(example):
    k, shapes = 3, [(0, (20, 8)), (160, (20,)), (180, (7,))]
    comm = SimulatedCommunicator(k, NET)
    reducer = CompressedReducer(example.Int8(seed=1), comm, shapes, ErrorFeedback(mode="ef14"))
    g = torch.randn(k, 187, generator=torch.Generator().manual_seed(0))
    mean = g.mean(0)
    reducer.reduce(g, 0)
    assert comm.ledger.bytes_sent == sum(d + 4 for d in (160, 20, 7)) == reducer.payload_bytes()
    assert torch.equal(g[0].expand(k, -1), g)
    assert (g[0] - mean).abs().max() < 0.05  # 8-bit: within a level of each scale
    assert reducer.memory.memory.abs().max() > 0  # EF keeps the rounding error


def test_example_trains_from_the_config(example, small_config):
    from dpresearch.run.trainer import Trainer

    cfg = small_config(
        "workers=2",
        "train.steps=3",
        "compressor._target_=readme_compressor.Int8",
        "error_feedback=ef14",
    )
    trainer = Trainer(cfg, SimulatedCommunicator(2, NET), torch.device("cpu"), None)
    trainer.run()
    numels = [p.numel() for p in trainer.replicas.models[0].parameters()]
    assert trainer.comm.ledger.bytes_sent == 3 * sum(d + 4 for d in numels)


def test_example_is_a_gossip_codec(example):
    compressor = example.Int8(seed=1)
    check_pairing(compressor, use="gossip")
    codec = compressor.codec([Chunk("a", 0, 30), Chunk("b", 30, 10)], workers=[0, 1])
    x = torch.randn(2, 40)
    wire = codec.encode(x, 0)
    decoded = torch.empty(2, 40)
    codec.decode(wire, 0, decoded)
    assert (decoded - x).abs().max() <= x.abs().max() / 127
    out = torch.zeros(2, 40, dtype=torch.float64)
    codec.accumulate(torch.stack([wire, wire.flip(0)], 1), 0, out, torch.tensor([[0.5, 0.5]] * 2))
    assert torch.allclose(out, (0.5 * decoded + 0.5 * decoded.flip(0)).double())
