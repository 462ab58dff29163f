"""Any torchvision classification model, by name (`model=torchvision model.name=resnet50`).

torchvision is an optional dependency (`pip install 'dpresearch[vision]'`): its wheels are tied
to one CUDA build and fail to import on some machines, so it is imported only when this model is
chosen, and a failure becomes one line naming the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn


def import_torchvision_models() -> Any:
    """`torchvision.models`, or an ImportError that says how to get it or what to use instead."""
    try:
        import torchvision.models as models
    # Broken installs fail with OSError/RuntimeError (missing CUDA libraries, ABI mismatch), not
    # only ImportError; all of them mean the same thing to the user.
    except Exception as err:
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        raise ImportError(
            f"model=torchvision needs torchvision, which failed to import ({reason}); install it "
            "with pip install 'dpresearch[vision]' or choose a built-in model "
            "(resnet20, resnet18, vgg11, ...)"
        ) from err
    return models


def torchvision_model(
    num_classes: int,
    input_shape: Sequence[int] = (3, 224, 224),
    name: str = "resnet18",
    **kwargs: Any,
) -> nn.Module:
    """`torchvision.models.get_model(name, num_classes=num_classes, **kwargs)`.

    `input_shape` is accepted for the common model contract but not used: torchvision's models
    are built for ImageNet-sized inputs (an ImageNet ResNet on 32×32 images runs, but down-samples
    early; prefer the built-in CIFAR models there). Extra keys in the YAML (e.g. `weights: null`,
    `dropout`) pass through to torchvision.
    """
    models = import_torchvision_models()
    return models.get_model(name, num_classes=num_classes, **kwargs)
