import math

import pytest
import torch

from gangs import FakeGang, setup_gangs
from trainer.checkpoint import CheckpointManager, rank_by_score, steps_to_keep
from trainer.checkpoint.directory import pointer_target

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NAN = math.nan


# --- the pure rule -------------------------------------------------------------------------


def test_both_none_keeps_everything():
    assert steps_to_keep([3, 1, 2], {1: 0.5}, None, None, True) == {1, 2, 3}
    assert steps_to_keep([], {}, 2, 2, True) == set()


def test_newest_always_kept():
    assert steps_to_keep([1, 2, 3], {1: 0.1}, 0, None, True) == {3}
    assert steps_to_keep([1, 2, 3], {}, None, 0, True) == {3}


def test_only_last_n_given_best_contributes_nothing():
    scores = {1: 0.1, 2: 0.9, 3: 0.5, 4: 0.7}
    assert steps_to_keep([1, 2, 3, 4], scores, 2, None, True) == {3, 4}


def test_only_best_n_given_last_contributes_nothing():
    scores = {1: 0.1, 2: 0.9, 3: 0.5, 4: 0.7}
    assert steps_to_keep([1, 2, 3, 4], scores, None, 1, True) == {1, 4}


def test_union_lower_better_overlapping():
    # last 2 = {5, 6}; best 2 (lowest) = {6 (0.1), 2 (0.2)}: overlap on 6.
    scores = {1: 0.5, 2: 0.2, 3: 0.4, 4: 0.3, 5: 0.9, 6: 0.1}
    assert steps_to_keep([1, 2, 3, 4, 5, 6], scores, 2, 2, True) == {2, 5, 6}


def test_union_higher_better():
    scores = {1: 0.5, 2: 0.2, 3: 0.4, 4: 0.3, 5: 0.9, 6: 0.1}
    # best 2 (highest) = {5 (0.9), 1 (0.5)}; last 2 = {5, 6}.
    assert steps_to_keep([1, 2, 3, 4, 5, 6], scores, 2, 2, False) == {1, 5, 6}


def test_nan_never_best_and_unscored_not_candidates():
    scores = {1: NAN, 2: 0.7, 3: NAN}
    assert rank_by_score([1, 2, 3, 4], scores, True) == [2]
    assert rank_by_score([1, 2, 3, 4], scores, False) == [2]
    assert steps_to_keep([1, 2, 3, 4], scores, None, 2, True) == {2, 4}


def test_ties_prefer_older_step():
    # A strict comparison, as Lightning's top-k, HF's best model and TNT: a tie never
    # displaces the step that reached the score first.
    scores = {1: 0.3, 2: 0.3, 3: 0.3, 4: 0.9}
    assert rank_by_score([1, 2, 3, 4], scores, True) == [1, 2, 3, 4]
    assert steps_to_keep([1, 2, 3, 4, 5], scores, None, 2, True) == {1, 2, 5}
    assert steps_to_keep([1, 2, 3, 4, 5], scores, None, 1, False) == {4, 5}


def test_infinite_scores_rank_normally():
    scores = {1: math.inf, 2: -math.inf, 3: 0.0}
    assert rank_by_score([1, 2, 3], scores, True) == [2, 3, 1]
    assert rank_by_score([1, 2, 3], scores, False) == [1, 3, 2]


def test_negative_n_rejected():
    with pytest.raises(ValueError, match="keep_best_n must be >= 0"):
        steps_to_keep([1], {}, None, -1, True)


# --- the manager applies it, across a restart ----------------------------------------------


def _model_and_optim():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _dirs(path):
    return sorted(p.name for p in path.iterdir() if p.name.startswith("step_"))


def test_manager_retention_end_to_end_and_after_restart(tmp_path):
    gangs = setup_gangs(FakeGang())
    model, optim = _model_and_optim()
    mgr = CheckpointManager(tmp_path, gangs, keep_last_n=2, keep_best_n=2, lower_better=True)
    scores = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 6.0, 6: 7.0}
    for step in range(1, 7):
        if step % 2:  # score given with the save ...
            mgr.save(step, model, optim, {"step": step}, score=scores[step])
        else:  # ... or recorded after it
            mgr.save(step, model, optim, {"step": step})
            mgr.record_score(step, scores[step])
    # newest 6, last two {5, 6}, best two {4 (1.0), 2 (3.0)}
    assert _dirs(tmp_path) == ["step_2", "step_4", "step_5", "step_6"]
    assert mgr.steps() == [2, 4, 5, 6]
    assert (mgr.last_step, mgr.best_step) == (6, 4)
    assert pointer_target(tmp_path / "last") == "step_6"
    assert pointer_target(tmp_path / "best") == "step_4"
    assert mgr.manifest(4)["score"] == 1.0
    mgr.close()

    # A restart with stricter limits: the scores come back from the manifests.
    mgr = CheckpointManager(tmp_path, gangs, keep_last_n=1, keep_best_n=1, lower_better=True)
    mgr.save(7, model, optim, {"step": 7}, score=2.0)
    assert _dirs(tmp_path) == ["step_4", "step_7"]
    # A score recorded before its save reaches the manifest at commit.
    mgr.record_score(8, 0.5)
    mgr.save(8, model, optim, {"step": 8})
    assert _dirs(tmp_path) == ["step_8"]
    assert mgr.manifest(8)["score"] == 0.5
    assert pointer_target(tmp_path / "best") == "step_8"
    mgr.close()


def test_manager_keeps_everything_by_default(tmp_path):
    gangs = setup_gangs(FakeGang())
    model, optim = _model_and_optim()
    mgr = CheckpointManager(tmp_path, gangs)
    for step in (1, 2, 3):
        mgr.save(step, model, optim, {})
    assert mgr.steps() == [1, 2, 3] and mgr.best_step is None
    assert not (tmp_path / "best").exists()
    mgr.close()


def test_retention_through_a_symlinked_step_leaves_no_trash(tmp_path):
    """A step_N a user replaced by a link (moved to another disk): retention removes the
    link, leaves what it points to, and no `.trash_step_N` stays behind."""
    gangs = setup_gangs(FakeGang())
    model, optim = _model_and_optim()
    run = tmp_path / "checkpoints"
    mgr = CheckpointManager(run, gangs, keep_last_n=1)
    mgr.save(1, model, optim, {"step": 1})
    moved = tmp_path / "other_disk" / "step_1"
    moved.parent.mkdir()
    (run / "step_1").rename(moved)
    (run / "step_1").symlink_to(moved)
    mgr.save(2, model, optim, {"step": 2})
    mgr.close()
    assert sorted(p.name for p in run.iterdir()) == ["last", "step_2"]
    assert (moved / "manifest.json").exists()
