"""Tune CHOCO-SGD's consensus step size γ offline:
`python -m dpresearch.tune_gamma topology=ring workers=9 compressor=topk compressor.ratio=0.01`.

Runs compressed gossip alone (CHOCO-SGD's consensus steps, no gradients: the `ChocoSGD`
algorithm itself with a zero learning rate) on seeded random vectors, one per worker, for each
γ of a grid, and prints the γ whose consensus distance Ξ² = (1/K) Σ_i ‖x_i − x̄‖² is lowest
after `steps` steps, with Ξ²_t/Ξ²_0 along the way for every γ. This is what ChocoSGD's
`tune_consensus_stepsize.py` did by hand (they report γ = 0.04 for top-1%, 0.01 for random-1%,
0.34 for QSGD with 16 levels on a ring of 9 workers, d = 2000).

Options (Hydra overrides, composed from `dpresearch/conf/tune_gamma.yaml`): `topology=…`,
`compressor=…` with their keys, `workers`, `seed`, `dim`, `steps`, `gammas` (a list; default a
log grid from 0.001 to 1), `points` (curve points printed), `output` (a JSON file for the
curves). `--help` prints this and the default configuration. While it runs, one progress line
per γ goes to stderr; the table goes to stdout at the end.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn

from dpresearch import CONF_DIR
from dpresearch.algorithms.choco import ChocoSGD
from dpresearch.comm.network import NetworkModel
from dpresearch.comm.simulated import SimulatedCommunicator
from dpresearch.replicas import Replicas

DEFAULT_GAMMAS = [round(10 ** (e / 4), 6) for e in range(-12, 1)]  # 0.001 … 1, 4 per decade


class _Vector(nn.Module):
    """A 'model' that is one trainable vector of `dim` entries."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim))


def consensus_curve(cfg: DictConfig, gamma: float) -> list[float]:
    """Ξ²_t / Ξ²_0 for t = 0 … steps (every step) under compressed gossip with step size γ."""
    k = int(cfg.workers)
    comm = SimulatedCommunicator(k, NetworkModel.preset("10gbe"))
    replicas = Replicas(_Vector(int(cfg.dim)), k, torch.device("cpu"))
    gen = torch.Generator().manual_seed(int(cfg.seed))
    replicas.params.copy_(torch.randn(replicas.params.shape, generator=gen))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in replicas.models]
    choco = ChocoSGD(
        replicas,
        comm,
        optimizers,
        topology=cfg.topology,
        gamma=gamma,
        compressor=cfg.compressor,
        seed=int(cfg.seed),
        granularity="model",
        eval_local_models=False,
    )
    start = choco.metrics()["gossip/consensus_distance"]
    curve = [1.0]
    for step in range(int(cfg.steps)):
        choco.after_backward(step)
        value = choco.metrics()["gossip/consensus_distance"] / start
        curve.append(value if math.isfinite(value) else math.inf)
        if curve[-1] == math.inf or curve[-1] > 1e12:
            curve.extend([math.inf] * (int(cfg.steps) - step - 1))
            break
    return curve


def tune(cfg: DictConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every γ's curve and the best γ (lowest Ξ² after `steps` steps); `progress` receives
    one line before the first γ and one after each."""
    gammas = [float(g) for g in (cfg.gammas if cfg.gammas else DEFAULT_GAMMAS)]
    say = progress or (lambda line: None)
    # one step first: a topology or compressor that cannot be built fails before any line
    consensus_curve(OmegaConf.merge(cfg, {"steps": 1}), gammas[0])
    say(
        f"tuning gamma: {len(gammas)} values x {int(cfg.steps)} gossip steps "
        f"(K={cfg.workers}, d={cfg.dim})"
    )
    curves: dict[float, list[float]] = {}
    started = time.perf_counter()
    for i, gamma in enumerate(gammas, 1):
        curves[gamma] = consensus_curve(cfg, gamma)
        took = time.perf_counter() - started
        eta = took / i * (len(gammas) - i)
        say(
            f"  [{i}/{len(gammas)}] gamma {gamma:g}: final Ξ²/Ξ²_0 {curves[gamma][-1]:.3e} "
            f"({took:.0f} s, ETA {eta:.0f} s)"
        )
    best = min(curves, key=lambda g: curves[g][-1])
    return {"best_gamma": best, "final": {g: c[-1] for g, c in curves.items()}, "curves": curves}


def report(cfg: DictConfig, result: dict[str, Any]) -> str:
    """The table printed to the terminal: one row per γ, Ξ²_t/Ξ²_0 at `points` times."""
    steps, points = int(cfg.steps), max(2, int(cfg.points))
    marks = sorted({round(steps * i / (points - 1)) for i in range(points)})
    topology = OmegaConf.to_container(cfg.topology)
    compressor = OmegaConf.to_container(cfg.compressor)
    lines = [
        f"compressed gossip, K={cfg.workers}, d={cfg.dim}, {steps} steps, seed {cfg.seed}",
        f"topology: {topology}",
        f"compressor: {compressor}",
        "Ξ²_t / Ξ²_0 (consensus distance relative to the start; lower is better):",
        "gamma     " + "".join(f"{'t=' + str(t):>11}" for t in marks),
    ]
    for gamma, curve in result["curves"].items():
        star = " *" if gamma == result["best_gamma"] else ""
        lines.append(f"{gamma:<10g}" + "".join(f"{curve[t]:>11.3e}" for t in marks) + star)
    lines.append(f"best gamma: {result['best_gamma']:g} (algorithm.gamma={result['best_gamma']:g})")
    return "\n".join(lines)


def compose_tuning_config(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="tune_gamma", overrides=overrides)


def usage() -> str:
    """`--help`: what the tuner does, how it is called, and its default configuration."""
    defaults = OmegaConf.to_yaml(compose_tuning_config([]))
    return (
        "usage: python -m dpresearch.tune_gamma [KEY=VALUE ...]   (or: dpresearch tune-gamma)\n\n"
        f"{(__doc__ or '').strip()}\n\ndefault configuration:\n{defaults}"
    )


def main(argv: list[str] | None = None) -> None:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):
        print(usage())
        return
    try:
        cfg = compose_tuning_config(overrides)
        if cfg.workers < 2 or cfg.dim < 1 or cfg.steps < 1:
            raise ValueError("workers must be >= 2, dim >= 1 and steps >= 1")
        result = tune(cfg, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, TypeError, HydraException, OmegaConfBaseException) as exc:
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        message = str(cause).strip().splitlines()[0] if str(cause).strip() else repr(cause)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    print(report(cfg, result))
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
