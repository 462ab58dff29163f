"""results.md and the plots of the asynchronous study, written from its runs."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt(x: float) -> str:
    return f"{x:.3e}" if x == x and x != float("inf") else "diverged"


# -- (a) ----------------------------------------------------------------------------------------
def _updates_per_100s(record: dict) -> float:
    return 100.0 * record["updates"][-1] / max(record["time"][-1], 1e-9)


def _tau(record: dict) -> tuple[float, int]:
    hist = record["histogram"]
    total = sum(hist)
    mean = sum(t * n for t, n in enumerate(hist)) / total if total else 0.0
    return mean, len(hist) - 1


def _at(record: dict, t: float) -> float:
    before = [g for s, g in zip(record["time"], record["gap"], strict=True) if s <= t]
    return before[-1] if before else record["gap"][0]


def _time_to(record: dict, target: float) -> float:
    """Simulated time at which f − f* first falls to `target` (inf if never)."""
    for t, g in zip(record["time"], record["gap"], strict=True):
        if g <= target:
            return t
    return float("inf")


def _findings(least: dict) -> list[str]:
    """One-sentence readings of the table, computed from it."""
    cases = list(least)
    sync = "minibatch SGD (sync)"
    asgd = "async SGD, constant lr"
    out = []
    if len(cases) == 2 and all(sync in least[c] and asgd in least[c] for c in cases):

        def per_update(case: str, method: str) -> float:
            seeds = least[case][method]["seeds"]
            return statistics.mean(r["time"][-1] / max(1, r["updates"][-1]) for r in seeds)

        s0, s1 = per_update(cases[0], sync), per_update(cases[1], sync)
        a0, a1 = per_update(cases[0], asgd), per_update(cases[1], asgd)
        out.append(
            f"- **The straggler sets the barrier's pace, not asynchrony's:** a synchronous "
            f"update took {s0:.3g} simulated s without the straggler and {s1:.3g} s with it "
            f"(×{s1 / s0:.1f}); an asynchronous update {a0:.3g} s and {a1:.3g} s."
        )
    return out


def least_squares_section(least: dict, budget: float, out: Path) -> str:
    lines = [
        "## (a) Least squares (Mishchenko et al. 2022 set-up)",
        "",
        "n = 10⁴, d = 400, batch 256 per gradient, M = 40 workers with exponential compute "
        "times of mean 1 (the unit of simulated time), x₀ = 0, f(x₀) − f* = 0.111; pushes and "
        "pulls of 1.6 kB priced on 10 GbE (negligible here). Budget: "
        f"{budget:g} simulated seconds (≈ {budget:g} gradients per worker, the authors' 800 "
        "asynchronous iterations per worker). lr tuned per method and case on the grid below "
        "(seed 0, lowest final f − f*), then seeds 0–2 at the selected lr: the table gives the "
        "mean over seeds (min–max in brackets).",
        "",
        "| case | method | tuned lr | f − f* at T/4 | f − f* at T/2 | f − f* at T | simulated "
        "s to f − f* ≤ 1e-2 | updates in T | simulated s per update | mean τ | max τ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, methods in least.items():
        for method, res in methods.items():
            seeds = res["seeds"]
            cells = []
            for frac in (0.25, 0.5, 1.0):
                vals = [_at(r, frac * budget) for r in seeds]
                cells.append(f"{_fmt(statistics.mean(vals))} ({_fmt(min(vals))}–{_fmt(max(vals))})")
            updates = statistics.mean(r["updates"][-1] for r in seeds)
            per_update = statistics.mean(r["time"][-1] / max(1, r["updates"][-1]) for r in seeds)
            taus = [_tau(r) for r in seeds]
            reach = statistics.mean(_time_to(r, 1e-2) for r in seeds)
            cells.append(f"{reach:.0f}" if reach != float("inf") else "not in T")
            lines.append(
                f"| {case} | {method} | {res['lr']:g} | {' | '.join(cells)} | {updates:.0f} | "
                f"{per_update:.3g} | {statistics.mean(t[0] for t in taus):.1f} | "
                f"{max(t[1] for t in taus)} |"
            )
    lines += ["", *_findings(least), "", "lr grid (seed 0, final f − f*; ✓ selected):", ""]
    lines += ["| case | method | " + " | ".join(["lr", "f − f* at T"]) + " |", "|---|---|---|---|"]
    for case, methods in least.items():
        for method, res in methods.items():
            for lr, record in sorted(res["grid"].items()):
                mark = " ✓" if lr == res["lr"] else ""
                lines.append(f"| {case} | {method} | {lr:g}{mark} | {_fmt(record['gap'][-1])} |")
    plot_least_squares(least, out)
    lines += [
        "",
        "![f − f* against simulated time](least_squares_loss_vs_time.png)",
        "",
        "![τ histograms](least_squares_tau.png)",
        "",
    ]
    return "\n".join(lines)


def plot_least_squares(least: dict, out: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, len(least), figsize=(12, 4.5), sharey=True)
    for ax, (case, methods) in zip(axes, least.items(), strict=True):
        for method, res in methods.items():
            record = res["seeds"][0]
            gaps = [max(g, 1e-12) if g == g else float("nan") for g in record["gap"]]
            ax.plot(record["time"], gaps, marker=".", label=f"{method} (lr {res['lr']:g})")
        ax.set_yscale("log")
        ax.set_title(case)
        ax.set_xlabel("simulated time (mean gradient times)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("f(x) − f*")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "least_squares_loss_vs_time.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(least), figsize=(12, 4), sharey=True)
    for ax, (case, methods) in zip(axes, least.items(), strict=True):
        for method, res in methods.items():
            hist = res["seeds"][0]["histogram"]
            if len(hist) > 1:
                ax.step(range(len(hist)), hist, where="mid", label=method)
        ax.set_xscale("symlog", linthresh=50)
        ax.set_yscale("log")
        ax.set_title(case)
        ax.set_xlabel("staleness τ (server updates between read and apply)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gradients")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "least_squares_tau.png", dpi=110)
    plt.close(fig)


# -- (b) ----------------------------------------------------------------------------------------
def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _acc_at(rows: list[dict], t: float) -> float:
    evals = [r for r in rows if "test/acc" in r and r["time/simulated_s"] <= t + 1e-9]
    return evals[-1]["test/acc"] if evals else float("nan")


def cifar_section(cifar: dict, args, out: Path) -> str:
    selected = {m: runs[lr] for m, (lr, runs) in cifar.items()}
    ends = {m: _summary(d)["time/simulated_s"] for m, d in selected.items()}
    common = min(ends.values())
    lines = [
        "## (b) ResNet-20 on the CIFAR-10 subset",
        "",
        f"K = {8} workers × 32 images, exponential compute times of mean {args.compute_s:g} s, "
        "worker 0 four times slower, pushes and pulls (1.1 MB each) priced on 1 GbE; Nesterov "
        "SGD (momentum 0.9, weight decay 5e-4) at the server, cosine schedule with one warm-up "
        f"epoch; {args.epochs:g} epochs of gradients for every method (the same number of "
        "gradients; on this 2-core CPU machine that is what fits — far from converged, and the "
        "5085/1017-image subset is not comparable to full CIFAR-10). Each method at three lrs "
        "(the asynchronous grids centred on η/8 of sync's, since one push carries 1/8 of a "
        "synchronous update's gradients; the η/τ rule's on sync's η, about the same step at "
        "τ ≈ 7); lowest final training loss selects. One seed (what this machine allowed).",
        "",
        f"Accuracy at a common simulated time T = {common:.1f} s (when the fastest method "
        "finished its epochs) and at the end of each method's own run:",
        "",
        "| method | lr | simulated s for the run | test acc at T | final test acc | best test "
        "acc | train loss | updates | mean τ | max τ | MB pushed per worker | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, run_dir in selected.items():
        s, rows = _summary(run_dir), _metrics(run_dir)
        hist = s.get("async/tau_histogram", [])
        total = sum(hist)
        mean_tau = sum(t * n for t, n in enumerate(hist)) / total if total else 0.0
        lines.append(
            f"| {method} | {cifar[method][0]:g} | {s['time/simulated_s']:.1f} | "
            f"{_acc_at(rows, common):.3f} | {s['test/acc']:.3f} | {s['best/test_acc']:.3f} | "
            f"{s['train/loss']:.3f} | {s['async/updates']} | {mean_tau:.1f} | "
            f"{len(hist) - 1} | {s['comm/bytes'] / 1e6:.0f} | {s['time/wall_s']:.0f} |"
        )
    sync, asgd = selected.get("sync (barrier)"), selected.get("asgd")
    if sync is not None and asgd is not None:
        t_sync, t_asgd = _summary(sync)["time/simulated_s"], _summary(asgd)["time/simulated_s"]
        lines += [
            "",
            f"- **The straggler sets the barrier's pace, not asynchrony's:** the same "
            f"{args.epochs:g} epochs of gradients took the synchronous run {t_sync:.1f} simulated "
            f"s and asgd {t_asgd:.1f} s (×{t_sync / t_asgd:.1f}); a synchronous round lasts "
            "until worker 0 (4× slower) has pushed.",
        ]
    lines += ["", "lr grid (✓ selected):", "", "| method | lr | train loss | test acc |"]
    lines += ["|---|---|---|---|"]
    for method, (best, runs) in cifar.items():
        for lr, run_dir in sorted(runs.items()):
            s = _summary(run_dir)
            mark = " ✓" if lr == best else ""
            loss, acc = s["train/loss"], s["test/acc"]
            lines.append(f"| {method} | {lr:g}{mark} | {loss:.3f} | {acc:.3f} |")
    plot_cifar(selected, cifar, out)
    lines += [
        "",
        "![test accuracy against simulated time](cifar_acc_vs_time.png)",
        "",
        "![training loss against simulated time](cifar_loss_vs_time.png)",
        "",
    ]
    return "\n".join(lines)


def plot_cifar(selected: dict, cifar: dict, out: Path) -> None:
    plt = _plt()
    for y, name, label in [
        ("test/acc", "cifar_acc_vs_time.png", "test accuracy"),
        ("train/loss", "cifar_loss_vs_time.png", "training loss (log window)"),
    ]:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for method, run_dir in selected.items():
            rows = [r for r in _metrics(run_dir) if y in r and r[y] == r[y]]
            ax.plot(
                [r["time/simulated_s"] for r in rows],
                [r[y] for r in rows],
                marker="." if y == "test/acc" else None,
                label=f"{method} (lr {cifar[method][0]:g})",
            )
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


# -- the page -------------------------------------------------------------------------------------
def published_section() -> str:
    path = HERE / "published.csv"
    if not path.exists():
        return ""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    lines = [
        "## Published claims, side by side",
        "",
        "| paper | set-up | claim | source | here |",
        "|---|---|---|---|---|",
    ]
    keys = ("paper", "setup", "claim", "source", "here")
    lines += ["| " + " | ".join(r[k] for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_report(args, least: dict | None, cifar: dict | None) -> None:
    out: Path = args.results
    out.mkdir(parents=True, exist_ok=True)
    parts = [
        "# Asynchronous training study",
        "",
        "Generated by `python experiments/async/run.py` (see its docstring for the protocol). "
        "Simulated time is the event simulator's clock (`time/simulated_s`): seeded compute "
        "times plus α + bytes/B for every pull and push. One step of the training loop is one "
        "push; a synchronous round is K pushes and one update.",
        "",
    ]
    if least:
        parts.append(least_squares_section(least, args.budget, out))
    if cifar:
        parts.append(cifar_section(cifar, args, out))
    parts.append(published_section())
    (out / "results.md").write_text("\n".join(parts))
    print(f"wrote {out / 'results.md'}")
