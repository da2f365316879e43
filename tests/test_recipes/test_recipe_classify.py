"""`python -m recipes.classify`: a tiny run early-stops by patience; its data reader shards
by DP rank and resumes exactly."""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from recipe_runs import describe, run_module

from gangtrain.app.cli import load_config
from recipes.classify.config import PRESETS, ClassifyConfig
from recipes.classify.data import ShardedBatchReader, eval_batches, make_spirals, split
from trainer.early_stoppers import Patience
from trainer.observe.recorders import read_jsonl


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("classify") / "out"
    proc = run_module("recipes.classify", out, "--preset", "tiny")
    assert proc.returncode == 0, describe(proc)
    assert "Traceback" not in proc.stderr
    return out, proc, " ".join(proc.stdout.split())


def test_tiny_run_early_stops_by_patience(tiny_run):
    out, _, stdout = tiny_run
    config = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))["trainer"]
    assert config["early_stopper"] == {"name": "patience", "patience": 3, "min_delta": 0.001}
    assert config["score_metric"] == "valid/accuracy" and config["lower_better"] is False
    assert config["keep_best_n_checkpoints"] == 1
    assert config["checkpoint_every_n_steps"] == config["validate_every_n_steps"]

    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    every = config["validate_every_n_steps"]
    steps = [r["step"] for r in valid]
    assert steps == [every * (i + 1) for i in range(len(valid))]
    assert steps[-1] < config["max_num_steps"]

    # Replaying the recorded scores through a fresh stopper: it says stop at the last one only.
    stopper = Patience(3, min_delta=0.001, lower_better=False)
    decisions = [stopper(r["step"], r["valid/accuracy"]) for r in valid]
    assert decisions == [False] * (len(valid) - 1) + [True]

    match = re.search(r"stopped after step (\d+): early_stop by patience\(3, min_delta=0\.001",
                      stdout)
    assert match, stdout
    assert int(match.group(1)) == steps[-1]
    assert (out / "metrics" / "train.jsonl").is_file()


def test_tiny_run_reports_best_accuracy(tiny_run):
    out, _, stdout = tiny_run
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    best = max(r["valid/accuracy"] for r in valid)
    assert 0.5 < best < 1.0  # it learns, and label noise keeps it below 100%
    match = re.search(r"best valid/accuracy: (\d\.\d+) at step (\d+)", stdout)
    assert match, stdout
    assert match.group(1) == f"{best:.4f}"
    # Ties go to the oldest step, as in checkpoint retention (and Lightning, HF, TNT).
    assert int(match.group(2)) == min(r["step"] for r in valid if r["valid/accuracy"] == best)

    # The best step and the newest one are what keep_best_n_checkpoints=1 leaves.
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert set(kept) == {f"step_{match.group(2)}", f"step_{valid[-1]['step']}"}


# -------------------------------------------------------------------------------------------
# The data


def test_presets_validate():
    for name in PRESETS:
        config = load_config(ClassifyConfig, PRESETS, preset=name)
        assert config.trainer.checkpoint_every_n_steps == config.trainer.validate_every_n_steps


def test_spirals_are_deterministic_with_label_noise():
    a = make_spirals(3000, num_classes=3, dim=16, label_noise=0.1, seed=5)
    b = make_spirals(3000, num_classes=3, dim=16, label_noise=0.1, seed=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[0].shape == (3000, 16) and a[0].dtype == torch.float32
    clean = make_spirals(3000, num_classes=3, dim=16, label_noise=0.0, seed=5)
    assert torch.equal(clean[0], a[0])  # label noise changes labels only
    flipped = (clean[1] != a[1]).float().mean().item()
    assert 0.07 < flipped < 0.13
    assert torch.bincount(clean[1]).tolist() == [1000, 1000, 1000]


def _epoch(reader):
    return [(x.clone(), y.clone()) for x, y in reader]


def test_reader_shards_global_batches_by_dp_rank():
    data = make_spirals(1000, seed=1)
    whole = _epoch(ShardedBatchReader(data, 64, seed=3))
    parts = [_epoch(ShardedBatchReader(data, 64, rank, 4, seed=3)) for rank in range(4)]
    assert len(whole) == 1000 // 64 and all(len(p) == len(whole) for p in parts)
    for i, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([p[i][0] for p in parts]), x)
        assert torch.equal(torch.cat([p[i][1] for p in parts]), y)


def test_reader_resumes_exactly_across_epochs():
    data = make_spirals(500, seed=2)
    reference = ShardedBatchReader(data, 32, 1, 2, seed=7)
    expected = _epoch(reference) + _epoch(reference)  # two epochs, different orders
    assert not torch.equal(expected[0][0], expected[len(expected) // 2][0])

    for cut in (0, 5, len(expected) // 2, len(expected) // 2 + 3):
        reader = ShardedBatchReader(data, 32, 1, 2, seed=7)
        seen = []
        while len(seen) < cut:
            for batch in reader:
                seen.append(batch)
                if len(seen) == cut:
                    break
        state = reader.state_dict()
        assert all(type(v) is int for v in state.values()) and set(state) == {"epoch",
                                                                              "batch_index"}
        resumed = ShardedBatchReader(data, 32, 1, 2, seed=7)
        resumed.load_state_dict(state)
        rest = []
        while len(seen) + len(rest) < len(expected):
            rest.extend(resumed)
        for (x, y), (ex, ey) in zip(seen + rest, expected):
            assert torch.equal(x, ex) and torch.equal(y, ey)


def test_eval_batches_cover_every_sample_once():
    train, valid = split(make_spirals(1100, seed=4), 100)
    assert train[0].shape[0] == 1000 and valid[0].shape[0] == 100
    shards = [eval_batches(valid, 30, rank, 3) for rank in range(3)]
    assert len({len(s) for s in shards}) == 1  # the same number of batches on every rank
    rows = [torch.cat([s[j][0] for s in shards]) for j in range(len(shards[0]))]
    assert torch.equal(torch.cat(rows), valid[0])
