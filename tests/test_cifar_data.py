"""CIFAR loading against the real-image subset, and the batched augmentation."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import write_md5sums
from hydra.utils import instantiate
from omegaconf import OmegaConf

from dpresearch import CONF_DIR
from dpresearch.data.cifar import CIFAR10, CIFAR100, normalize, random_crop_flip

SUBSET = Path(__file__).resolve().parents[2] / "shared/data/cifar10-subset"
CONF = CONF_DIR / "data"
CIFAR10_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
CIFAR10_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def subset_root() -> Path:
    if not (SUBSET / "cifar-10-batches-py").is_dir():
        pytest.skip(f"real-image CIFAR-10 subset not found at {SUBSET} (shared/ beside the repo)")
    return SUBSET


@pytest.fixture(scope="module")
def ds(subset_root: Path) -> CIFAR10:
    return CIFAR10.load(subset_root)


def raw_batch(root: Path, name: str) -> dict:
    with open(root / "cifar-10-batches-py" / name, "rb") as f:
        return pickle.load(f, encoding="latin1")


def test_subset_sizes_types_and_shapes(ds: CIFAR10) -> None:
    assert ds.num_train == 5085 and ds.test_targets.shape == (1017,)
    assert ds.train_inputs.shape == (5085, 3, 32, 32) and ds.train_inputs.dtype == torch.uint8
    assert ds.test_inputs.shape == (1017, 3, 32, 32) and ds.test_inputs.dtype == torch.uint8
    assert ds.train_targets.dtype == torch.int64
    assert ds.num_classes == 10 and ds.input_shape == (3, 32, 32)
    assert set(ds.train_targets.tolist()) == set(range(10))


def test_first_test_labels_by_name(ds: CIFAR10) -> None:
    names = [ds.label_names[int(k)] for k in ds.test_targets[:4]]
    assert names == ["cat", "ship", "ship", "airplane"]


def test_image_layout_matches_raw_pickle(ds: CIFAR10, subset_root: Path) -> None:
    row = raw_batch(subset_root, "data_batch_2")["data"][7].astype(np.float64)
    image = ds.train_inputs[1017 + 7]  # 8th image of the second batch file
    planes = row.reshape(3, 1024)
    assert image.double().mean(dim=(1, 2)).tolist() == pytest.approx(planes.mean(axis=1).tolist())
    # Row-major within a plane: pixel (y=5, x=9) of green is entry 1024 + 5·32 + 9.
    assert int(image[1, 5, 9]) == int(row[1024 + 5 * 32 + 9])
    assert int(image[2, 31, 0]) == int(row[2048 + 31 * 32])


def test_subset_takes_first_images_across_files(ds: CIFAR10, subset_root: Path) -> None:
    small = CIFAR10.load(subset_root, subset=1500)
    assert small.num_train == 1500
    assert torch.equal(small.train_inputs, ds.train_inputs[:1500])
    assert torch.equal(small.train_targets, ds.train_targets[:1500])
    assert torch.equal(small.test_targets, ds.test_targets)
    for bad in (0, 5086):
        with pytest.raises(ValueError, match="data.subset"):
            CIFAR10.load(subset_root, subset=bad)


def test_hydra_config_instantiates(subset_root: Path) -> None:
    cfg = OmegaConf.load(CONF / "cifar10.yaml")
    cfg.root = str(subset_root)
    cfg.subset = 64
    cfg.partition = "dirichlet"
    data = instantiate(cfg, device="cpu")
    assert isinstance(data, CIFAR10) and data.num_train == 64 and data.augment
    partitioner = data.make_partitioner(num_workers=4, seed=0)
    assert partitioner.samples_per_worker == 16


def close_normalised(a: torch.Tensor, b: torch.Tensor, std: torch.Tensor) -> bool:
    """Two float32 evaluations of (x/255 − m)/s with another kernel (a reciprocal multiply, a
    fused op, another device; issue 33, class b) agree to their rounding, derived rather than
    fixed: on each side at most 3 roundings before the division, each ≤ 2u (operands ≤ 1 + m
    < 2; u = 2^-24), divided by s ≥ min(std), and one relative u after it. A wrong mean or
    std moves the values by > 1e-2."""
    u = torch.finfo(torch.float32).eps / 2
    return torch.allclose(a, b, atol=2 * 3 * 2 * u / float(std.min()), rtol=2 * u)


def test_test_transform_is_normalisation(ds: CIFAR10) -> None:
    x = ds.test_inputs[:16]
    expected = (x.float() / 255 - CIFAR10_MEAN) / CIFAR10_STD
    inputs, targets = next(ds.test_batches(16))
    assert close_normalised(inputs, expected, CIFAR10_STD)
    assert torch.equal(targets, ds.test_targets[:16])


def test_train_transform_deterministic_given_generator(ds: CIFAR10) -> None:
    indices = torch.arange(64)
    a, ya = ds.train_batch(indices, torch.Generator().manual_seed(3))
    b, _ = ds.train_batch(indices, torch.Generator().manual_seed(3))
    c, _ = ds.train_batch(indices, torch.Generator().manual_seed(4))
    assert a.shape == (64, 3, 32, 32) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(ya, ds.train_targets[:64])
    # Augmentation then normalisation, nothing else.
    crops = random_crop_flip(ds.train_inputs[:64], torch.Generator().manual_seed(3))
    assert close_normalised(a, normalize(crops, CIFAR10_MEAN, CIFAR10_STD), CIFAR10_STD)
    assert ds.transform_train(ds.train_inputs[:4], None).shape == (4, 3, 32, 32)


def test_augment_off_is_test_transform(subset_root: Path) -> None:
    plain = CIFAR10.load(subset_root, subset=32, augment=False)
    x = plain.train_inputs
    assert torch.equal(plain.transform_train(x, torch.Generator()), plain.transform_test(x))


def coded_images(n: int) -> torch.Tensor:
    """n copies of a 3×32×32 image whose every pixel value is unique and non-zero, so each
    crop window (and padding, 0) is recognisable."""
    codes = torch.arange(1, 3 * 32 * 32 + 1, dtype=torch.int64).view(1, 3, 32, 32)
    return codes.repeat(n, 1, 1, 1)


def windows(image: torch.Tensor, padding: int) -> list[torch.Tensor]:
    padded = F.pad(image, (padding,) * 4)
    size = 2 * padding + 1
    return [padded[:, dy : dy + 32, dx : dx + 32] for dy in range(size) for dx in range(size)]


def test_flip_really_flips() -> None:
    images = coded_images(64)
    out = random_crop_flip(images, torch.Generator().manual_seed(0), padding=0)
    flipped = [torch.equal(o, torch.flip(images[0], dims=[-1])) for o in out]
    kept = [torch.equal(o, images[0]) for o in out]
    assert all(f != k for f, k in zip(flipped, kept, strict=True))
    assert 16 < sum(flipped) < 48


def test_crop_really_shifts_each_image_independently() -> None:
    images = coded_images(256)
    out = random_crop_flip(images, torch.Generator().manual_seed(0), padding=4, flip=False)
    assert out.shape == images.shape and out.dtype == images.dtype
    candidates = windows(images[0], 4)
    shifts = []
    for o in out:
        matches = [k for k, w in enumerate(candidates) if torch.equal(o, w)]
        assert len(matches) == 1
        shifts.append(matches[0])
    assert len(set(shifts)) > 40  # 81 possible offsets, drawn per image
    assert 40 in shifts  # the centre window (no shift) is one of them


def test_crop_and_flip_compose() -> None:
    images = coded_images(32)
    out = random_crop_flip(images, torch.Generator().manual_seed(1), padding=4)
    candidates = windows(images[0], 4)
    candidates += [torch.flip(w, dims=[-1]) for w in candidates]
    for o in out:
        assert sum(torch.equal(o, w) for w in candidates) == 1


def test_uint8_padding_is_zero() -> None:
    images = torch.full((128, 3, 32, 32), 255, dtype=torch.uint8)
    out = random_crop_flip(images, torch.Generator().manual_seed(0))
    assert out.dtype == torch.uint8
    assert set(out.unique().tolist()) == {0, 255}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_generator_gives_same_crops_on_cuda(ds: CIFAR10) -> None:
    x = ds.train_inputs[:64]
    cpu = ds.transform_train(x, torch.Generator().manual_seed(5))
    gpu = ds.transform_train(x.cuda(), torch.Generator().manual_seed(5))
    assert close_normalised(cpu, gpu.cpu(), CIFAR10_STD)


def write_fake_cifar100(root: Path, num_train: int = 20, num_test: int = 10) -> None:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", num_train), ("test", num_test)):
        content = {
            "filenames": [f"img_{i}.png" for i in range(n)],
            "batch_label": name,
            "fine_labels": [(7 * i) % 100 for i in range(n)],
            "coarse_labels": [(7 * i) % 20 for i in range(n)],
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(content, f)
    meta = {"fine_label_names": [f"c{k}" for k in range(100)], "coarse_label_names": []}
    with open(folder / "meta", "wb") as f:
        pickle.dump(meta, f)
    write_md5sums(folder)


def test_cifar100_reads_fine_labels(tmp_path: Path) -> None:
    write_fake_cifar100(tmp_path)
    data = CIFAR100.load(tmp_path, subset=15)
    assert data.num_classes == 100 and data.num_train == 15
    assert data.train_targets.tolist() == [(7 * i) % 100 for i in range(15)]
    assert data.label_names[99] == "c99" and data.test_inputs.shape == (10, 3, 32, 32)
    x = data.test_inputs[:2]
    mean = torch.tensor([0.5071, 0.4865, 0.4409]).view(1, 3, 1, 1)
    std = torch.tensor([0.2673, 0.2564, 0.2762]).view(1, 3, 1, 1)
    assert close_normalised(data.transform_test(x), (x.float() / 255 - mean) / std, std)


def test_planted_pickle_cannot_run_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_fake_cifar100(tmp_path)

    class Exploit:
        def __reduce__(self) -> tuple:
            return (print, ("pwned",))

    with open(tmp_path / "cifar-100-python" / "test", "wb") as f:
        pickle.dump({"data": Exploit()}, f)
    with pytest.raises(ValueError, match="corrupt.*unexpected object builtins.print") as err:
        CIFAR100.load(tmp_path, verify=False)  # the unpickler's own guard
    assert "\n" not in str(err.value)
    assert "pwned" not in capsys.readouterr().out
