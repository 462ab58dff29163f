"""GRACE's released numbers for the codecs of this study, read from the authors' data release.

`sands-lab/grace-data`'s `GRACE_data_release.pickle` holds pandas DataFrames of every run of the
GRACE paper (Xu et al., ICDCS 2021). A pickle runs code when loaded, so this reads it with an
unpickler that accepts only the pandas and numpy constructors a DataFrame needs and refuses
anything else. It prints the rows of `published.csv` this study joins (table
`cifar10-classification`, model `resnet20_v2`, 8 workers, full CIFAR-10; top-1 accuracy from
mode `accuracy`, bytes per step from mode `data-volume` where GRACE measured it):

    git clone https://github.com/sands-lab/grace-data /tmp/grace-data
    python experiments/compressors_more/grace_published.py /tmp/grace-data/GRACE_data_release.pickle
"""

from __future__ import annotations

import csv
import pickle
import sys

ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("pandas.core.frame", "DataFrame"),
    ("pandas.core.internals.managers", "BlockManager"),
    ("pandas.core.indexes.base", "_new_Index"),
    ("pandas.core.indexes.base", "Index"),
    ("pandas.core.indexes.range", "RangeIndex"),
    ("builtins", "slice"),
}
# our case → (GRACE's run name, its setting, what differs from ours for the accuracy row and the
# bytes row: empty where like for like; see `dpresearch.analysis.published`)
QSGD = "QSGD 64 levels, one norm per tensor, 1 byte per value — ours s = 1, one norm per 512 values, 2 bits per value"  # noqa: E501
POWERSGD = "plain SGD; momentum 0.9 inside GRACE's PowerSGD compressor (m ← 0.9·m + 0.1·PQᵀ, applies m + PQᵀ) — ours Nesterov 0.9 in the optimizer"  # noqa: E501
TOPK = "top-k ratio 1 % — ours 1/64 (1.56 %)"
THRESHOLD = "threshold v = 0.01 — ours 0.03"
CASES = {
    "none": ("none", "momentum SGD, no compression", "", ""),
    "top-k 1/64 + EF": ("topk_mem_ratio=0.01", "top-k 1% + residual memory", TOPK, TOPK),
    "QSGD s=1": ("qsgd_q=64", "QSGD, 64 quanta, no memory", QSGD, QSGD),
    "PowerSGD rank 1 + EF": (
        "powersgd_mem", "PowerSGD + memory, GRACE's 'sgd' optimizer", POWERSGD, POWERSGD
    ),
    "1-bit SGD + EF": (
        "onebit_mem", "1-bit SGD + memory", "",
        "bytes: each sign sent as a 1-byte bool — ours 1 bit per value",
    ),
    "natural": (
        "natural", "natural compression, no memory", "",
        "bytes: 8 bits per value (sign + 7-bit exponent, clipped range) — ours 9 bits (sign + "
        "8-bit exponent)",
    ),
    "threshold + EF": ("threshold_mem_thres=0.01", "threshold v = 0.01 + memory", THRESHOLD,
                       THRESHOLD),
}  # fmt: skip


SOURCE = "https://github.com/sands-lab/grace-data — GRACE_data_release.pickle, DataFrame "
SET_UP = ["CIFAR-10 (full: 50,000 train / 10,000 test)", "ResNet-20 v2 (TensorFlow)", "8"]
ACCURACY_UNIT = "top-1 test accuracy (%), one run"
VOLUME_UNIT = "bytes per step per worker (GRACE's data-volume mode)"


class Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}")
        if module.startswith("numpy.core"):  # numpy 2 moved numpy.core to numpy._core
            import numpy.core.multiarray as multiarray

            return getattr(multiarray, name)
        return super().find_class(module, name)


def main(path: str) -> None:
    with open(path, "rb") as f:
        tables = Restricted(f).load()
    frame = tables["cifar10-classification"]
    frame = frame[(frame["model"] == "resnet20_v2") & (frame["workers"] == 8)]
    accuracy = frame[frame["mode"] == "accuracy"].set_index("name")
    volume = frame[frame["mode"] == "data-volume"].set_index("name")
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(
        ["case", "setting", "differs", "value", "unit", "data", "model", "workers", "source"]
    )
    for case, (name, setting, differs, differs_bytes) in CASES.items():
        row = accuracy.loc[name]
        if row.ndim > 1:  # one optimizer per name is wanted: GRACE's momentum runs first
            row = row[row["optimizer"] == "momentum"].iloc[0]
        where = f"cifar10-classification (run {row['id']}, name {name}, mode accuracy, "
        where += "model resnet20_v2, workers 8)"
        top1 = f"{100 * float(row['top_1_accuracy']):.2f}"
        out.writerow(
            [case, f"GRACE: {setting}", differs, top1, ACCURACY_UNIT, *SET_UP, SOURCE + where]
        )
        vol_name = name
        if vol_name not in volume.index:  # volume measured with memory only for some methods
            vol_name = name.replace("_mem", "") + "_mem"
        if vol_name in volume.index:
            vol = volume["data_volume"][vol_name]
            where = f"cifar10-classification (name {vol_name}, mode data-volume, model "
            where += "resnet20_v2, workers 8)"
            out.writerow(
                [
                    case,
                    f"GRACE: {setting}",
                    differs_bytes,
                    round(float(vol)),
                    VOLUME_UNIT,
                    *SET_UP,
                    SOURCE + where,
                ]
            )


if __name__ == "__main__":
    main(sys.argv[1])
