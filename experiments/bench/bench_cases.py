"""Model and compressor cases shared by the benchmarks that train (Hydra overrides)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBSET = REPO.parent / "shared" / "data" / "cifar10-subset"

MODELS: dict[str, list[str]] = {
    "resnet20": ["data=cifar10", f"data.root={SUBSET}", "model=resnet20", "train.batch_size=32"],
    "mlp": [
        "data=synthetic",
        "data.num_train=16384",
        "data.num_features=256",
        "model=mlp",
        "model.hidden=[1024,1024]",
        "train.batch_size=128",
    ],
}

COMPRESSORS: dict[str, list[str]] = {
    "identity": ["compressor=identity"],
    "fp16": ["compressor=fp16"],
    "bf16": ["compressor=bf16"],
    "topk1%+ef14": ["compressor=topk", "compressor.ratio=0.01", "error_feedback=ef14"],
    "randomk1%+ef14": ["compressor=randomk", "compressor.ratio=0.01", "error_feedback=ef14"],
    "qsgd": ["compressor=qsgd"],
    "terngrad": ["compressor=terngrad"],
    "sign+ef14": ["compressor=sign", "error_feedback=ef14"],
    # Signum as conf/compressor/signum.yaml prescribes: momentum before the vote, small lr.
    "signum": [
        "compressor=signum",
        "error_feedback.momentum=0.9",
        "optimizer.momentum=0",
        "optimizer.lr=0.001",
    ],
    "powersgd-r2+ef14": ["compressor=powersgd", "compressor.rank=2", "error_feedback=ef14"],
}
DEFAULT_COMPRESSORS = [
    "identity",
    "fp16",
    "topk1%+ef14",
    "randomk1%+ef14",
    "qsgd",
    "sign+ef14",
    "signum",
    "powersgd-r2+ef14",
]


def compose(*overrides: str):
    """The run configuration `python -m dpresearch.train overrides...` would compose."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import dpresearch.train  # noqa: F401 - registers the schema
    from dpresearch import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))
