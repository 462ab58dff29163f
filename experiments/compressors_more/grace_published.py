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
# our case → GRACE's run name (the closest GRACE setting; the `grace_setting` column says it)
CASES = {
    "none": ("none", "momentum SGD, no compression"),
    "top-k 1/64 + EF": ("topk_mem_ratio=0.01", "top-k 1% + residual memory"),
    "QSGD s=1": ("qsgd_q=64", "QSGD, 64 quanta, no memory"),
    "PowerSGD rank 1 + EF": ("powersgd_mem", "PowerSGD + memory, GRACE's 'sgd' optimizer"),
    "1-bit SGD + EF": ("onebit_mem", "1-bit SGD + memory"),
    "natural": ("natural", "natural compression, no memory"),
    "threshold + EF": ("threshold_mem_thres=0.01", "threshold v = 0.01 + memory"),
}


SOURCE = (
    "GRACE data release (sands-lab/grace-data GRACE_data_release.pickle; table "
    "cifar10-classification; ResNet-20 v2; 8 workers; full CIFAR-10)"
)


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
        ["method", "grace_top1_percent", "grace_bytes_per_step", "grace_setting", "grace_run",
         "source"]
    )  # fmt: skip
    for case, (name, setting) in CASES.items():
        row = accuracy.loc[name]
        if row.ndim > 1:  # one optimizer per name is wanted: GRACE's momentum runs first
            row = row[row["optimizer"] == "momentum"].iloc[0]
        vol = volume["data_volume"].get(name)
        if vol is None:  # volume measured with memory only for some methods
            vol = volume["data_volume"].get(name.replace("_mem", "") + "_mem", "")
        out.writerow(
            [case, f"{100 * float(row['top_1_accuracy']):.2f}", round(float(vol)), setting,
             row["id"], SOURCE]
        )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
