"""Built-in CNNs: parameter counts against the papers / reference implementations, shapes,
initialisation, the YAML files that point at them, and the torchvision fallback."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from dpresearch import CONF_DIR
from dpresearch.models.resnet18 import ResNet18
from dpresearch.models.resnet_cifar import ResNetCifar
from dpresearch.models.torchvision_model import torchvision_model
from dpresearch.models.vgg import VGG

CONF = CONF_DIR / "model"
BUILT_IN = [
    "resnet20",
    "resnet32",
    "resnet44",
    "resnet56",
    "resnet110",
    "resnet18",
    "vgg11",
    "vgg16",
]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("depth", "millions"), [(20, 0.27), (32, 0.46), (44, 0.66), (56, 0.85), (110, 1.7)]
)
def test_cifar_resnet_params_match_paper(depth: int, millions: float) -> None:
    count = num_params(ResNetCifar(10, (3, 32, 32), depth=depth))
    assert abs(count - millions * 1e6) <= 0.03 * millions * 1e6


def test_shortcut_a_is_parameter_free_and_b_projects() -> None:
    a = num_params(ResNetCifar(10, depth=20, shortcut="A"))
    b = num_params(ResNetCifar(10, depth=20, shortcut="B"))
    assert a == 269_722
    # Two projections (16→32, 32→64): a 1×1 conv plus BN weight and bias each.
    assert b - a == (16 * 32 + 2 * 32) + (32 * 64 + 2 * 64)


def test_resnet18_param_count() -> None:
    assert num_params(ResNet18(10)) == 11_173_962


def test_vgg_param_counts() -> None:
    # Conv biases before BN are dropped (BN's shift makes them redundant).
    assert num_params(VGG(10, depth=11)) == 9_228_362
    assert num_params(VGG(10, depth=16)) == 14_724_042


@pytest.mark.parametrize("name", BUILT_IN)
def test_yaml_builds_model_that_trains_one_step(name: str) -> None:
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    model = instantiate(cfg, num_classes=10, input_shape=(3, 32, 32))
    x = torch.randn(2, 3, 32, 32)
    logits = model(x)
    assert logits.shape == (2, 10)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_other_input_shapes_and_class_counts() -> None:
    assert ResNetCifar(100, (1, 28, 28), depth=20)(torch.randn(2, 1, 28, 28)).shape == (2, 100)
    assert ResNet18(7, (1, 16, 16))(torch.randn(2, 1, 16, 16)).shape == (2, 7)
    assert VGG(5, (3, 64, 64), depth=11)(torch.randn(2, 3, 64, 64)).shape == (2, 5)


def test_bad_options_raise_one_line_value_errors() -> None:
    for build in (
        lambda: ResNetCifar(10, depth=21),
        lambda: ResNetCifar(10, shortcut="C"),
        lambda: VGG(10, depth=12),
        lambda: VGG(10, (3, 16, 16)),
    ):
        with pytest.raises(ValueError) as err:
            build()
        assert "\n" not in str(err.value)


def test_standard_init() -> None:
    torch.manual_seed(0)
    model = ResNetCifar(10, depth=20)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
    # Kaiming normal, fan-out, ReLU gain: std = sqrt(2 / (out_channels · k · k)).
    conv = model.stage3[1].conv1
    expected = (2 / (conv.out_channels * 9)) ** 0.5
    assert conv.weight.std().item() == pytest.approx(expected, rel=0.05)
    zeroed = ResNetCifar(10, depth=20, zero_init_residual=True)
    assert torch.all(zeroed.stage1[0].bn2.weight == 0)


def test_torchvision_missing_gives_one_line_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import torchvision` raise ImportError.
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    with pytest.raises(ImportError) as err:
        torchvision_model(num_classes=10, input_shape=(3, 32, 32), name="resnet18")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model=torchvision needs torchvision, which failed to import (")
    assert "pip install 'dpresearch[vision]'" in message and "resnet20" in message
    # Through Hydra (which wraps errors from targets) the same error is the cause.
    cfg = OmegaConf.load(CONF / "torchvision.yaml")
    with pytest.raises(Exception) as wrapped:
        instantiate(cfg, num_classes=10, input_shape=(3, 32, 32))
    assert isinstance(wrapped.value.__cause__, ImportError)
    assert str(wrapped.value.__cause__) == message


def test_torchvision_model_calls_get_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def get_model(name: str, **kwargs: object) -> nn.Module:
        calls.append((name, kwargs))
        return nn.Linear(3, int(kwargs["num_classes"]))  # type: ignore[call-overload]

    fake = types.ModuleType("torchvision")
    fake.models = types.ModuleType("torchvision.models")  # type: ignore[attr-defined]
    fake.models.get_model = get_model  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.models", fake.models)  # type: ignore[attr-defined]
    model = torchvision_model(
        num_classes=100, input_shape=(3, 32, 32), name="resnet50", weights=None
    )
    assert isinstance(model, nn.Linear) and model.out_features == 100
    assert calls == [("resnet50", {"num_classes": 100, "weights": None})]


def test_resnet18_width_narrows_every_stage_in_proportion() -> None:
    """`width` w: stages of w, 2w, 4w, 8w channels; 64 is ResNet-18 itself. Every conv and
    linear weight scales with w², BatchNorm and the classifier's bias with w or not at all."""
    narrow = ResNet18(10, width=8)
    assert [m.out_channels for m in narrow.modules() if isinstance(m, torch.nn.Conv2d)][:1] == [8]
    assert narrow.fc.in_features == 64
    assert num_params(ResNet18(10, width=64)) == 11_173_962
    assert narrow(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match="model.width=0"):
        ResNet18(10, width=0)
