"""Benchmark: gossip vs allreduce on gloo × K, measured against the α-β model (issue 7).

Two parts, each printing ratios measured in one run (medians with p10–p90 spread over
alternating rounds; one torch thread per process on both sides):

1. `--loopback` (no privileges): the training step time of D-PSGD on a ring vs synchronous
   allreduce, K gloo processes on this machine (`python -m dpresearch.train backend=gloo`),
   the same model and data, rounds alternating sync / D-PSGD. A step's time is taken inside the
   step (`time/compute_s` + `time/comm_s` between consecutive log rows, every step logged), so
   neither side pays for logging (gossip's consensus-distance metric is a model-sized
   allreduce). The ratio is D-PSGD / sync.

2. Emulated network (root): K network namespaces, each with one veth into a bridge held by a
   hub namespace; both ends of every veth are shaped by `tc tbf rate R`, so every worker has a
   full-duplex link of R bit/s to a non-blocking switch. Payloads of `--sizes` MB travel as
   (a) a ring allreduce (`Communicator.all_reduce`, what sync SGD does with the gradient) and
   (b) a ring neighbour exchange (`Communicator.neighbor_exchange`, what D-PSGD does with the
   model: D bytes to each of 2 peers), posted one ring distance at a time (`by_distance`, the
   default across machines) and (c) in one batch (`one_batch`); each op preceded by an
   untimed barrier (the
   barrier-isolated regime: the op starts with every rank present). Modeled: `network=custom`
   with α measured through gloo on the same link (median 4-byte op: allreduce ÷ 2(K−1) and
   neighbour exchange ÷ 1, fitted separately and printed) and B = R/8/f, f = 1514/1448 (an
   Ethernet frame of 1500-byte MTU carries 1448 TCP payload bytes). Target: measured/modeled
   within 0.8–1.25 for payloads ≥ 1 MB.

    python experiments/bench/emulated_gossip.py --loopback [--workers 4] [--steps 30] [--rounds 2]
    python experiments/bench/emulated_gossip.py [--rate 100mbit] [--sizes 1 4] [--reps 5]
        [--workers 4] [--json out.json]

The emulated part creates its namespaces under unique names and always removes them; it exits
0 with one `skipped:` line where it cannot run (not root, no `ip`/`tc`, no namespaces, no tbf).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulated_network import Unavailable, _run, _why, parse_rate, skip_reason

REPO = Path(__file__).resolve().parents[2]
PORT = 29500
FRAME_OVERHEAD = 1514 / 1448


# -- part 1: training step time on loopback ---------------------------------------------------
def loopback(args: argparse.Namespace) -> dict:
    """Median per-step wall time of sync and D-PSGD ring on K gloo processes, alternating."""
    cases = {"sync": ["algorithm=sync"], "dpsgd ring": ["algorithm=dpsgd", "topology=ring"]}
    base = [
        f"workers={args.workers}",
        "backend=gloo",
        "backend.threads=1",
        "data.num_train=4096",
        "data.num_features=256",
        "model.hidden=[1024,1024]",
        f"train.steps={args.steps}",
        "train.log_every=1",
        "train.progress=false",
        "train.eval_every=100000",
        "train.save_model=false",
        "train.batch_size=32",
    ]
    per_case: dict[str, list[float]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(cases)[::-1]
            for name in order:
                run_dir = Path(tmp) / f"{name.replace(' ', '_')}_{r}"
                cmd = [
                    sys.executable,
                    "-m",
                    "dpresearch.train",
                    *base,
                    *cases[name],
                    f"hydra.run.dir={run_dir}",
                ]
                subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
                text = (run_dir / "metrics.jsonl").read_text()
                rows = [json.loads(line) for line in text.splitlines()]
                # Time inside the step (compute + comm), not between log rows: logging adds
                # metric traffic (gossip's consensus distance is a model-sized allreduce).
                inside = [row["time/compute_s"] + row["time/comm_s"] for row in rows]
                steps = [b - a for a, b in zip(inside[:-1], inside[1:], strict=True)]
                per_case[name] += steps[args.warmup :]
                print(
                    f"round {r} {name}: median step {statistics.median(steps) * 1e3:.1f} ms",
                    flush=True,
                )
    result = {name: spread(times) for name, times in per_case.items()}
    ratio = result["dpsgd ring"]["median"] / result["sync"]["median"]
    print(f"\nloopback, {args.workers} gloo processes × 1 thread, MLP 256-1024-1024-10:")
    for name, fig in result.items():
        print(f"  {name:>11}: {fmt(fig)} ms per step")
    print(f"  ratio D-PSGD ring / sync (medians): {ratio:.2f}")
    return {"loopback": result, "ratio": ratio}


def spread(values: list[float]) -> dict[str, float]:
    deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
    return {"median": statistics.median(values), "p10": deciles[0], "p90": deciles[-1]}


def fmt(fig: dict[str, float], scale: float = 1e3) -> str:
    median, p10, p90 = (fig[key] * scale for key in ("median", "p10", "p90"))
    return f"{median:.2f} (p10 {p10:.2f}, p90 {p90:.2f})"


# -- part 2: the emulated switch --------------------------------------------------------------
class Switch:
    """A hub namespace with bridge `br0` and K worker namespaces, each joined to it by a veth
    shaped with tbf on both ends. Context manager: removes everything it made."""

    def __init__(self, k: int, rate: str, burst_us: float = 1000.0, queue_ms: float = 50.0):
        self.k, self.rate = k, rate
        self.burst = max(3028, round(parse_rate(rate) / 8 * burst_us * 1e-6))
        self.queue_ms = queue_ms
        tag = f"dpg{os.getpid() % 100000}"
        self.hub = f"{tag}h"
        self.ns = [f"{tag}w{r}" for r in range(k)]
        self.dev = [f"{tag}w{r}" for r in range(k)]
        self.port = [f"{tag}p{r}" for r in range(k)]
        subnet = 1 + os.getpid() % 250
        self.addr = [f"10.214.{subnet}.{r + 1}" for r in range(k)]
        self._made: list[str] = []

    def __enter__(self) -> Switch:
        try:
            for ns in [self.hub, *self.ns]:
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for r in range(self.k):
                _run("ip", "link", "add", self.dev[r], "type", "veth", "peer", "name", self.port[r])
                _run("ip", "link", "set", self.dev[r], "netns", self.ns[r])
                _run("ip", "link", "set", self.port[r], "netns", self.hub)
                _run("ip", "-n", self.hub, "link", "set", self.port[r], "master", "br0")
                _run("ip", "-n", self.hub, "link", "set", self.port[r], "up")
                _run(
                    "ip", "-n", self.ns[r], "addr", "add", f"{self.addr[r]}/24", "dev", self.dev[r]
                )
                _run("ip", "-n", self.ns[r], "link", "set", self.dev[r], "up")
                _run("ip", "-n", self.ns[r], "link", "set", "lo", "up")
                for ns, dev in ((self.ns[r], self.dev[r]), (self.hub, self.port[r])):
                    _run(
                        "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root",
                        "tbf", "rate", self.rate, "burst", str(self.burst),
                        "latency", f"{self.queue_ms}ms",
                    )  # fmt: skip
        except (OSError, subprocess.CalledProcessError) as exc:
            self.__exit__(None, None, None)
            raise Unavailable(f"cannot build the emulated switch: {_why(exc)}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()


def worker(spec: dict) -> None:
    """One rank inside its namespace: calibrate α, then time every (size, op) pair."""
    import torch
    import torch.distributed as dist

    from dpresearch.comm.distributed import DistributedCommunicator
    from dpresearch.comm.network import NetworkModel

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = spec["dev"]
    rank, k = spec["rank"], spec["workers"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{spec['master']}:{PORT}", rank=rank, world_size=k
    )
    try:
        comm = DistributedCommunicator(NetworkModel(1e-5, 1e9), p2p_schedule="by_distance")
        batched = DistributedCommunicator(NetworkModel(1e-5, 1e9), p2p_schedule="one_batch")
        ring = [[(i - 1) % k, (i + 1) % k] for i in range(k)]

        def allreduce(x):
            return comm.all_reduce(x, op="sum", record=False)

        def exchange(x):
            return comm.neighbor_exchange(x, ring, ring, record=False)

        def exchange_one_batch(x):
            return batched.neighbor_exchange(x, ring, ring, record=False)

        def timed(fn, x, reps: int) -> list[float]:
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                fn(x)
                times.append(time.perf_counter() - start)
            return times

        tiny = torch.zeros(1, 1)
        exchange(tiny)  # warm-up: connections and the first batched P2P call
        exchange_one_batch(tiny)
        alpha_ar = statistics.median(timed(allreduce, tiny, 100)) / (2 * (k - 1))
        alpha_p2p = statistics.median(timed(exchange, tiny, 100))
        result = {"alpha_allreduce_s": alpha_ar, "alpha_p2p_s": alpha_p2p, "ops": {}}
        for size in spec["sizes"]:
            x = torch.zeros(1, round(size * 1e6) // 4)
            ops = {
                "allreduce": allreduce,
                "ring exchange": exchange,
                "ring exchange 1 batch": exchange_one_batch,
            }
            runs: dict[str, list[float]] = {name: [] for name in ops}
            for rep in range(spec["reps"]):
                for name in list(ops)[:: 1 if rep % 2 == 0 else -1]:
                    runs[name] += timed(ops[name], x, 1)
            result["ops"][str(size)] = runs
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def emulated(args: argparse.Namespace) -> dict:
    reason = skip_reason("mlp")
    if reason:
        raise Unavailable(reason)
    from dpresearch.comm.ledger import CommOp
    from dpresearch.comm.network import NetworkModel

    k = args.workers
    with Switch(k, args.rate) as switch, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        procs = []
        for r in range(k):
            spec = {
                "rank": r,
                "workers": k,
                "dev": switch.dev[r],
                "master": switch.addr[0],
                "sizes": args.sizes,
                "reps": args.reps,
                "out": str(out),
            }
            path = Path(tmp) / f"spec{r}.json"
            path.write_text(json.dumps(spec))
            cmd = [
                "ip",
                "netns",
                "exec",
                switch.ns[r],
                sys.executable,
                __file__,
                "--worker",
                str(path),
            ]
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        logs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(log[-2000:] for log in logs))
        result = json.loads(out.read_text())
    bandwidth = parse_rate(args.rate) / 8 / FRAME_OVERHEAD
    p2p = NetworkModel(result["alpha_p2p_s"], bandwidth)
    models = {
        "allreduce": NetworkModel(result["alpha_allreduce_s"], bandwidth),
        "ring exchange": p2p,
        "ring exchange 1 batch": p2p,
    }
    print(
        f"\nemulated switch: {k} gloo ranks, tbf {args.rate} on both ends of every link; "
        f"α fitted: allreduce {result['alpha_allreduce_s'] * 1e6:.0f} µs, neighbour exchange "
        f"{result['alpha_p2p_s'] * 1e6:.0f} µs; B = {bandwidth / 1e6:.2f} MB/s"
    )
    print(f"{'MB':>6} {'op':>22} {'measured ms (p10, p90)':>34} {'modeled ms':>11} {'ratio':>6}")
    table = []
    for size, runs in result["ops"].items():
        nbytes = round(float(size) * 1e6) // 4 * 4
        for name, times in runs.items():
            op = (
                CommOp("allreduce", nbytes, k)
                if name == "allreduce"
                else CommOp("p2p", nbytes, k, peers=2)
            )
            modeled = models[name].op_seconds(op)
            fig = spread(times)
            ratio = fig["median"] / modeled
            print(f"{size:>6} {name:>22} {fmt(fig):>34} {modeled * 1e3:>11.1f} {ratio:>6.2f}")
            table.append(
                {"size_mb": float(size), "op": name, **fig, "modeled": modeled, "ratio": ratio}
            )
    return {"calibration": {k: v for k, v in result.items() if k != "ops"}, "ops": table}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--loopback", action="store_true")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", default="100mbit")
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.25, 1.0, 4.0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(Path(args.worker).read_text()))
        return
    try:
        result = loopback(args) if args.loopback else emulated(args)
    except Unavailable as exc:
        print(f"skipped: {exc}")
        return
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
