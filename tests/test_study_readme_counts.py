"""Every count a study README states is the count its shipped run data hold (issue 32: counts
and claims are generated, not typed).

One case per claim: a regex finds the claim's words in the README (so rewording it breaks the
case), its captured counts are read as numbers ("five" → 5; "every", "all", "both", "each" → "all"),
and they must equal what the study's run data say, read through the harness's own loaders and
the report's counting (`counts.run_counts`, `grown_grids`, `pick_counts`: the counts results.md
states in its notes). A count changed on either side fails its case; the fix is the README.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pytest
from helpers import REPO, project_files

from dpresearch.analysis.runs import FINISHED
from dpresearch.study import load_study
from dpresearch.study.counts import PickCounts, grown_grids, pick_counts, run_counts
from dpresearch.study.report import StudyReport, build, load_data
from dpresearch.study.select import lr_column, untuned

NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve"
WORDS = {w: i for i, w in enumerate(NUMBERS.split())}
ALL = "all"


@cache
def report(study: str) -> StudyReport:
    """The report of `experiments/<study>.yaml`, built from its shipped run data."""
    loaded = load_study(REPO / "experiments" / f"{study}.yaml")
    return build(loaded, *load_data(loaded))


@cache
def readme(folder: str) -> str:
    return " ".join((REPO / folder / "README.md").read_text().split())  # lines joined


def number(text: str) -> Any:
    word = text.lower()
    if word in ("every", "all", "both", "each"):
        return ALL
    if word.isdigit():
        return int(word)
    return WORDS.get(word, word)


def quantifier(k: int, n: int) -> Any:
    """What a README's "every"/"all" states: ALL when k is n (and n > 0), else the count."""
    return ALL if k == n and n > 0 else k


def never(count: int) -> Any:
    """What a README's "never" states: "never" when `count` is 0, else the count."""
    return "never" if count == 0 else count


def picks(study: str) -> PickCounts:
    """The picks of `study`, summed over its horizons."""
    r = report(study)
    counts = [pick_counts(r.study, h) for h in r.horizons]
    return sum(counts[1:], counts[0])


def roles(study: str) -> dict[str, int]:
    r = report(study)
    return run_counts(r.study, r.runs)


def runs(study: str):
    return report(study).runs


def one_pick(study: str, case: str):
    return report(study).last.picks.get(case)


def growth(study: str) -> tuple[int, int, int, int]:
    """(grids grown, grids, grown upwards, grown downwards) of `study`."""
    grown = grown_grids(report(study).study, runs(study))
    up = sum(bool(u) for u, _ in grown.values())
    return len(grown), len(grid_sizes(study)), up, sum(bool(d) for _, d in grown.values())


def untrained(study: str):
    """The runs of `study` the report marks "did not train"."""
    return runs(study)[runs(study)["status"] == "did not train"]


def final_seeds(study: str) -> tuple[int, ...]:
    return report(study).study.final_seeds


def grid_sizes(study: str) -> list[int]:
    return [len(c.lrs) for c in report(study).study.cases if c.lr_from is None]


def total_steps(study: str) -> set[int]:
    return {int(v) for v in runs(study)["total_steps"].dropna()}


def final_means(study: str, metric: str) -> dict[str, float]:
    """Each case's mean of `metric` over its results row's finished runs (last horizon)."""
    from dpresearch.study.tables import results_frame

    r = report(study)
    _, raw = results_frame(r, r.last)
    return dict(zip(raw["case"], raw[metric], strict=True))


def dirichlet_pairs() -> list[tuple[str, str]]:
    """(Dirichlet case, its IID counterpart) of the gossip study (the allreduce variants with
    other BatchNorm statistics have none)."""
    names = [c.name for c in report(GS).study.cases]
    pairs = [(c, c.replace("Dirichlet 0.1", "IID")) for c in names if "Dirichlet" in c]
    return [(d, i) for d, i in pairs if i in names]


def dirichlet_lr_ratios() -> list[float]:
    """Each Dirichlet case's selected lr over its IID counterpart's (gossip study)."""
    return [one_pick(GS, d).lr / one_pick(GS, i).lr for d, i in dirichlet_pairs()]


def dirichlet_losses() -> list[float]:
    """Points of final test accuracy each gossip case loses on Dirichlet data."""
    means = final_means(GS, "test/acc")
    return [100 * (means[i] - means[d]) for d, i in dirichlet_pairs()]


def seeds_by_speed(study: str, case: str, above: float) -> tuple[list[int], list[int]]:
    """(fast, slow) seeds of `case` at its selected lr: slow ones end above `above` test bits
    per character."""
    r = report(study)
    pick = one_pick(study, r.study.case(case).lr_from or case)
    rows = r.runs[(r.runs["case"] == case) & (r.runs[lr_column(r.study)] == pick.lr)]
    pairs = sorted(zip(rows["cfg.seed"].astype(int), rows["test/bpc"], strict=True))
    return [s for s, v in pairs if v <= above], [s for s, v in pairs if v > above]


def same_slow_seeds(study: str, cases: tuple[str, ...], above: float) -> tuple:
    """The slow seeds every one of `cases` shares, with "all" — or each case's, when they differ."""
    slow = [tuple(seeds_by_speed(study, c, above)[1]) for c in cases]
    return (*slow[0], ALL) if len(set(slow)) == 1 else tuple(slow)


def stalls_by_lr(study: str, cases: tuple[str, ...], above: float) -> tuple[int, ...]:
    """(stalled, runs) at lr ≤ 0.004, at 0.008 and at 0.016 over every run of `cases` (tuning
    and final seeds): a stalled run ends above `above` test bits per character."""
    rows = runs(study)[runs(study)["case"].isin(cases)]
    lr = rows[lr_column(report(study).study)]
    assert set(lr) <= {0.002, 0.004, 0.008, 0.016}, sorted(set(lr))  # no run left out
    counts: tuple[int, ...] = ()
    for part in (rows[lr <= 0.004], rows[lr == 0.008], rows[lr == 0.016]):
        counts += (int((part["test/bpc"] > above).sum()), len(part))
    return counts


def stalled(study: str, cases: tuple[str, ...], above: float) -> tuple[int, int]:
    """(stalled, runs) over every run of `cases`: a stalled run ends above `above` test bits per
    character."""
    rows = runs(study)[runs(study)["case"].isin(cases)]
    return int((rows["test/bpc"] > above).sum()), len(rows)


def gap(study: str, case: str, baseline: str) -> str:
    """How far `case` ends above `baseline` in mean final test bits per character, as written."""
    means = final_means(study, "test/bpc")
    return f"{means[case] - means[baseline]:.2f}"


def probe_row(clipped: str, unclipped: str | None, shipped: str | None) -> tuple[str, ...]:
    """A row of the LM README's clipping-probe table: the mean final test bits per character of
    `clipped` and `unclipped` (the probe's cases) and of `shipped` (study.yaml's), "–" where
    none, then the stalled runs of the clipped and the unclipped case."""

    def mean(study: str, case: str | None) -> str:
        return "–" if case is None else f"{final_means(study, 'test/bpc')[case]:.2f}"

    def stalls(case: str | None) -> str:
        return "–" if case is None else "{} of {}".format(*stalled(LP, (case,), SLOW_SEEDS))

    return (
        mean(LP, clipped),
        mean(LP, unclipped),
        mean(LM, shipped),
        stalls(clipped),
        stalls(unclipped),
    )


def lm_final_machines() -> tuple[int, int, int]:
    """(cases whose final seeds ran on the GPU machine's CPUs, their runs, cases that did not):
    the README names the latter — sync AdamW by work and top-k ran here, 1-bit Adam has no final
    seed (no lr was selected)."""
    r = report(LM)
    finals = r.runs[~r.runs["cfg.seed"].isin(list(r.study.selection_seeds))]
    here = {"sync AdamW (by work)", "top-k 1% + EF"}
    none = {c.name for c in r.study.cases} - set(finals["case"])
    assert none == {"1-bit Adam"}, none
    elsewhere = finals[~finals["case"].isin(here)]
    return elsewhere["case"].nunique(), len(elsewhere), len(here) + len(none)


