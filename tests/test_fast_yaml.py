"""The fast config reader equals yaml.safe_load on every config the trainer writes and on
tricky scalars (falling back to PyYAML outside its subset)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from helpers import CONF_DIR, compose_config
from omegaconf import OmegaConf

from dpresearch.analysis.fast_yaml import Unsupported, _parse, load_config

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("overrides", [
    [], ["algorithm=choco", "compressor=topk"], ["algorithm=sgp", "topology=torus"],
    ["optimizer=adamw", "schedule=onecycle", "logger=wandb", "logger.tags=[a,b]"],
    *([f"experiment={e}"] for e in EXPERIMENTS),
])  # fmt: skip
def test_resolved_configs_parse_without_fallback(overrides):
    text = OmegaConf.to_yaml(OmegaConf.to_container(compose_config(*overrides), resolve=True))
    assert same(_parse(text), yaml.safe_load(text))


TRICKY = {
    "a": [1, -2, 3.5, 1e-05, 1e20, float("inf"), float("-inf"), float("nan"), 0.0, -0.0],
    "b": ["", "null", "yes", "on", "012", "0x1F", "1:30", "2026-11-22", "a: b", "x #y", "~",
          "it's", " lead", "-x", "- x", "1e5", ".5", "-.5", "=", "<<", "@x", "%x", "a\\nb",
          "é", "*x", "&x", "!x", "[1]", "{a: 1}", "true", "1_000", "+1", "?x", "? x"],
    "c": {"d": {"e": [], "f": {}, "g": None, "h": True}, "i": [[1, 2], {"j": 1}]},
    "true": 1, "1": "one", "null": 2, "k k": 3, "l": "multi\nline",
}  # fmt: skip


def test_tricky_scalars_equal_pyyaml():
    for value in [*TRICKY["a"], *TRICKY["b"]]:
        text = yaml.safe_dump({"v": value, "w": [value]}, sort_keys=False)
        assert same(load_config(text), yaml.safe_load(text)), text
    text = yaml.safe_dump(TRICKY, sort_keys=False)
    assert same(load_config(text), yaml.safe_load(text))
    assert load_config("") == {}
    for text in ("a: 1\n\tb: 2\n", "a: &x 1\nb: *x\n", "a:\n- b: 1\n", "a: |\n  x\n"):
        with pytest.raises(Unsupported):
            _parse(text)
