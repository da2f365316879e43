"""Each row of the table in docs/semantics.md of the early stopper's rules (min_delta, ties, NaN), run
through the Trainer: the scores are validated one a step, and the step the run stops at
and its best step must be what the row says."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from toy import TokenUnit, collate, make_model, make_samples

from trainer import early_stoppers
from trainer.trainer import Trainer
from units import EvalUnit, MetricBag

RULES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"


def rule_rows() -> list[list[str]]:
    """The table whose header starts with `| rule | scores | stopper |`, cell by cell."""
    text = RULES_PAGE.read_text()
    table = text.split("| rule | scores | stopper | stops at | best |", 1)[1]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


ROWS = rule_rows()


def test_the_readme_states_the_rules():
    assert [row[0].split(":")[0] for row in ROWS] == [
        "gains below `min_delta` add up", "a tie is no gain, and the oldest stays best",
        "a NaN score is one bad validation (one broken validation does not end a run by "
        "itself)", "to stop at the first NaN, as Lightning and TNT"]


class Scripted(EvalUnit):
    metric_names = ("loss",)

    def __init__(self, model, scores):
        self._model = model
        self.scores = scores
        self.trainer = None

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        metrics.update_mean("loss", self.scores[self.trainer.step_nr - 1])


@pytest.mark.parametrize("row", ROWS, ids=[row[0][:30] for row in ROWS])
def test_each_rule_of_the_readme_table_holds_through_the_trainer(tmp_path, row):
    _, scores_text, stopper_text, stops_at, best, *_ = row
    scores = [math.nan if s == "nan" else float(s) for s in scores_text.split(", ")]
    stopper = eval(stopper_text.strip("`"), vars(early_stoppers))  # noqa: S307 (our docs)
    model = make_model()
    unit = Scripted(model, scores)
    samples = make_samples(2 * len(scores), seed=1)
    data = [collate(samples[i:i + 2]) for i in range(0, len(samples), 2)]
    trainer = Trainer(TokenUnit(model), data, torch.optim.SGD(model.parameters(), lr=0.0),
                      output_dir=tmp_path, recorders=[], valid_units=[unit],
                      valid_data_readers=[[None]], score_metric="valid/loss",
                      validate_every_n_steps=1, max_num_steps=len(scores),
                      early_stopper=stopper)
    unit.trainer = trainer
    result = trainer.run()
    if stops_at == "never":
        assert (result.stop_reason, result.num_steps) == ("max_num_steps", len(scores))
    else:
        assert (result.stop_reason, result.num_steps) == ("early_stop", int(stops_at))
    assert result.best_step == int(best)


# -- the peers' columns, from their rules transcribed (lower-better) ---------------------------

def lightning_stops_at(scores, patience, min_delta=0.0):
    """Lightning's `EarlyStopping._evaluate_stopping_criteria` (TNT's `EarlyStopChecker` is
    the same): `check_finite` stops at a NaN; an improvement is `score + min_delta < best`,
    and only an improvement moves `best`."""
    best, wait = math.inf, 0
    for index, score in enumerate(scores, 1):
        if not math.isfinite(score):
            return index
        if score + min_delta < best:
            best, wait = score, 0
        else:
            wait += 1
            if wait >= patience:
                return index
    return None


def hf_stops_at(scores, patience, threshold=0.0):
    """HF's `EarlyStoppingCallback.check_metric_value`: the counter resets only on a gain
    over `state.best_metric` larger than the threshold; the Trainer then moves
    `best_metric` on any strict gain (`_determine_best_metric`, after the callback)."""
    best, counter = None, 0
    for index, score in enumerate(scores, 1):
        if best is None or (score < best and abs(score - best) > threshold):
            counter = 0
        else:
            counter += 1
        if best is None or score < best:
            best = score
        if counter >= patience:
            return index
    return None


def leading(cell: str) -> int | None | str:
    word = cell.split(" ", 1)[0]
    return None if word == "never" else "-" if word == "-" else int(word)


@pytest.mark.parametrize("row", ROWS[:3], ids=[row[0][:30] for row in ROWS[:3]])
def test_the_peers_columns_follow_their_rules(row):
    _, scores_text, stopper_text, _, _, lightning, hf = row
    scores = [math.nan if s == "nan" else float(s) for s in scores_text.split(", ")]
    stopper = eval(stopper_text.strip("`"), vars(early_stoppers))  # noqa: S307 (our docs)
    assert leading(lightning) == lightning_stops_at(scores, stopper.patience, stopper.min_delta)
    assert leading(hf) == hf_stops_at(scores, stopper.patience, stopper.min_delta)