def async_plain_finals() -> tuple[Any, ...]:
    """(all / how many of the stragglers study's plain asynchronous final seeds did not train,
    how many final seeds it has, each one's test bits per character in seed order)."""
    rows = runs(ST)[runs(ST)["case"] == "async plain (4x slow WAN)"]
    finals = rows[rows["cfg.seed"].isin(list(final_seeds(ST)))].sort_values("cfg.seed")
    return (
        quantifier(int((finals["status"] == "did not train").sum()), len(finals)),
        len(finals),
        *(f"{v:.1f}" for v in finals["test/bpc"]),
    )


def final_values(study: str, case: str) -> list[float]:
    """The test bits per character of `case`'s final-seed runs, in seed order."""
    rows = runs(study)[runs(study)["case"] == case]
    finals = rows[rows["cfg.seed"].isin(list(final_seeds(study)))].sort_values("cfg.seed")
    return [float(v) for v in finals["test/bpc"]]


def scaling_row(study: str, case: str) -> tuple[str, ...]:
    """A row of the diloco_scaling README's results table as written: the mean and std of the
    final seeds' test bits per character, each seed's, and the gap to DP AdamW (absolute and
    relative; "–" for DP AdamW itself)."""
    values = final_values(study, case)
    dp = final_means(DS, "test/bpc")["DP AdamW"]
    mean, std = float(np.mean(values)), float(np.std(values, ddof=1))
    seeds = ", ".join(f"{v:.2f}" for v in values)
    if (study, case) == (DS, "DP AdamW"):
        return (f"{mean:.2f}", f"{std:.2f}", seeds, "–", "–")
    gap = mean - dp
    return (f"{mean:.2f}", f"{std:.2f}", seeds, f"{gap:+.2f}", f"{100 * gap / dp:+.1f}")


def clipped_row(
    case: str, baseline: str | None, study: str | None = None, base_study: str | None = None
) -> tuple[str, ...]:
    """A row of an LM README clipped results table as written: the inner lr (the pick, or the
    case it takes it from), the final seeds' mean and std of test bits per character, each
    seed's, and the gap of the mean to `baseline`'s ("–" for a baseline itself). `study`:
    the row's study, `base_study`: the baseline's (both clipped.yaml unless given)."""
    study, base_study = study or LC, base_study or LC
    values = final_values(study, case)
    lr = one_pick(study, report(study).study.case(case).lr_from or case).lr
    mean, std = float(np.mean(values)), float(np.std(values, ddof=1))
    seeds = ", ".join(f"{v:.2f}" for v in values)
    base = "–" if baseline is None else f"{mean - np.mean(final_values(base_study, baseline)):+.2f}"
    return (f"{lr:g}", f"{mean:.2f}", f"{std:.2f}", seeds, base)


def runs_and_picks(study: str) -> tuple[Any, ...]:
    """What a README's "N runs (g grid, e grid extensions, f final seeds). Every pick is
    interior (i of p); c of the p picks were won within the selection's noise" states."""
    counts = picks(study)
    return (
        len(runs(study)),
        *roles(study).values(),
        quantifier(counts.interior, counts.picks),
        counts.interior,
        counts.picks,
        counts.close,
        counts.picks,
    )


def relative_gap(case: str, baseline: str) -> float:
    """`case`'s mean final test bits per character above `baseline`'s, relative to it
    (clipped.yaml)."""
    means = final_means(LC, "test/bpc")
    return (means[case] - means[baseline]) / means[baseline]


def density_gain() -> tuple[str, str, str, str]:
    """SparseLoCo H=15 at 1.56 % minus at 3.1 % (mean final test bits per character), its
    standard error, how many standard errors, and the verdict the harness's rule gives."""
    low, high = final_values(LC, "SparseLoCo H=15"), final_values(LC, "SparseLoCo H=15 3.1%")
    diff = float(np.mean(low) - np.mean(high))
    se = float(np.sqrt(np.var(low, ddof=1) / len(low) + np.var(high, ddof=1) / len(high)))
    verdict = "holds" if diff > 2 * se else "does not hold" if diff < -2 * se else "unresolved"
    return f"{diff:.3f}", f"{se:.3f}", f"{diff / se:.1f}", verdict


def runs_as_scaling() -> list[tuple[Any, Any]]:
    """Pairs (clipped.yaml's run, diloco_scaling's run) of the cases configured alike
    (`LC_AS_DS`) at the same inner lr and seed."""
    ours, theirs = runs(LC), runs(DS)
    pairs = []
    for case, other, outer in LC_AS_DS:
        mine = ours[ours["case"] == case]
        rows = theirs[theirs["case"] == other]
        if outer is not None:
            rows = rows[rows["cfg.outer.optimizer.lr"] == outer]
        for _, row in mine.iterrows():
            match = rows[
                (rows["cfg.optimizer.lr"] == row["cfg.optimizer.lr"])
                & (rows["cfg.seed"] == row["cfg.seed"])
            ]
            assert len(match) <= 1
            pairs += [(row, match.iloc[0])] if len(match) else []
    return pairs


def verdicts(study: str) -> list[str]:
    """Each expectation's verdict at the end of training, as results.md writes it."""
    from dpresearch.study.claims import claim_frame

    frame = claim_frame(report(study))
    return list(frame[frame.columns[-1]])


def split_verdict(verdict: str) -> tuple[str, str]:
    """("holds", "(+0.1 ± 0.02)") from "holds (+0.1 ± 0.02)"."""
    word, figures = verdict.split(" (", 1)
    return word, f"({figures}"


def warm_verdict() -> tuple[str, str, str]:
    """Claim (e) by the harness's rule, applied across the two reports: the difference of the
    final means (from scratch minus warm), its standard error, and how many standard errors."""
    scratch, warm = final_values(DS, "DiLoCo M=8"), final_values(DW, "DiLoCo M=8 warm")
    diff = float(np.mean(scratch) - np.mean(warm))
    se = float(np.sqrt(np.var(scratch, ddof=1) / len(scratch) + np.var(warm, ddof=1) / len(warm)))
    return f"{diff:.2f}", f"{se:.2f}", f"{diff / se:.1f}"


def fetchsgd_lrs() -> tuple[Any, ...]:
    rows = runs(f"{CM}/codecs").query("case == 'FetchSGD sketch'")
    return (
        quantifier(int((rows["status"] == "diverged").sum()), len(rows)),
        np.format_float_positional(rows["cfg.optimizer.lr"].min()),  # as written: 0.000095
        np.format_float_positional(rows["cfg.optimizer.lr"].max()),
    )


@dataclass(frozen=True)
class Claim:
    id: str
    folder: str  # the README's folder, relative to the repository
    pattern: str  # found in the README with its lines joined; groups are the counts
    expected: Callable[[], tuple]  # the counts the run data hold, in the groups' order


CS, EF = "compression_subset/study", "compression_subset/ef_claim"
P6 = "powersgd_table6/study"
CM = "compressors_more"
LM = "lm_shakespeare/study"
LP = "lm_shakespeare/probe_clip"  # the gradient-clipping probe beside it
SYNC_CASES = ("sync AdamW", "sync AdamW (by work)")
GS = "gossip_subset/study"
OS, OL = "outer/study", "outer/outer_lr"  # the outer study's two stages
ST = "stragglers/study"
ST_CASES = (  # the results rows with a mean (plain asynchronous Local-SGD did not train)
    "DP AdamW",
    "DiLoCo H=50",
    "Streaming DiLoCo H=50 F=4",
    "eager DiLoCo H=50",
    "delayed DiLoCo H=50",
    "NoLoCo H=50",
    "async DN+DyLU (4x slow WAN)",
    "async DN (4x slow WAN)",
    "async DN+DyLU (2x slow WAN)",
    "async DN (log-normal WAN)",
)
ST_CLOCKS = tuple(
    f"time/modeled_s{s}"
    for s in ("", "@even_wan", "@slow2_wan", "@lognormal_wan", "@slow4_1gbe", "@even_1gbe")
)
DS, DW = "diloco_scaling/study", "diloco_scaling/warm"  # DiLoCo's scaling-law findings
DS_ROWS = (  # the README's results rows, in its order: (study, case)
    (DS, "DP AdamW"),
    (DS, "DiLoCo M=1"),
    (DS, "DiLoCo M=2"),
    (DS, "DiLoCo M=4"),
    (DS, "DiLoCo M=8"),
    (DS, "DiLoCo M=8 H=10"),
    (DS, "DiLoCo M=8 H=30"),
    (DS, "DiLoCo M=8 H=100"),
    (DW, "DiLoCo M=8 warm"),
)
LC = "lm_shakespeare/clipped"  # the LM study re-run with clipping, H = 15 (issue 40, item 3)
LC_ROWS = (  # the README's results rows, in its order: (case, the sync case it is set against)
    ("sync AdamW", None),
    ("DiLoCo H=15", "sync AdamW"),
    ("DiLoCo H=15 outer lr 0.35", "sync AdamW"),
    ("DiLoCo H=50", "sync AdamW"),
    ("SparseLoCo H=15", "sync AdamW"),
    ("SparseLoCo H=15 3.1%", "sync AdamW"),
    ("sync AdamW (by work)", None),
    ("DiLoCo H=15 (by work)", "sync AdamW (by work)"),
    ("SparseLoCo H=15 (by work)", "sync AdamW (by work)"),
)
LM_MORE = "lm_shakespeare/clipped_more"  # clipped.yaml's protocol for the seven other cases
LM_MUON = "lm_shakespeare/clipped_muloco"  # and for MuLoCo, the seventh
LM_MORE_ROWS = (  # the README's rows in order: (case, the clipped.yaml sync case it is set against)
    ("Streaming DiLoCo H=15 F=4", "sync AdamW"),
    ("DeMo", "sync AdamW"),
    ("SPARTA p=0.005", "sync AdamW"),
    ("top-k 1% + EF", "sync AdamW"),
    ("DeMo (by work)", "sync AdamW (by work)"),
    ("SPARTA p=0.005 (by work)", "sync AdamW (by work)"),
)
# Cases of clipped.yaml configured as diloco_scaling's (same model, data, workers, batch,
# steps, clipping; DiLoCo at H = 15 with outer lr 0.7): (ours, theirs, their outer lr)
LC_AS_DS = (("sync AdamW", "DP AdamW", None), ("DiLoCo H=15", "DiLoCo M=8", 0.7))
SLOW_SEEDS = 3.3  # between the fast (≈ 3.0) and slow (≈ 3.6) plateaus of the DiLoCo family


