"""Under `torchrun --nproc-per-node 2`, a Trainer and an `evaluate` built without `gangs=`
use the torchrun world: one run over both ranks, equal to one process on the whole global
batch; one line in eval.jsonl; a model not wrapped for DP refused at construction; and a
warning raised on every rank printed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerances import reordered_sum_rtol, sgd_weight_atol
from torchrun_defaults import GLOBAL_BATCH, LR, STEPS, TokenEval, shard
from toy import T, TokenUnit, make_model, make_samples

from trainer import Trainer
from trainer.observe.recorders import read_jsonl

HERE = Path(__file__).resolve().parent
# reason: a step's gradient sums its global batch's <= GLOBAL_BATCH * T token terms in float32,
# each rank half of them, added by DDP in another order
GRAD_RTOL = reordered_sum_rtol(GLOBAL_BATCH * T)
# reason: a score sums <= 2 * GLOBAL_BATCH * T token losses of one sign (halves synced over the
# ranks), at weights GRAD_RTOL relative apart in their moves
SCORE_RTOL = reordered_sum_rtol(2 * GLOBAL_BATCH * T) + GRAD_RTOL


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun_defaults")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "torchrun_defaults.py"), str(out)],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = {rank: json.loads((out / f"report_rank_{rank}.json").read_text())
               for rank in (0, 1)}
    return out, reports, proc.stdout + proc.stderr


def test_an_unwrapped_model_is_refused_at_construction_on_every_rank(launched):
    _, reports, _ = launched
    for report in reports.values():
        assert "not wrapped for data parallelism over 2 ranks" in report["refused"]
        assert "setup_gangs(setup_root_gang())" in report["refused"]


def test_a_trainer_without_gangs_trains_one_run_over_both_ranks(launched, tmp_path):
    out, reports, _ = launched
    assert reports[0]["score_history"] == reports[1]["score_history"]
    assert [step for step, _ in reports[0]["score_history"]] == [4, 8]
    # The reference: one process on the whole global batch of each step.
    model = make_model()
    train = shard(make_samples(GLOBAL_BATCH * STEPS, seed=4), 0, 1)
    valid = shard(make_samples(GLOBAL_BATCH * 2, seed=7), 0, 1)
    result = Trainer(TokenUnit(model), train, torch.optim.SGD(model.parameters(), lr=LR),
                     output_dir=tmp_path, valid_units=[TokenEval(model)],
                     valid_data_readers=[valid], score_metric="valid/token_loss",
                     validate_every_n_steps=4, max_num_steps=STEPS, recorders=[]).run()
    score_gap = param_gap = 0.0
    for (step, score), (ref_step, ref_score) in zip(reports[0]["score_history"],
                                                    result.score_history):
        assert step == ref_step and score == pytest.approx(ref_score, rel=SCORE_RTOL, abs=0)
        score_gap = max(score_gap, abs(score / ref_score - 1) / SCORE_RTOL)
    trained = torch.load(out / "params.pt", weights_only=True)
    start = make_model().state_dict()
    for name, value in model.state_dict().items():
        # reason: SGD's update is linear in the gradient, so the moves from the start differ
        # GRAD_RTOL relative, plus one float32 rounding of the weight a step
        moved = (value - start[name]).abs().max().item()
        atol = sgd_weight_atol(moved, value.abs().max().item(), GRAD_RTOL, STEPS)
        torch.testing.assert_close(trained[name], value, rtol=0, atol=atol, msg=name)
        param_gap = max(param_gap, (trained[name] - value).abs().max().item() / atol)
    print(f"gaps (of float32's allowance): score {score_gap:.2f}, parameters {param_gap:.2f}")
    # One run: one metrics file, written by rank 0; every checkpoint complete.
    assert [r["step"] for r in read_jsonl(out / "run" / "metrics" / "valid.jsonl")] == [4, 8]
    assert sorted(p.name for p in (out / "run" / "checkpoints").glob("step_*")) == [
        "step_4", "step_8"]


def test_evaluate_without_gangs_scores_both_shards_in_one_line(launched):
    out, reports, _ = launched
    assert reports[0]["evaluated"] == reports[1]["evaluated"]
    (line,) = read_jsonl(out / "run" / "metrics" / "eval.jsonl")
    assert line["step"] == 8
    # The checkpoint's recorded score again: both shards, synced.
    assert line["valid/token_loss"] == pytest.approx(dict(reports[0]["score_history"])[8],
                                                     rel=1e-6)


def test_a_warning_raised_on_every_rank_is_printed_once(launched):
    _, _, console = launched
    warning = "score_metric 'valid/token_loss': valid unit 'valid' declares no direction"
    assert console.count(warning) == 1, console
    assert f"[gangtrain] WARNING: {warning}" in console
