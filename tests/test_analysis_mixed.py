"""`dpresearch analysis` over mixed runs (issue 33, item 6): each series is labelled only with
the settings that differ between the runs shown and apply to it, the title is true of every
run, the legend lies inside the figure, every figure's caption says what its band or bar is,
and matplotlib has nothing to warn about."""

from __future__ import annotations

import warnings

import yaml
from helpers import ramp, write_run
from matplotlib.backends.backend_agg import FigureCanvasAgg

from dpresearch.analysis import ReportSpec, load_report, write_report
from dpresearch.analysis.plots import plot_groups, plot_histograms

TOPOLOGY = {"_target_": "dpresearch.comm.topology.Ring", "weights": "metropolis"}
PROTOCOL = {"_target_": "dpresearch.asynchrony.protocol.ASGD"}
ASYNC = {"speed": "constant", "compute_s": 0.1}
IDENTITY = {"_target_": "dpresearch.compress.casts.Identity"}
NO_EF = {"_target_": "x.ErrorFeedback", "mode": "none"}
SGD = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9}
ADAMW = {"_target_": "torch.optim.AdamW", "lr": 0.1, "betas": [0.9, 0.99]}

# name → (algorithm choice, its node, optimizer choice, optimizer node, K)
RUNS = {
    "sync": ("sync", {"_target_": "x.SyncSGD", "compressor": IDENTITY, "error_feedback": NO_EF,
                      "buffers": "broadcast"}, "sgd", SGD, 2),
    "sync_adamw": ("sync", {"_target_": "x.SyncSGD", "compressor": IDENTITY,
                            "error_feedback": NO_EF, "buffers": "broadcast"}, "adamw", ADAMW, 2),
    "choco": ("choco", {"_target_": "x.ChocoSGD", "topology": TOPOLOGY, "gamma": 0.5,
                        "compressor": IDENTITY, "error_feedback": NO_EF}, "sgd", SGD, 4),
    "async": ("async_sgd", {"_target_": "x.AsyncSGD", "options": ASYNC, "protocol": PROTOCOL,
                            "compressor": IDENTITY, "error_feedback": NO_EF}, "sgd", SGD, 16),
}  # fmt: skip


def write_mixed(root):
    """Four kinds of run, two seeds each, as the trainer writes them: every config holds the
    top-level topology, protocol and async nodes; only the algorithm that uses one embeds it.
    The two asynchronous kinds differ in their protocol (asgd, ssp), the gossip one in its
    topology (ring, torus): neither may show on a synchronous run's label."""
    kinds = [*RUNS.items(), ("async_ssp", RUNS["async"]), ("choco_torus", RUNS["choco"])]
    for name, (algorithm, node, optimizer, opt_node, workers) in kinds:
        for seed in (0, 1):
            accs = ramp(0.5 + len(name) / 100 + seed / 100)
            run = write_run(root / f"{name}-s{seed}", lr=0.1, seed=seed, accs=accs, final_loss=0.5)
            config = yaml.safe_load((run / "config.yaml").read_text())
            protocol = "ssp" if name == "async_ssp" else "asgd"
            topology = "torus" if name == "choco_torus" else "ring"
            node = {**node, "seed": seed}
            if "protocol" in node:
                node["protocol"] = {"_target_": f"x.{protocol.upper()}"}
            if "topology" in node:
                node["topology"] = {"_target_": f"x.{topology.title()}"}
            config.update(
                workers=workers,
                algorithm=node,
                optimizer=opt_node,
                compressor=IDENTITY,
                error_feedback=NO_EF,
                topology={"_target_": f"x.{topology.title()}"},
                protocol={"_target_": f"x.{protocol.upper()}"},
                **{"async": ASYNC},
            )
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            (run / ".hydra").mkdir()
            choices = {
                "algorithm": algorithm,
                "optimizer": optimizer,
                "compressor": "identity",
                "error_feedback": "none",
                "topology": topology,
                "protocol": protocol,
                "model": "mlp",
                "data": "synthetic",
                "outer": "none",
            }
            (run / ".hydra" / "hydra.yaml").write_text(
                yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}, sort_keys=False)
            )
            lines = (run / "metrics.jsonl").read_text().splitlines()
            # a language model's curves as well: the analysis plots them against tokens
            extra = [
                line[:-1] + f', "tokens": {1000 * (i + 1)}, "test/bpc": {3 - i / 10}}}'
                for i, line in enumerate(lines)
            ]
            (run / "metrics.jsonl").write_text("\n".join(extra) + "\n")
    return root


def test_mixed_runs_are_labelled_by_what_applies_and_titled_truly(tmp_path):
    report = load_report([write_mixed(tmp_path / "runs")], ReportSpec())
    labels = sorted(report.table["case"])
    assert labels == [
        "async_sgd, optimizer=sgd, protocol=asgd, workers=16",
        "async_sgd, optimizer=sgd, protocol=ssp, workers=16",
        "choco(0.5), optimizer=sgd, topology=ring, workers=4",
        "choco(0.5), optimizer=sgd, topology=torus, workers=4",
        "sync, optimizer=adamw, workers=2",
        "sync, optimizer=sgd, workers=2",
    ], labels
    for label in labels:  # nothing that does not apply, no class paths, no missing values
        assert "_target_" not in label and "nan" not in label and "momentum" not in label
    assert report.table["n"].tolist() == [2] * 6  # the seeds are still aggregated
    assert report.spec.title == "mlp on synthetic, K = 2, 4, 16"
    cases = next(n for n in report.notes if n.startswith("cases:"))
    assert "async." not in cases and "optimizer.momentum" not in cases, cases


def test_figures_hold_their_legend_say_their_band_and_raise_no_warning(tmp_path, monkeypatch):
    root = write_mixed(tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any library warning fails the test
        report = load_report([root], ReportSpec())
        out = write_report(report, tmp_path / "results")
        text = out.read_text()
        for stem in ("test_acc_vs_epoch", "test_bpc_vs_tokens", "train_loss_vs_comm_bytes"):
            assert f"![{stem}]({stem}.png)\n*Lines: the mean over each case's runs" in text
        assert "band: ± one sample standard deviation" in text

        long = {
            f"{label}, " + ", ".join(f"setting_{i}=value_{i}" for i in range(12)): runs
            for label, runs in report.groups.items()
        }
        fig = plot_groups(
            report.metrics,
            long,
            "epoch",
            "test/acc",
            [tmp_path / "long.png"],
            title=report.spec.title,
        )
        FigureCanvasAgg(fig).draw()  # laid out as saved
        inside(fig, [fig.legends[0], *(ax.title for ax in fig.axes)])

        series = {f"case {i}": [10.0 * (i + 1), 5.0, 1.0] for i in range(6)}
        hist = plot_histograms(
            series,
            "staleness τ (server updates)",
            "gradients (count)",
            tmp_path / "hist.png",
            "six cases",
        )
    assert len([ax for ax in hist.axes if ax.get_visible()]) == 6  # one series per panel
    assert all(len(ax.patches) == 1 for ax in hist.axes)
    assert "bars:" in hist.dpresearch_caption


def inside(fig, artists) -> None:
    """Every artist's drawn box lies within the figure (nothing clipped)."""
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    for artist in artists:
        extent = artist.get_window_extent(renderer)
        assert extent.x0 >= box.x0 - 1 and extent.y0 >= box.y0 - 1, (artist, extent, box)
        assert extent.x1 <= box.x1 + 1 and extent.y1 <= box.y1 + 1, (artist, extent, box)