def table_rows(id: str, folder: str, names: list[str], cells: str, expected) -> Claim:
    """A claim on the rows of a README table, in order: each row starts with its name in
    `names`, then `cells` (a regex whose groups are that row's counts)."""
    return Claim(id, folder, "".join(rf"\| {re.escape(n)} \| {cells}.*" for n in names), expected)


CLAIMS = [
    # -- compression_subset/README.md -------------------------------------------------------
    Claim(
        "compression/runs",
        "experiments/compression_subset",
        r"(\d+) cases; (\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\)",
        lambda: (len(report(CS).study.cases), len(runs(CS)), *roles(CS).values()),
    ),
    Claim(
        "compression/protocol",
        "experiments/compression_subset",
        r"tuned on the mean of seeds (\d) and (\d) over a log-spaced grid .* then the final seeds "
        r"(\d), (\d) and (\d) ran at the selected lr and alone make the results tables "
        r"\(n = (\d)\)",
        lambda: (
            *report(CS).study.selection_seeds,
            *final_seeds(CS),
            *{int(n) for n in final_means(CS, "n").values()},
        ),
    ),
    Claim(
        "compression/steps",
        "experiments/compression_subset",
        r"30 epochs \((\d+) steps",
        lambda: tuple(total_steps(CS)),
    ),
    Claim(
        "compression/interior-grown-noise",
        "experiments/compression_subset",
        r"(Every) pick is interior at (both) horizons; (\d+) of the (\d+) grids grew past their "
        r"initial lrs \((\d) upwards, (\d) downwards\), and (\d+) of the (\d+) picks were won "
        r"within the selection's noise",
        lambda: (
            quantifier(picks(CS).interior, picks(CS).picks),
            quantifier(len(report(CS).horizons), 2),
            *growth(CS),
            picks(CS).close,
            picks(CS).picks,
        ),
    ),
    Claim(
        "compression/accuracies-30",
        "experiments/compression_subset",
        r"at 30 epochs \(n = 3 each\): dense (\d+\.\d) ± .*fp16 (\d+\.\d) ± .*QSGD s = 7 "
        r"(\d+\.\d) ± .*QSGD s = 15 (\d+\.\d) ± .*PowerSGD rank 1 / 2 / 4 (\d+\.\d) ± .* / "
        r"(\d+\.\d) ± .* / (\d+\.\d) ± .*top-k 1 % \+ EF (\d+\.\d) ± .*random-k 1 % \+ EF "
        r"(\d+\.\d) ±",
        lambda: tuple(
            f"{100 * final_means(CS, 'test/acc')[c]:.1f}"
            for c in (
                "none",
                "fp16",
                "QSGD s=7",
                "QSGD s=15",
                "PowerSGD rank 1",
                "PowerSGD rank 2",
                "PowerSGD rank 4",
                "top-k 1% + EF",
                "random-k 1% + EF",
            )
        ),
    ),
    Claim(
        "ef_claim/runs",
        "experiments/compression_subset",
        r"`results/ef_claim/results\.md`, (\d+) runs",
        lambda: (len(runs(EF)),),
    ),
    Claim(
        "ef_claim/seeds",
        "experiments/compression_subset",
        r"tuned on the mean of seeds (\d) and (\d) .* then final seeds (\d), (\d) and (\d);",
        lambda: (*report(EF).study.selection_seeds, *final_seeds(EF)),
    ),
    Claim(
        "ef_claim/grids-grew-picks-interior",
        "experiments/compression_subset",
        r"\((five) grids grew; (every) final pick interior\)",
        lambda: (
            len(grown_grids(report(EF).study, runs(EF))),
            quantifier(picks(EF).interior, picks(EF).picks),
        ),
    ),
    Claim(
        "ef_claim/one-usable-seed-at-3",
        "experiments/compression_subset",
        r"on (two) usable final seeds of random-k \+ EF: the third did not train",
        lambda: (
            sum(
                report(EF)
                .horizons[0]
                .runs.query(
                    "case == 'random-k 1% + EF' and `cfg.seed` in [2, 3, 4] and "
                    f"`cfg.optimizer.lr` == {report(EF).horizons[0].picks['random-k 1% + EF'].lr}"
                )["status"]
                == FINISHED
            ),
        ),
    ),
    Claim(
        "ef_claim/within-noise",
        "experiments/compression_subset",
        r"n = (\d) final seeds per case; (\d+) of the (\d+) selections \((\d) cases × (\d) "
        r"horizons\) were won within noise",
        lambda: (
            len(final_seeds(EF)),
            picks(EF).close,
            picks(EF).picks,
            len(report(EF).study.cases),
            len(report(EF).horizons),
        ),
    ),
    # -- compressors_more/README.md ---------------------------------------------------------
    *(
        Claim(
            f"compressors_more/{part}-runs",
            "experiments/compressors_more",
            rf"`{part}\.yaml` → `results/{part}/` \|[^|]*\| \*\*run\*\* \((\d+) runs",
            lambda part=part: (len(runs(f"{CM}/{part}")),),
        )
        for part in ("hierarchy", "adam", "codecs")
    ),
    Claim(
        "compressors_more/final-seeds",
        "experiments/compressors_more",
        r"The codecs and Adam parts select each case's lr on tuning seeds (\d) and (\d) and "
        r"report final seeds (\d), (\d) and (\d) at it \(n = (\d)\); the hierarchy part runs one "
        r"lr by design, so nothing is selected and its seeds (\d), (\d) and (\d) all make its "
        r"table \(n = (\d)\)",
        lambda: (
            *report(f"{CM}/codecs").study.selection_seeds,
            *report(f"{CM}/codecs").study.final_seeds,
            *{
                int(n)
                for p in ("codecs", "adam")
                for n in final_means(f"{CM}/{p}", "n").values()
                if n == max(final_means(f"{CM}/{p}", "n").values())
            },
            *sorted({int(s) for s in runs(f"{CM}/hierarchy")["cfg.seed"]}),
            *{int(n) for n in final_means(f"{CM}/hierarchy", "n").values()},
        ),
    ),
    Claim(
        "codecs/interior-and-grown",
        "experiments/compressors_more",
        r"(Every) pick is interior to its grid: the harness grew top-k's grid up to 0\.95, that "
        r"of FetchSGD at its own sketch size up to 0\.095, and (six) cases' grids down \(five to "
        r"0\.0095, and FetchSGD at ≈ 1 bit to 0\.000095\) before selecting\. (\d+) of the (\d+) "
        r"picks are marked \*within noise\*",
        lambda: (
            quantifier(picks(f"{CM}/codecs").interior, picks(f"{CM}/codecs").picks),
            sum(
                d > 0
                for _, d in grown_grids(report(f"{CM}/codecs").study, runs(f"{CM}/codecs")).values()
            ),
            picks(f"{CM}/codecs").close,
            picks(f"{CM}/codecs").picks,
        ),
    ),
    Claim(
        "codecs/grown-upwards",
        "experiments/compressors_more",
        r"grew (top-k)'s grid up to 0\.95, that of (FetchSGD) at its own sketch size up",
        lambda: tuple(
            c.split()[0]
            for c, (u, _) in grown_grids(report(f"{CM}/codecs").study, runs(f"{CM}/codecs")).items()
            if u
        ),
    ),
    Claim(
        "codecs/steps",
        "experiments/compressors_more",
        r"after 3 epochs \((\d+) steps\), mean ± sd of the (three) final seeds",
        lambda: (*total_steps(f"{CM}/codecs"), len(report(f"{CM}/codecs").study.final_seeds)),
    ),
    Claim(
        "codecs/fetchsgd-diverged",
        "experiments/compressors_more",
        r"FetchSGD at ≈ 1 bit per value diverged at (every) lr tried \(([\d.]+)–([\d.]+)\)",
        fetchsgd_lrs,
    ),
    Claim(
        "adam/interior-grown-noise",
        "experiments/compressors_more",
        r"(Every) case's pick is interior to its grid \(0\.0003 … 0\.0095; the harness grew the "
        r"grids past the edge picks\) and (every) pick is marked \*within noise\*",
        lambda: (
            quantifier(picks(f"{CM}/adam").interior, picks(f"{CM}/adam").tuned),
            quantifier(picks(f"{CM}/adam").close, picks(f"{CM}/adam").tuned),
        ),
    ),
    Claim(
        "adam/grids-grew",
        "experiments/compressors_more",
        r"the harness grew the grids past the edge picks\) and (every) pick",
        lambda: (
            quantifier(
                len(grown_grids(report(f"{CM}/adam").study, runs(f"{CM}/adam"))),
                picks(f"{CM}/adam").tuned,
            ),
        ),
    ),
    Claim(
        "adam/n",
        "experiments/compressors_more",
        r"0/1 Adam 43\.7 ± 1\.3 % \(n = (\d) each\)",
        lambda: tuple({int(n) for n in final_means(f"{CM}/adam", "n").values()}),
    ),
    Claim(
        "adam/warm-up",
        "experiments/compressors_more",
        r"during its warm-up \((\d+) of (\d+) steps, a third of the run\)",
        lambda: (
            {int(v) for v in runs(f"{CM}/adam")["cfg.optimizer.freeze_step"].dropna()}.pop(),
            *total_steps(f"{CM}/adam"),
        ),
    ),
    Claim(
        "hierarchy/steps-and-n",
        "experiments/compressors_more",
        r"after 3 epochs \((\d+) steps, global batch 128\): flat 19\.7 ± 2\.9 %, two-level "
        r"17\.3 ± 2\.7 % \(n = (\d)\)",
        lambda: (
            *total_steps(f"{CM}/hierarchy"),
            *{int(n) for n in final_means(f"{CM}/hierarchy", "n").values()},
        ),
    ),
    # -- gossip_subset/README.md ------------------------------------------------------------
    Claim(
        "gossip/steps",
        "experiments/gossip_subset",
        r"\*\*12 epochs \((\d+) steps\)\*\*",
        lambda: tuple(total_steps(GS)),
    ),
    Claim(
        "gossip/every-case-tuned",
        "experiments/gossip_subset",
        r"\*\*Every one of the (\d+) tuned cases was tuned on its own partition\*\* \((\w+) more",
        lambda: (
            sum(c.lr_from is None for c in report(GS).study.cases),
            sum(c.lr_from is not None for c in report(GS).study.cases),
        ),
    ),
    Claim(
        "gossip/protocol-and-runs",
        "experiments/gossip_subset",
        r"selected on the mean validation accuracy of seeds (\d) and (\d); then the final seeds "
        r"(\d), (\d) and (\d) ran at the selected lr and alone make the tables \(n = (\d)\)\. "
        r"(\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\)",
        lambda: (
            *report(GS).study.selection_seeds,
            *final_seeds(GS),
            len(final_seeds(GS)),
            len(runs(GS)),
            *roles(GS).values(),
        ),
    ),
    Claim(
        "gossip/interior-grown-noise",
        "experiments/gossip_subset",
        r"Every pick is interior \((\d+) of (\d+)\); (\d+) of the (\d+) grids grew past their "
        r"initial lrs \((\d) upwards, (\d) downwards[^)]*\), and (\d+) of the (\d+) picks were won "
        r"within the selection's noise",
        lambda: (
            picks(GS).interior,
            picks(GS).picks,
            *growth(GS),
            picks(GS).close,
            picks(GS).picks,
        ),
    ),
    Claim(
        "gossip/iid-accuracies",
        "experiments/gossip_subset",
        r"allreduce (\d+\.\d) ± [\d.]+ % \(lr 1\), SGP (\d+\.\d) ± [\d.]+ %, CHOCO sign "
        r"(\d+\.\d) ± [\d.]+ %, D-PSGD ring (\d+\.\d) ± [\d.]+ %, D-PSGD exponential "
        r"(\d+\.\d) ± [\d.]+ % \(each at lr 0\.32\), CHOCO top-k 1 % (\d+\.\d) ± [\d.]+ % "
        r"\(lr 0\.1\)",
        lambda: tuple(
            f"{100 * final_means(GS, 'test/acc')[c]:.1f}"
            for c in (
                "allreduce (IID)",
                "SGP one-peer exp. (IID)",
                "CHOCO sign ring (IID)",
                "D-PSGD ring (IID)",
                "D-PSGD exponential (IID)",
                "CHOCO top-k 1% ring (IID)",
            )
        ),
    ),
    Claim(
        "gossip/dirichlet-lr-and-loss",
        "experiments/gossip_subset",
        r"On Dirichlet data \(α = 0\.1\) (\d) of the (\d) cases selected a smaller lr than their "
        r"IID counterpart \((\d+)–(\d+)×; D-PSGD ring the same ([\d.]+)\), and (every) case lost "
        r"(\d+)–(\d+) points against its IID result",
        lambda: (
            sum(r < 1 for r in dirichlet_lr_ratios()),
            len(dirichlet_pairs()),
            round(1 / max(r for r in dirichlet_lr_ratios() if r < 1)),
            round(1 / min(dirichlet_lr_ratios())),
            f"{one_pick(GS, 'D-PSGD ring (Dirichlet 0.1)').lr:g}"
            if one_pick(GS, "D-PSGD ring (Dirichlet 0.1)").lr
            == one_pick(GS, "D-PSGD ring (IID)").lr
            else "differs",
            quantifier(sum(x > 0 for x in dirichlet_losses()), len(dirichlet_pairs())),
            round(min(dirichlet_losses())),
            round(max(dirichlet_losses())),
        ),
    ),
    Claim(
        "gossip/none-untrained",
        "experiments/gossip_subset",
        r"(No) run was marked \"did not train\"",
        lambda: ("no" if untrained(GS).empty else len(untrained(GS)),),
    ),
    # -- local_sgd/README.md ----------------------------------------------------------------
    Claim(
        "local_sgd/runs",
        "experiments/local_sgd",
        r"(\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\) on this machine",
        lambda: (len(runs("local_sgd/study")), *roles("local_sgd/study").values()),
    ),
    Claim(
        "local_sgd/protocol",
        "experiments/local_sgd",
        r"tuned on the mean of seeds (\d) and (\d) over a log-spaced grid .* then the final seeds "
        r"(\d), (\d) and (\d) ran at the selected lr and alone make the results table \(n = (\d)\)",
        lambda: (
            *report("local_sgd/study").study.selection_seeds,
            *final_seeds("local_sgd/study"),
            *{int(n) for n in final_means("local_sgd/study", "n").values()},
        ),
    ),
    Claim(
        "local_sgd/steps",
        "experiments/local_sgd",
        r"20 epochs \((\d+) steps\)\. Cases",
        lambda: tuple(total_steps("local_sgd/study")),
    ),
    Claim(
        "local_sgd/interior-and-grown",
        "experiments/local_sgd",
        r"(Every) pick is interior: the grids of (H = 1) and (post-local) SGD grew up to 3\.2",
        lambda: (
            quantifier(picks("local_sgd/study").interior, picks("local_sgd/study").picks),
            *sorted(
                ("H = 1" if c == "local SGD H=1" else "post-local")
                for c, (up, _) in grown_grids(
                    report("local_sgd/study").study, runs("local_sgd/study")
                ).items()
                if up
            ),
        ),
    ),
    Claim(
        "local_sgd/within-noise",
        "experiments/local_sgd",
        r"(\d) of the (\d) picks were won within the selection's noise",
        lambda: (picks("local_sgd/study").close, picks("local_sgd/study").picks),
    ),
    # -- powersgd_table6/README.md ----------------------------------------------------------
    Claim(
        "powersgd/runs",
        "experiments/powersgd_table6",
        r"(\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\) on this machine",
        lambda: (len(runs(P6)), *roles(P6).values()),
    ),
    Claim(
        "powersgd/protocol",
        "experiments/powersgd_table6",
        r"tuned on the mean of seeds (\d) and (\d) over a log-spaced grid .* then the final seeds "
        r"(\d), (\d) and (\d) ran at the selected lr and alone make the results table \(n = (\d)\)",
        lambda: (
            *report(P6).study.selection_seeds,
            *final_seeds(P6),
            *{int(n) for n in final_means(P6, "n").values()},
        ),
    ),
    Claim(
        "powersgd/steps",
        "experiments/powersgd_table6",
        r"10 epochs, (\d+) steps\)",
        lambda: tuple(total_steps(P6)),
    ),
    Claim(
        "powersgd/interior-grown-noise",
        "experiments/powersgd_table6",
        r"(Every) pick is interior; (\d) of the (\d) grids grew past their initial lrs \((all) "
        r"upwards\), and (\d) of the (\d) picks were won within the selection's noise",
        lambda: (
            quantifier(picks(P6).interior, picks(P6).picks),
            len(grown_grids(report(P6).study, runs(P6))),
            len(grid_sizes(P6)),
            quantifier(
                sum(
                    bool(up and not down)
                    for up, down in grown_grids(report(P6).study, runs(P6)).values()
                ),
                len(grown_grids(report(P6).study, runs(P6))),
            ),
            picks(P6).close,
            picks(P6).picks,
        ),
    ),
    Claim(
        "powersgd/accuracies",
        "experiments/powersgd_table6",
        r"SGD (\d+\.\d) ± \d\.\d %.*Signum (\d+\.\d) ± .*rank-1 PowerSGD (\d+\.\d) ± .*"
        r"rank-2 (\d+\.\d) ± .*rank-4 (\d+\.\d) ± .*top-k at rank-2's bytes (\d+\.\d) ± .*"
        r"random-k at rank-2's bytes (\d+\.\d) ±",
        lambda: tuple(
            f"{100 * final_means(P6, 'test/acc')[c]:.1f}"
            for c in (
                "SGD",
                "Signum",
                "Rank-1 PowerSGD",
                "Rank-2 PowerSGD",
                "Rank-4 PowerSGD",
                "Top-K (rank-2 bytes)",
                "Random-K (rank-2 bytes)",
            )
        ),
    ),
    # -- outer/README.md --------------------------------------------------------------------
    Claim(
        "outer/steps-rounds",
        "experiments/outer",
        r"then cosine, (\d+) steps \(13\.4 epochs; (\d+) rounds of H = 16\)",
        lambda: (
            *(total_steps(OS) | total_steps(OL)),  # both stages: one value
            int(runs(OS).query("case == 'DiLoCo H=16'")["outer/rounds"].max()),
        ),
    ),
    Claim(
        "outer/protocol-seeds",
        "experiments/outer",
        r"selected on the mean final validation accuracy of seeds (\d) and (\d), then the final "
        r"seeds (\d), (\d) and (\d) at the selected lr.*one case per momentum, on the (same) seeds",
        lambda: (
            *report(OS).study.selection_seeds,
            *final_seeds(OS),
            "same" if report(OL).study.seeds == report(OS).study.seeds else "other",
        ),
    ),
    Claim(
        "outer/runs",
        "experiments/outer",
        r"(\d+) runs in stage 1 \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\) and "
        r"(\d+) in stage 2 \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\)",
        lambda: (len(runs(OS)), *roles(OS).values(), len(runs(OL)), *roles(OL).values()),
    ),
    Claim(
        "outer/picks",
        "experiments/outer",
        r"Every pick is interior in both stages \((\d+) of (\d+) and (\d+) of (\d+), none with "
        r"the bound reached\); (\d+) of the (\d+) picks were won within the validation noise",
        lambda: (
            picks(OS).interior,
            picks(OS).picks,
            picks(OL).interior,
            picks(OL).picks,
            picks(OS).close + picks(OL).close,
            picks(OS).picks + picks(OL).picks,
        ),
    ),
    *(
        Claim(
            f"outer/row/{label}",
            "experiments/outer",
            rf"\| {re.escape(label)} \| ([\d.]+) \| (?:α = )?(–|[\d.]+)[^|]*\| (\d+\.\d) ± "
            r"[\d.]+ \| ([\d.]+) \|",
            lambda label=label, study=study, case=case: (
                f"{one_pick(OS, label).lr:g}",
                "–" if study == OS else f"{one_pick(OL, case).lr:g}",
                f"{100 * final_means(study, 'test/acc')[case]:.1f}",
                f"{final_means(study, 'MB_per_epoch')[case]:.3g}",
            ),
        )
        for label, study, case in (
            ("sync SGD", OS, "sync SGD"),
            ("SGP", OS, "SGP"),
            ("SlowMo over SGP", OL, "SlowMo over SGP β=0.7"),
            ("DiLoCo H=16", OL, "DiLoCo H=16 β=0.9"),
            ("Streaming DiLoCo F=4", OL, "Streaming DiLoCo F=4 β=0.6"),
            ("local SGD H=16", OS, "local SGD H=16"),
            ("DiLoCo top-k 5% + EF", OL, "DiLoCo top-k 5% + EF β=0.6"),
        )
    ),
    Claim(
        "outer/stage2-reruns-stage1",
        "experiments/outer",
        r"give the same accuracies to the last digit \((\d+\.\d) ± [\d.]+ and (\d+\.\d) ± ",
        lambda: tuple(
            f"{100 * final_means(OS, 'test/acc')[one]:.1f}"
            if final_means(OS, "test/acc")[one] == final_means(OL, "test/acc")[two]
            else "differs"
            for one, two in (
                ("DiLoCo H=16", "DiLoCo H=16 β=0.9"),
                ("SlowMo over SGP", "SlowMo over SGP β=0.7"),
            )
        ),
    ),
    # -- lm_shakespeare/README.md -----------------------------------------------------------
    Claim(
        "lm/grid-extensions",
        "experiments/lm_shakespeare",
        r"The grid \((\d+) points\) and its extensions \((\d+) points, three rounds\)",
        lambda: (roles(LM)["grid"], roles(LM)["extensions"]),
    ),
    Claim(
        "lm/final-seeds-split",
        "experiments/lm_shakespeare",
        r"the final seeds of (\d+) cases \((\d+) points\) ran on the 16 CPU cores .* those of "
        r"the other (three) cases \(sync AdamW by work, top-k, 1-bit Adam's none\) here",
        lm_final_machines,
    ),
    Claim(
        "lm/one-bit-adam-no-finals",
        "experiments/lm_shakespeare",
        r"1-bit Adam's (none)",
        lambda: (
            "none"
            if runs(LM).query("case == '1-bit Adam'")["cfg.seed"].isin(list(final_seeds(LM))).sum()
            == 0
            else "some",
        ),
    ),
    Claim(
        "lm/steps",
        "experiments/lm_shakespeare",
        r"(Every) run is (\d+) steps",
        lambda: (
            quantifier(int((runs(LM)["cfg.train.steps"] == 1500).sum()), len(runs(LM))),
            *{int(v) for v in runs(LM)["cfg.train.steps"]},
        ),
    ),
    Claim(
        "lm/picks",
        "experiments/lm_shakespeare",
        r"(Every) pick is interior; (\d+) of the (\d+) were won by less than the standard "
        r"error",
        lambda: (quantifier(picks(LM).interior, picks(LM).picks), picks(LM).close, picks(LM).picks),
    ),
    Claim(
        "lm/one-bit-adam-diverged",
        "experiments/lm_shakespeare",
        r"\*\*1-bit Adam did not train at (any) lr\.\*\* At 2e-3 and above \(and (1e-3)\) it "
        r"diverged; at (5e-4) it ended",
        lambda: (
            "any" if one_pick(LM, "1-bit Adam") is None else "",
            *(
                f"{v:.0e}".replace("e-0", "e-")
                for v in (
                    runs(LM)
                    .query("status == 'diverged' and case == '1-bit Adam'")["cfg.optimizer.lr"]
                    .min(),
                    runs(LM)
                    .query("status != 'diverged' and case == '1-bit Adam'")["cfg.optimizer.lr"]
                    .max(),
                )
            ),
        ),
    ),
    Claim(
        "lm/only-one-bit-adam-diverged",
        "experiments/lm_shakespeare",
        r"At 2e-3 and above \(and 1e-3\) it (diverged)",
        lambda: tuple(
            {
                "diverged" if c == "1-bit Adam" else c
                for c in runs(LM).query("status == 'diverged'")["case"]
            }
        ),
    ),
    Claim(
        "lm/diloco-slow-seeds",
        "experiments/lm_shakespeare",
        r"seeds (\d), (\d) and (\d) of DiLoCo H=50 end at 2\.98–3\.01 test bits per character "
        r"and seeds (\d) and (\d) at 3\.57–3\.64",
        lambda: tuple(s for part in seeds_by_speed(LM, "DiLoCo H=50", SLOW_SEEDS) for s in part),
    ),
    Claim(
        "lm/slow-seeds-same",
        "experiments/lm_shakespeare",
        r"seeds (\d) and (\d) are the slow ones for DiLoCo H=50, H=100 and (both) outer-lr "
        r"variants",
        lambda: same_slow_seeds(
            LM,
            ("DiLoCo H=50", "DiLoCo H=100", "DiLoCo H=50 outer lr 0.4", "DiLoCo H=50 outer lr 1.0"),
            SLOW_SEEDS,
        ),
    ),
    Claim(
        "lm/stalls-rise-with-lr",
        "experiments/lm_shakespeare",
        r"Over every run of DiLoCo H=50 and H=100 \(tuning and final seeds\), (\d+) of (\d+) "
        r"stall at lr ≤ 0\.004, (\d+) of (\d+) at 0\.008 and (\d+) of (\d+) at 0\.016; with the "
        r"by-work, Streaming and outer-lr variants too, (\d+) of (\d+), (\d+) of (\d+) and (\d+) "
        r"of (\d+)",
        lambda: (
            *stalls_by_lr(LM, ("DiLoCo H=50", "DiLoCo H=100"), SLOW_SEEDS),
            *stalls_by_lr(
                LM,
                (
                    "DiLoCo H=50",
                    "DiLoCo H=100",
                    "DiLoCo H=50 (by work)",
                    "Streaming DiLoCo H=50 F=4",
                    "DiLoCo H=50 outer lr 0.4",
                    "DiLoCo H=50 outer lr 1.0",
                ),
                SLOW_SEEDS,
            ),
        ),
    ),
    Claim(
        "lm/sync-never-stalls",
        "experiments/lm_shakespeare",
        r"(none) of the (\d+) runs of synchronous AdamW \(IID and by work, lrs 0\.002–0\.032\) "
        r"ends above 3\.3",
        lambda: (
            "none" if stalled(LM, SYNC_CASES, SLOW_SEEDS)[0] == 0 else "some",
            stalled(LM, SYNC_CASES, SLOW_SEEDS)[1],
        ),
    ),
    Claim(
        "lm/probe/runs",
        "experiments/lm_shakespeare",
        r"(\d+) runs of (\d+) steps, run on 2026-12-06",
        lambda: (len(runs(LP)), *total_steps(LP)),
    ),
    *(
        Claim(
            f"lm/probe/row/{label} {lr}",
            "experiments/lm_shakespeare",
            rf"\| {re.escape(label)} \| {lr} \| (\d\.\d\d) ± [\d.]+ \| (–|\d\.\d\d)[^|]* \| "
            r"(–|\d\.\d\d)[^|]* \| (\d of \d) / (–|\d of \d) \|",
            lambda row=row: probe_row(*row),
        )
        for label, lr, row in (
            ("sync AdamW", "0.008", ("sync AdamW", None, "sync AdamW")),
            ("DiLoCo H=50", "0.008", ("DiLoCo H=50", "DiLoCo H=50 no clip", "DiLoCo H=50")),
            (
                "DiLoCo H=50",
                "0.004",
                ("DiLoCo H=50 lr 0.004", "DiLoCo H=50 lr 0.004 no clip", None),
            ),
        )
    ),
    Claim(
        "lm/probe/gap-halved",
        "experiments/lm_shakespeare",
        r"It halves the gap to synchronous AdamW, from (\d\.\d\d) ± [\d.]+ to (\d\.\d\d) ± ",
        lambda: tuple(gap(study, "DiLoCo H=50", "sync AdamW") for study in (LM, LP)),
    ),
    Claim(
        "lm/three-final-seeds",
        "experiments/lm_shakespeare",
        r"(Three) final seeds with a bimodal outcome",
        lambda: (len(final_seeds(LM)),),
    ),
    Claim(
        "lm/gpu",
        "experiments/lm_shakespeare",
        r"\(one lr, seeds (\d) and (\d)\): the (three) central cases only, as the issue asks\. "
        r"Run on 2026-11-28 on one NVIDIA H200 \(torch 2\.11\.0\+cu130\), the (six) runs",
        lambda: (
            *report("lm_shakespeare/gpu").study.selection_seeds,
            len(report("lm_shakespeare/gpu").study.cases),
            len(runs("lm_shakespeare/gpu")),
        ),
    ),
    Claim(
        "lm/gpu-steps-rounds",
        "experiments/lm_shakespeare",
        r"(\d+) steps = 32\.8 M tokens a run .* trails it by 0\.32 bits per character after "
        r"(\d+) outer rounds",
        lambda: (
            *total_steps("lm_shakespeare/gpu"),
            int(runs("lm_shakespeare/gpu")["outer/rounds"].dropna().max()),
        ),
    ),
    # -- stragglers/README.md -----------------------------------------------------------------
    Claim(
        "stragglers/runs-picks",
        "experiments/stragglers",
        r"(\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\).*(Every) pick "
        r"is interior \((\d+) of (\d+)\); (\d+) of the (\d+) picks was won within the "
        r"selection's noise",
        lambda: runs_and_picks(ST),
    ),
    Claim(
        "stragglers/protocol",
        "experiments/stragglers",
        r"final validation bits per character of seeds (\d) and (\d), .* Seeds (\d), (\d) and "
        r"(\d) then run at the pick and alone make the results table \(n = (\d)\)",
        lambda: (
            *report(ST).study.selection_seeds,
            *final_seeds(ST),
            *{int(n) for c, n in final_means(ST, "n").items() if c != "async plain (4x slow WAN)"},
        ),
    ),
    Claim(
        "stragglers/bpc",
        "experiments/stragglers",
        "".join(rf"\| {re.escape(c)} \| [^|]+ \| [^|]+ \| (\d\.\d\d) ± .*" for c in ST_CASES),
        lambda: tuple(f"{final_means(ST, 'test/bpc')[c]:.2f}" for c in ST_CASES),
    ),
    Claim(
        "stragglers/async-plain",
        "experiments/stragglers",
        r"\| async plain \(4x slow WAN\) \| [^|]+ \| [^|]+ \| did not train \((all) (\d) final "
        r"seeds: test bits per character ([\d.]+), ([\d.]+), ([\d.]+)\)",
        async_plain_finals,
    ),
    Claim(
        "stragglers/clocks",
        "experiments/stragglers",
        r"\| DiLoCo H=50 \| [^|]+ \| [^|]+ \| [^|]+ \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| "
        r"(\d+) \| (\d+) \|.*\| async DN\+DyLU \(4x slow WAN\) \| [^|]+ \| [^|]+ \| [^|]+ \| "
        r"(\d+) \|",
        lambda: (
            *(f"{final_means(ST, m)['DiLoCo H=50']:.0f}" for m in ST_CLOCKS),
            f"{final_means(ST, 'time/modeled_s')['async DN+DyLU (4x slow WAN)']:.0f}",
        ),
    ),
    # -- diloco_scaling/README.md ------------------------------------------------------------
    Claim(
        "diloco_scaling/runs-picks",
        "experiments/diloco_scaling",
        r"`study.yaml` (\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\), "
        r"`warm.yaml` (\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\)\. "
        r"(Every) pick is interior on each key its case tunes \((\d+) of (\d+), the pretrain's "
        r"one fixed lr among them, and (\d+) of (\d+)\); (\d+) of "
        r"the (\d+) picks were won within the selection's noise",
        lambda: (
            len(runs(DS)),
            *roles(DS).values(),
            len(runs(DW)),
            *roles(DW).values(),
            quantifier(picks(DS).interior + picks(DW).interior, picks(DS).picks + picks(DW).picks),
            picks(DS).interior,
            picks(DS).picks,
            picks(DW).interior,
            picks(DW).picks,
            picks(DS).close,
            picks(DS).picks,
        ),
    ),
    Claim(
        "diloco_scaling/protocol",
        "experiments/diloco_scaling",
        r"validation bits per character of seeds (\d) and (\d), .* Seeds (\d), (\d) and (\d) then "
        r"run at the pick and alone make the results table \(n = (\d)\)",
        lambda: (
            *report(DS).study.selection_seeds,
            *final_seeds(DS),
            *{len(final_values(s, c)) for s, c in DS_ROWS},
        ),
    ),
    table_rows(
        "diloco_scaling/rows",
        "experiments/diloco_scaling",
        [c for _, c in DS_ROWS],
        r"[^|]+ \| [^|]+ \| (\d\.\d\d) ± (\d\.\d\d) \| ([\d., ]+) \| (–|[+-]\d\.\d\d) \| "
        r"(–|[+-]\d+\.\d) ?%? ?\|",
        lambda: tuple(v for s, c in DS_ROWS for v in scaling_row(s, c)),
    ),
    Claim(
        "diloco_scaling/verdicts",
        "experiments/diloco_scaling",
        r"\| \(a\) \| DiLoCo M=1 > DP AdamW \| \*?\*?([a-z ]+?)\*?\*? (\([^)]+\)) \|.*"
        r"\| \(b\) \| DiLoCo M=1 > DiLoCo M=2 \| \*?\*?([a-z ]+?)\*?\*? (\([^)]+\)) \|.*"
        r"\| \(b\) \| DiLoCo M=2 > DiLoCo M=4 \| \*?\*?([a-z ]+?)\*?\*? (\([^)]+\)) \|.*"
        r"\| \(b\) \| DiLoCo M=4 > DiLoCo M=8 \| \*?\*?([a-z ]+?)\*?\*? (\([^)]+\)) \|.*"
        r"\| \(d\) \| H = 10, 30, 100 each within 0\.05 of H = 15, both ways \((\d) "
        r"expectations\) \| (unresolved), (all) (six) \(H = 10: ([^;]+); H = 30: ([^;]+); "
        r"H = 100: ([^;]+);",
        lambda: (
            *(part for v in verdicts(DS)[:4] for part in split_verdict(v)),
            len(verdicts(DS)[4:]),
            *{split_verdict(v)[0] for v in verdicts(DS)[4:]},
            quantifier(
                sum(split_verdict(v)[0] == "unresolved" for v in verdicts(DS)[4:]),
                len(verdicts(DS)[4:]),
            ),
            len(verdicts(DS)[4:]),
            *(split_verdict(v)[1][1:-1] for v in verdicts(DS)[4::2]),
        ),
    ),
    Claim(
        "lm_shakespeare/since-diloco-scaling",
        "experiments/lm_shakespeare",
        r"with M = 2 and M = 4 replicas DiLoCo ends (\d\.\d) % and (\d\.\d) % behind "
        r"data-parallel AdamW .* a warm start from a 375-step data-parallel model removes it too "
        r"and ends (\d\.\d) % behind",
        lambda: tuple(
            scaling_row(s, c)[4].lstrip("+")
            for s, c in ((DS, "DiLoCo M=2"), (DS, "DiLoCo M=4"), (DW, "DiLoCo M=8 warm"))
        ),
    ),
    Claim(
        "diloco_scaling/warm-verdict",
        "experiments/diloco_scaling",
        r"\(e\) \| DiLoCo M=8 warm > DiLoCo M=8 .*?\*\*holds\*\* \(\+(\d\.\d\d) ± (\d\.\d\d)\).*"
        r"The harness's rule gives \"holds\" \(\+\d\.\d\d, (\d\.\d) standard errors\)",
        lambda: (*warm_verdict()[:2], warm_verdict()[2]),
    ),
    Claim(
        "lm/clipped/runs-picks",
        "experiments/lm_shakespeare",
        r"`clipped\.yaml`: (\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final seeds\)\. "
        r"(Every) pick is interior \((\d+) of (\d+)\); (\d+) of the (\d+) picks were won within "
        r"the selection's noise",
        lambda: runs_and_picks(LC),
    ),
    Claim(
        "lm/clipped-more/runs-picks",
        "experiments/lm_shakespeare",
        r"`clipped_more\.yaml`: (\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final "
        r"seeds\)\. (Every) pick is interior \((\d+) of (\d+)\); (\d+) of the (\d+) picks were "
        r"won within the selection's noise",
        lambda: runs_and_picks(LM_MORE),
    ),
    table_rows(
        "lm/clipped-more/rows",
        "experiments/lm_shakespeare",
        [c for c, _ in LM_MORE_ROWS],
        r"([\d.e-]+) \| (\d\.\d\d) ± (\d\.\d\d) \| ([\d., ]+) \| (–|[+-]\d\.\d\d) \|",
        lambda: tuple(v for c, b in LM_MORE_ROWS for v in clipped_row(c, b, LM_MORE, LC)),
    ),
    Claim(
        "lm/clipped-muloco/runs-picks",
        "experiments/lm_shakespeare",
        r"`clipped_muloco\.yaml`: (\d+) runs \((\d+) grid, (\d+) grid extensions, (\d+) final "
        r"seeds\)\. (Every) pick is interior \((\d+) of (\d+)\); (\d+) of the (\d+) picks were "
        r"won within the selection's noise",
        lambda: runs_and_picks(LM_MUON),
    ),
    table_rows(
        "lm/clipped-muloco/rows",
        "experiments/lm_shakespeare",
        ["MuLoCo H=15"],
        r"([\d.e-]+) \| (\d\.\d\d) ± (\d\.\d\d) \| ([\d., ]+) \| (–|[+-]\d\.\d\d) \|",
        lambda: clipped_row("MuLoCo H=15", "sync AdamW", LM_MUON, LC),
    ),
    Claim(
        "lm/clipped/as-diloco-scaling",
        "experiments/lm_shakespeare",
        r"end where those did, to the last bit, in all (\d+) runs they share",
        lambda: (len(runs_as_scaling()),),
    ),
    table_rows(
        "lm/clipped/rows",
        "experiments/lm_shakespeare",
        [c for c, _ in LC_ROWS],
        r"([\d.]+) \| (\d\.\d\d) ± (\d\.\d\d) \| ([\d., ]+) \| (–|[+-]\d\.\d\d) \|",
        lambda: tuple(v for c, b in LC_ROWS for v in clipped_row(c, b)),
    ),
    table_rows(
        "lm/clipped/verdicts",
        "experiments/lm_shakespeare",
        [
            "DiLoCo H=15 within 0.05 of sync AdamW",
            "DiLoCo H=15 (by work) within 0.05 of sync AdamW (by work)",
            "SparseLoCo H=15 > DiLoCo H=15",
            "SparseLoCo H=15 (by work) > DiLoCo H=15 (by work)",
        ],
        r"([a-z ]+?) (\([^)]+\)) \|",
        lambda: tuple(part for v in verdicts(LC) for part in split_verdict(v)),
    ),
    Claim(
        "lm/clipped/stable-gap",
        "experiments/lm_shakespeare",
        r"all three seeds at (\d\.\d\d)–(\d\.\d\d), \*\*(\d\.\d\d) bits per character "
        r"\((\d\.\d) %\) behind synchronous AdamW\*\*",
        lambda: (
            f"{min(final_values(LC, 'DiLoCo H=15 outer lr 0.35')):.2f}",
            f"{max(final_values(LC, 'DiLoCo H=15 outer lr 0.35')):.2f}",
            gap(LC, "DiLoCo H=15 outer lr 0.35", "sync AdamW"),
            f"{100 * float(relative_gap('DiLoCo H=15 outer lr 0.35', 'sync AdamW')):.1f}",
        ),
    ),
    Claim(
        "lm/clipped/density",
        "experiments/lm_shakespeare",
        r"doubling it to 3\.1 % .* gains (\d\.\d\d\d) ± (\d\.\d\d\d) bits per character "
        r"\((\d\.\d) standard errors: (unresolved)\)",
        density_gain,
    ),
    # -- the main README's table of studies -------------------------------------------------
    *(
        Claim(
            f"main/{study}",
            ".",
            rf"`experiments/{folder}` \| [^|]* \| (\d+)[ |]",
            lambda study=study: (len(runs(study)),),
        )
        for folder, study in (
            ("compression_subset", CS),
            ("powersgd_table6", "powersgd_table6/study"),
            ("local_sgd", "local_sgd/study"),
            ("gossip_subset", "gossip_subset/study"),
            ("async", "async/least_squares"),
            ("lm_shakespeare/gpu.yaml", "lm_shakespeare/gpu"),
            ("stragglers", ST),
            ("diloco_scaling", DS),
            ("lm_shakespeare/clipped.yaml", LC),
            ("lm_shakespeare/clipped_more.yaml", LM_MORE),
            ("lm_shakespeare/clipped_muloco.yaml", LM_MUON),
        )
    ),
    # -- async/README.md ---------------------------------------------------------------------
    *(
        Claim(
            f"async/{name}/picks",
            "experiments/async",
            rf"{title}.*?picks over the 2 horizons: (\d+) of (\d+) interior, (\d+) at an edge "
            r"of the lrs tried \((\d+) with the bound reached\); (\d+) of (\d+) won within noise",
            lambda name=name: (
                picks(f"async/{name}").interior,
                picks(f"async/{name}").picks,
                picks(f"async/{name}").edge,
                picks(f"async/{name}").bound,
                picks(f"async/{name}").close,
                picks(f"async/{name}").picks,
            ),
        )
        for name, title in (("least_squares", "Part \\(a\\)"), ("cifar", "Part \\(b\\)"))
    ),
    Claim(
        "async/least_squares/seeds",
        "experiments/async",
        r"Tuned on seeds (\d) and (\d) over log-spaced lr grids grown past every edge pick, the "
        r"final seeds (\d), (\d) and (\d) at the selected lr \(n = (\d)\)",
        lambda: (
            *report("async/least_squares").study.selection_seeds,
            *final_seeds("async/least_squares"),
            len(final_seeds("async/least_squares")),
        ),
    ),
    Claim(
        "async/cifar/seeds",
        "experiments/async",
        r"Tuned on seeds (\d) and (\d), (all) (\d) grids grown past their initial lrs, (\d) final "
        r"seeds \((\d), (\d), (\d)\)",
        lambda: (
            *report("async/cifar").study.selection_seeds,
            quantifier(
                len(grown_grids(report("async/cifar").study, runs("async/cifar"))),
                sum(c.lr_from is None for c in report("async/cifar").study.cases),
            ),
            sum(c.lr_from is None for c in report("async/cifar").study.cases),
            len(final_seeds("async/cifar")),
            *final_seeds("async/cifar"),
        ),
    ),
    Claim(
        "async/cifar/points",
        "experiments/async",
        r"the CIFAR study's (\d+) points took",
        lambda: (len(runs("async/cifar")),),
    ),
    Claim(
        "main/async-cifar",
        ".",
        r"`experiments/async` \| [^|]* \| (\d+) \(least squares\) \+ (\d+) \(CIFAR: (\d+) grid, "
        r"(\d+) extensions, (\d+) final seeds\)",
        lambda: (
            len(runs("async/least_squares")),
            len(runs("async/cifar")),
            *roles("async/cifar").values(),
        ),
    ),
    Claim(
        "main/outer",
        ".",
        r"`experiments/outer` \| [^|]* \| (\d+) \((\d+) grid, (\d+) grid extensions, (\d+) "
        r"final seeds\) \+ (\d+) \(stage 2: (\d+) grid, (\d+) grid extensions, (\d+) final "
        r"seeds\)",
        lambda: (len(runs(OS)), *roles(OS).values(), len(runs(OL)), *roles(OL).values()),
    ),
    Claim(
        "main/lm",
        ".",
        r"`experiments/lm_shakespeare` \| [^|]* \| (\d+) tuning \((\d+) grid, (\d+) "
        r"extensions\) \+ (\d+) final seeds",
        lambda: (roles(LM)["grid"] + roles(LM)["extensions"], *roles(LM).values()),
    ),
    Claim(
        "main/lm-probe",
        ".",
        r"`experiments/lm_shakespeare/probe_clip\.yaml` \| [^|]* \| (\d+) \((\d+) cases × seeds "
        r"(\d)–(\d), (nothing) selected\)",
        lambda: (
            len(runs(LP)),
            len(report(LP).study.cases),
            min(runs(LP)["cfg.seed"]),
            max(runs(LP)["cfg.seed"]),
            "nothing" if untuned(report(LP).study) else "a pick",
        ),
    ),
]


