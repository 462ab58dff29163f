"""The analysis reads language-model runs as an LM researcher would: selection on the
validation bits per character (lower is better, before next-token accuracy), `test/bpc` and
`val/bpc` among the default metrics and curves, tokens as an x-axis."""

from __future__ import annotations

from dpresearch.analysis.aggregate import choose_selection, default_mode
from dpresearch.analysis.plots import axis_label
from dpresearch.analysis.report import DEFAULT_METRICS
from dpresearch.analysis.rundata import CURVES


def test_a_language_model_is_selected_on_its_validation_bits_per_character():
    selection = choose_selection(["val/acc", "val/bpc", "val/loss", "train/loss"])
    assert (selection.metric, selection.mode) == ("val/bpc", "min")
    # an image classifier's runs have no bpc: their selection is as before
    assert choose_selection(["val/acc", "val/loss"]).metric == "val/acc"


def test_lower_is_better_for_bits_and_perplexity():
    for metric in ("test/bpc", "val/ppl", "val/bits_per_token", "val/loss"):
        assert default_mode(metric) == "min", metric
    assert default_mode("val/acc") == "max"


def test_tokens_and_bits_per_character_are_reported_and_plotted():
    assert {"test/bpc", "val/bpc"} <= set(DEFAULT_METRICS)
    assert {"tokens", "test/bpc", "val/bpc"} <= set(CURVES)
    label, factor = axis_label("tokens")
    assert "tokens" in label and factor == 1e-6
