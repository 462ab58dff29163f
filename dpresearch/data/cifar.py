"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009), held whole on the training device.

Reads the official "python version" layout — the folder that extracting `cifar-10-python.tar.gz`
(or torchvision's download) produces:

    <root>/cifar-10-batches-py/data_batch_1 … data_batch_5, test_batch, batches.meta
    <root>/cifar-100-python/train, test, meta            (labels: `fine_labels`, 100 classes)

Images stay uint8, N×3×32×32, on the device; targets are int64. `CIFAR10.load(...)` and
`CIFAR100.load(...)` are the Hydra `_target_`s. Training batches get the standard augmentation —
random 32×32 crop of the image zero-padded by 4 pixels, then a horizontal flip with probability
1/2 — batched on the device, then per-channel normalisation; test batches are only normalised.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from dpresearch.data.base import Dataset
from dpresearch.data.download import CIFAR10_ARCHIVE, CIFAR100_ARCHIVE, Archive, ensure_extracted
from dpresearch.data.verify import verify_files

IMAGE_SHAPE = (3, 32, 32)


@dataclass(frozen=True)
class Layout:
    """Where one CIFAR variant keeps its splits and labels, and its channel statistics."""

    archive: Archive
    train_files: tuple[str, ...]
    test_file: str
    meta_file: str
    label_key: str
    names_key: str
    num_classes: int
    # Per-channel mean and standard deviation of the training images, on the [0, 1] scale.
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


CIFAR10_LAYOUT = Layout(
    archive=CIFAR10_ARCHIVE,
    train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test_file="test_batch",
    meta_file="batches.meta",
    label_key="labels",
    names_key="label_names",
    num_classes=10,
    mean=(0.4914, 0.4822, 0.4465),
    std=(0.2470, 0.2435, 0.2616),
)
CIFAR100_LAYOUT = Layout(
    archive=CIFAR100_ARCHIVE,
    train_files=("train",),
    test_file="test",
    meta_file="meta",
    label_key="fine_labels",
    names_key="fine_label_names",
    num_classes=100,
    mean=(0.5071, 0.4865, 0.4409),
    std=(0.2673, 0.2564, 0.2762),
)


def random_crop_flip(
    images: Tensor, generator: torch.Generator | None = None, padding: int = 4, flip: bool = True
) -> Tensor:
    """Each image of the batch `images` (N×C×H×W, any dtype) cropped back to H×W at a random
    offset from its copy zero-padded by `padding` pixels on every side, then, if `flip`, mirrored
    left–right with probability 1/2.

    Randomness: offsets (N rows, then N columns, each uniform in 0..2·padding) and then, if
    `flip`, N flip bits are drawn from `generator` on the generator's own device (CPU for None)
    and only then moved to the images' device, so a CPU generator gives the same crops on every
    device. One gather over the padded batch; no per-image loop.
    """
    offsets, flips = crop_flip_draws(images.shape[0], generator, padding, flip)
    return apply_crop_flip(images, offsets, flips, padding)


def crop_flip_draws(
    n: int, generator: torch.Generator | None, padding: int = 4, flip: bool = True
) -> tuple[Tensor, Tensor | None]:
    """The draws of `random_crop_flip` for `n` images, in its order, on the generator's
    device: offsets `[2, n]` (rows, then columns) and flip bits `[n]` (None without `flip`)."""
    rng_device = generator.device if generator is not None else torch.device("cpu")
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=generator, device=rng_device)
    flips = torch.randint(0, 2, (n,), generator=generator, device=rng_device) if flip else None
    return offsets, flips


def apply_crop_flip(
    images: Tensor, offsets: Tensor, flips: Tensor | None, padding: int = 4
) -> Tensor:
    """Crop and flip `images` as drawn (`crop_flip_draws`, moved to the images' device)."""
    n, c, h, w = images.shape
    device = images.device
    offsets = offsets.to(device)
    rows = offsets[0, :, None] + torch.arange(h, device=device)
    cols = offsets[1, :, None] + torch.arange(w, device=device)
    if flips is not None:
        cols = torch.where(flips.to(device)[:, None].bool(), cols.flip(1), cols)
    padded = images.new_zeros(n, c, h + 2 * padding, w + 2 * padding)
    padded[:, :, padding : padding + h, padding : padding + w] = images
    batch = torch.arange(n, device=device)[:, None, None, None]
    channel = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]