def test_clipped_runs_configured_as_diloco_scalings_end_where_those_did():
    """clipped.yaml's sync AdamW and DiLoCo H=15 are diloco_scaling's DP AdamW and DiLoCo M=8
    (outer lr 0.7) in every setting that reaches training (only `data.sample_tokens`, text
    generated after the last evaluation, differs): every run they share (same inner lr and
    seed) ends at the same losses, two studies apart — the runs are reproducible, and the two
    READMEs read the same numbers."""
    pairs = runs_as_scaling()
    assert len(pairs) >= 10, len(pairs)  # both cases' tuning grids and the final seeds
    for ours, theirs in pairs:
        for metric in ("test/bpc", "val/bpc", "train/loss"):
            assert ours[metric] == theirs[metric], (ours["run"], metric)


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.id)
def test_readme_count_is_the_run_datas(claim):
    match = re.search(claim.pattern, readme(claim.folder))
    assert match, f"{claim.folder}/README.md no longer states: {claim.pattern}"
    stated = tuple(number(g) for g in match.groups())
    assert stated, "a claim with nothing to compare cannot fail"
    assert stated == tuple(number(str(v)) for v in claim.expected()), claim.id


def test_claim_ids_are_unique():
    assert len({c.id for c in CLAIMS}) == len(CLAIMS)


