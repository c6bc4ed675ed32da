"""`kvstrata bench grammar-steps` runs end to end and prints its per-step costs (not a timing test)."""

from __future__ import annotations

from kvstrata.bench import main


def test_grammar_steps_reports_fill_and_apply(capsys):
    assert main(["grammar-steps", "--vocab-size", "1000", "--steps", "4", "--batch-size", "2",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "compile json" in out or "compile json_schema" in out, out
    assert "4 steps on cpu" in out and "fill  (all rows)" in out and "apply (all rows)" in out