def normalize(images: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """float32 `(images / 255 - mean) / std` with `mean`, `std` broadcastable per channel."""
    return images.float().div_(255).sub_(mean).div_(std)


def _numeric_dtype(spec: Any, *args: Any) -> np.dtype:
    """`numpy.dtype(...)` as a pickle rebuilds it, for numeric types only: an object array
    would hand its elements to the unpickler as Python objects."""
    dtype = np.dtype(spec, *args)
    if dtype.hasobject:
        raise pickle.UnpicklingError(f"object arrays are not read ({spec})")
    return dtype


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that rebuilds only numeric numpy arrays besides the plain containers (dicts,
    lists, strings, bytes, numbers), so a planted file in `data.root` cannot run code (plain
    pickle.load executes whatever callable the file names)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("_codecs", "encode"),  # how a Python 2 pickle spells a byte string
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("numpy", "dtype"):
            return _numeric_dtype
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


@dataclass
class CifarDataset(Dataset):
    """A CIFAR split pair plus its transforms. Built by the subclasses' `load` classmethod.

    `label_names[k]` names class k; `augment` turns training augmentation on (crop with
    `padding` pixels, flip); `mean`/`std` are the per-channel statistics used to normalise.
    """

    LAYOUT: ClassVar[Layout]
    transform_draws: ClassVar[bool] = True

    label_names: tuple[str, ...] = ()
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    augment: bool = True
    padding: int = 4
    _stats: dict[torch.device, tuple[Tensor, Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def load(
        cls,
        root: str | os.PathLike[str],
        download: bool = False,
        subset: int | None = None,
        partition: str = "iid",
        alpha: float = 1.0,
        device: str | torch.device = "cpu",
        augment: bool = True,
        url: str | None = None,
        md5: str | None = None,
        download_timeout_s: float | None = 1800.0,
        verify: bool = True,
    ) -> CifarDataset:
        """Read the data set under `root` (downloading it first if `download` and it is absent,
        within `download_timeout_s`; `url`/`md5` override the official archive) and place it on
        `device`. With `verify`, every file is checked against its MD5 first, once
        (`data.verify.verify_files`).

        `subset=N` keeps the first N training images in file order (the test split is kept
        whole); `partition`/`alpha` are for `make_partitioner`. Missing data raises
        FileNotFoundError, unreadable or altered data ValueError, each with a one-line fix."""
        layout = cls.LAYOUT
        name = layout.archive.name
        if download:
            folder = ensure_extracted(
                root, layout.archive, url=url, md5=md5, deadline_s=download_timeout_s
            )
        else:
            folder = Path(root).expanduser() / layout.archive.folder
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"{name} not found under {Path(root).expanduser()}: pass data.download=true, "
                    f"or point data.root at a directory holding {layout.archive.folder}"
                )
        if subset is not None and subset < 1:
            raise ValueError(f"data.subset={subset} must be a positive number of images or null")
        if verify:
            verify_files(folder, layout.archive.files, name)

        images, labels = [], []
        for filename in layout.train_files:
            if subset is not None and sum(len(y) for y in labels) >= subset:
                break  # the first `subset` images are read; skip the rest of the files
            x, y = _read_split(folder / filename, layout)
            images.append(x)
            labels.append(y)
        train_x, train_y = np.concatenate(images), np.concatenate(labels)
        if subset is not None:
            if subset > len(train_y):
                raise ValueError(
                    f"data.subset={subset} exceeds the {len(train_y)} training images of {name} "
                    f"under {folder}; choose a smaller subset or null"
                )
            train_x, train_y = train_x[:subset], train_y[:subset]
        test_x, test_y = _read_split(folder / layout.test_file, layout)
        label_names = _read_label_names(folder / layout.meta_file, layout)

        def tensor(array: np.ndarray) -> Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        return cls(
            train_inputs=tensor(train_x),
            train_targets=tensor(train_y),
            test_inputs=tensor(test_x),
            test_targets=tensor(test_y),
            num_classes=layout.num_classes,
            partition=partition,
            alpha=alpha,
            label_names=label_names,
            mean=layout.mean,
            std=layout.std,
            augment=augment,
        )

    def _channel_stats(self, device: torch.device) -> tuple[Tensor, Tensor]:
        # Cached per device: building them each batch would cost a host-to-device copy per step.
        if device not in self._stats:
            shape = (1, len(self.mean), 1, 1)
            self._stats[device] = (
                torch.tensor(self.mean, dtype=torch.float32, device=device).view(shape),
                torch.tensor(self.std, dtype=torch.float32, device=device).view(shape),
            )
        return self._stats[device]

    def transform_train(self, inputs: Tensor, generator: torch.Generator | None) -> Tensor:
        """Random crop + flip drawn from `generator` (if `augment`), then normalisation."""
        if self.augment:
            inputs = random_crop_flip(inputs, generator, self.padding)
        return normalize(inputs, *self._channel_stats(inputs.device))

    def transform_batches(
        self, inputs: Tensor, generators: Sequence[torch.Generator | None]
    ) -> Tensor:
        """Each batch's crops and flips drawn from its own generator (as `transform_train`
        draws them), then applied and normalised once for all batches."""
        if self.augment:
            n = inputs.shape[0] // len(generators)
            draws = [crop_flip_draws(n, g, self.padding) for g in generators]
            offsets = torch.cat([d[0].cpu() for d in draws], dim=1)
            flips = torch.cat([d[1].cpu() for d in draws])  # type: ignore[union-attr]
            inputs = apply_crop_flip(inputs, offsets, flips, self.padding)
        return normalize(inputs, *self._channel_stats(inputs.device))

    def transform_test(self, inputs: Tensor) -> Tensor:
        """Normalisation only."""
        return normalize(inputs, *self._channel_stats(inputs.device))


@dataclass
class CIFAR10(CifarDataset):
    """CIFAR-10: 50,000 training and 10,000 test images of 10 classes.
    Build with `CIFAR10.load(root, ...)` (see `CifarDataset.load`)."""

    LAYOUT: ClassVar[Layout] = CIFAR10_LAYOUT


@dataclass
class CIFAR100(CifarDataset):
    """CIFAR-100: 50,000 training and 10,000 test images of 100 fine classes.
    Build with `CIFAR100.load(root, ...)` (see `CifarDataset.load`)."""

    LAYOUT: ClassVar[Layout] = CIFAR100_LAYOUT


def _corrupt(path: Path, layout: Layout, reason: str) -> ValueError:
    return ValueError(
        f"{layout.archive.name} file {path} is corrupt or not in the python-version format "
        f"({reason}); delete {path.parent} and pass data.download=true to fetch it again"
    )


def _unpickle(path: Path, layout: Layout) -> dict[str, Any]:
    """The dict stored in one official batch file."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{layout.archive.name} file {path} is missing: the folder is incomplete; delete "
            f"{path.parent} and pass data.download=true to fetch it again"
        )
    try:
        with open(path, "rb") as f:
            # The official files are Python 2 pickles; latin1 maps their byte strings 1:1.
            content = _ArrayUnpickler(f, encoding="latin1").load()
    except Exception as err:  # any unpickling failure means the same: the file is bad
        raise _corrupt(path, layout, f"{type(err).__name__}: {err}".splitlines()[0]) from err
    if not isinstance(content, dict):
        raise _corrupt(path, layout, f"holds a {type(content).__name__}, not a dict")
    return content


def _read_split(path: Path, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """Images (N×3×32×32 uint8) and labels (N int64) of one batch file."""
    content = _unpickle(path, layout)
    try:
        data, labels = content["data"], content[layout.label_key]
    except KeyError as err:
        raise _corrupt(path, layout, f"no key {err}") from None
    data = np.asarray(data)
    labels = np.asarray(labels, dtype=np.int64)
    pixels = int(np.prod(IMAGE_SHAPE))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != pixels:
        raise _corrupt(path, layout, f"data is {data.dtype} {data.shape}, not uint8 N×{pixels}")
    if labels.shape != (data.shape[0],):
        raise _corrupt(path, layout, f"{labels.shape[0]} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() >= layout.num_classes):
        raise _corrupt(path, layout, f"labels outside 0..{layout.num_classes - 1}")
    # Each row is the red plane, then green, then blue, each 32×32 row-major.
    return data.reshape(-1, *IMAGE_SHAPE), labels


def _read_label_names(path: Path, layout: Layout) -> tuple[str, ...]:
    names: Sequence[str] = _unpickle(path, layout).get(layout.names_key, ())
    if len(names) != layout.num_classes:
        raise _corrupt(path, layout, f"{len(names)} names under {layout.names_key!r}")
    return tuple(str(n) for n in names)