SHIPPED = sorted(
    str(p.relative_to(REPO / "experiments").with_suffix(""))
    for p in project_files("experiments/*/*.yaml")
    if load_study(p).data_path.exists()
)


@pytest.mark.parametrize("study", SHIPPED)
def test_results_md_counts_its_own_picks(study):
    """The pick counts a shipped results.md states in its notes are the rows of its own
    results tables: picks are the rows with a selection, edges the rows saying "lr tried:",
    within-noise the rows saying "within noise" (an independent reading of the same report)."""
    r = report(study)
    text = (r.study.results_dir / "results.md").read_text()
    if untuned(r.study):  # one lr per case: nothing picked, and the report says so
        assert "every case at one lr (no grid, nothing selected)" in text
        assert "- picks" not in text
        return
    tables = re.findall(r"^## Results[^\n]*\n\n((?:\|[^\n]*\n)+)", text, re.M)
    assert len(tables) == len(r.horizons)
    rows = [row for t in tables for row in t.splitlines()[2:]]
    picked = [row for row in rows if "(n=" in row]  # the selection column of a pick
    counted = PickCounts(
        tuned=sum(c.lr_from is None for c in r.study.cases) * len(r.horizons),
        picks=len(picked),
        edge=sum("lr tried:" in row for row in picked),
        bound=sum("bound reached" in row for row in picked),
        close=sum("within noise" in row for row in picked),
    )
    assert picks(study) == counted
    where = "" if len(r.horizons) == 1 else f" over the {len(r.horizons)} horizons"
    stated = re.search(
        rf"^- picks{where}: (\d+) of (\d+) interior, (\d+) at an edge of the lrs "
        rf"tried \((\d+) with the bound reached\); (\d+) of \d+ won within noise",
        text,
        re.M,
    )
    assert stated, f"{study}: results.md states no pick counts"
    assert tuple(map(int, stated.groups())) == (
        counted.interior,
        counted.picks,
        counted.edge,
        counted.bound,
        counted.close,
    )
    roles_stated = re.search(
        r"^- runs by role: (\d+) on .*?, (\d+) on .*?, (\d+) final", text, re.M
    )
    assert roles_stated and sum(map(int, roles_stated.groups())) == len(r.runs)
