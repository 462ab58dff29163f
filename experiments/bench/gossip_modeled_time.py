"""Benchmark (modeled): one step's communication time of ring gossip vs ring allreduce, for
K = 8 … 256 workers on every network preset, showing where each wins.

Each worker's model message is D bytes. Priced by `dpresearch.comm.network` (α-β):
- allreduce (sync SGD, ring):             2(K−1)α + 2(K−1)/K · D/B
- gossip on a ring (D-PSGD, 2 peers):     α + 2·D/B
- gossip on the exponential graph:        α + ⌈log₂K⌉·D/B  (peers at distance 2^i)
- gossip, one peer (SGP's graph):         α + D/B
Allreduce pays latency growing with K; gossip pays bandwidth per peer but a constant number of
rounds. So gossip wins when latency-bound (many workers, small models, slow α) and loses its
edge when bandwidth-bound (large D, fast α): 2D/B vs ≈ 2D/B. Rounds to consensus are not in
these figures (the spectral gap is: a ring needs O(K²) rounds to mix, the exponential graph
O(log K)), which is why accuracy per epoch must be read beside them.

    python experiments/bench/gossip_modeled_time.py [--sizes-mb 1.1 44.7] [--json out.json]

The sizes default to ResNet-20 (0.27 M parameters, 1.1 MB) and ResNet-18 (11.2 M, 44.7 MB)
in fp32. Prints one table per size and network; the crossover column says from which K the
ring gossip step is cheaper than allreduce.
"""

from __future__ import annotations

import argparse
import json
import math

from dpresearch.comm.ledger import CommOp
from dpresearch.comm.network import PRESETS, NetworkModel

WORKERS = (8, 16, 32, 64, 128, 256)


def step_seconds(net: NetworkModel, k: int, nbytes: int) -> dict[str, float]:
    """Modeled seconds of one step's model/gradient exchange per scheme."""
    peers_exp = math.ceil(math.log2(k))
    return {
        "allreduce": net.op_seconds(CommOp("allreduce", nbytes, k)),
        "ring gossip": net.op_seconds(CommOp("p2p", nbytes, k, peers=2)),
        "exponential gossip": net.op_seconds(CommOp("p2p", nbytes, k, peers=peers_exp)),
        "one-peer gossip": net.op_seconds(CommOp("p2p", nbytes, k, peers=1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.1, 44.7])
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    results = []
    for size in args.sizes_mb:
        nbytes = round(size * 1e6)
        for name in PRESETS:
            net = NetworkModel.preset(name)
            rows = {k: step_seconds(net, k, nbytes) for k in WORKERS}
            schemes = list(rows[WORKERS[0]])
            print(f"\n{size:g} MB per worker, {name} (α {net.latency_s * 1e6:g} µs): ms per step")
            print(f"{'K':>5} " + " ".join(f"{s:>19}" for s in schemes) + "   ring/allreduce")
            for k, row in rows.items():
                cells = " ".join(f"{row[s] * 1e3:>19.3f}" for s in schemes)
                print(f"{k:>5} {cells}   {row['ring gossip'] / row['allreduce']:>14.2f}")
            cheaper = [k for k, r in rows.items() if r["ring gossip"] < r["allreduce"]]
            verdict = f"ring gossip cheaper from K = {cheaper[0]}" if cheaper else "never"
            print(f"  {verdict} (up to K = {WORKERS[-1]})")
            results.append(
                {"size_mb": size, "network": name, "seconds": rows, "crossover": verdict}
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
