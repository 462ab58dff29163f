"""Benchmark: the input pipeline against the model's forward+backward (issue 3).

Times, on the same device and batch, (a) producing one training batch — index gather from the
uint8 tensors, random crop + flip, normalisation — and (b) one forward+backward of the model on
it. The pipeline must not be the bottleneck: target (a) ≤ 5% of (a)+(b). Medians over repeats.

    python experiments/bench/input_pipeline.py [--root ../shared/data/cifar10-subset]
        [--batch 128] [--models resnet20 resnet18] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dpresearch.data.cifar import CIFAR10
from dpresearch.models.resnet18 import ResNet18
from dpresearch.models.resnet_cifar import ResNetCifar

REPO = Path(__file__).resolve().parents[2]
MODELS = {
    "resnet20": lambda: ResNetCifar(num_classes=10, input_shape=(3, 32, 32), depth=20),
    "resnet18": lambda: ResNet18(num_classes=10, input_shape=(3, 32, 32)),
}


def median_time(fn, repeats: int, sync) -> float:
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        fn()
        sync()
        if i >= 2:  # the first two calls warm caches and allocators
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO.parent / "shared/data/cifar10-subset"))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=["resnet20", "resnet18"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    data = CIFAR10.load(args.root, device=str(device))
    gen = torch.Generator().manual_seed(0)

    def batch():
        idx = torch.randint(data.num_train, (args.batch,), generator=gen)
        return data.train_batch(idx, gen)

    t_data = median_time(batch, args.repeats * 5, sync)
    print(f"device {device}, batch {args.batch}, torch threads {torch.get_num_threads()}")
    print(
        f"{'model':10} {'pipeline ms':>12} {'fwd+bwd ms':>11} {'pipeline share':>15} "
        f"{'images/s':>9}  target share ≤ 5%"
    )
    for name in args.models:
        model = MODELS[name]().to(device)
        x, y = batch()

        def step(model=model, x=x, y=y):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()

        t_model = median_time(step, args.repeats, sync)
        share = t_data / (t_data + t_model)
        print(
            f"{name:10} {t_data * 1e3:12.2f} {t_model * 1e3:11.1f} {share:15.2%} "
            f"{args.batch / (t_data + t_model):9.0f}"
        )


if __name__ == "__main__":
    main()
