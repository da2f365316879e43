"""Failure paths lose nothing and change nothing (DESIGN.md, semantics 8): each case through
the public Trainer, against a run that never failed or against what was saved."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from torchdata.stateful_dataloader import StatefulDataLoader
from toy import TokenUnit, collate, make_model, make_samples

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer import Callback
from trainer.checkpoint import verify
from trainer.early_stoppers import patience
from trainer.errors import NonFiniteLossError, UserError
from trainer.trainer import Trainer
from units import EvalUnit, MetricBag


def batches(n=30, seed=5, per_batch=2):
    samples = make_samples(n * per_batch, seed=seed)
    return [collate(samples[i:i + per_batch]) for i in range(0, n * per_batch, per_batch)]


def saved_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's model and optimizer state (DCP, loaded as it is)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir / "model_optim"), str(out))
    state = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)

    walk("", state)
    return flat


# -- 1. a NaN gradient under a finite loss -------------------------------------------------

class NanGradientUnit(TokenUnit):
    """A finite loss whose gradient is NaN at `at_steps`: `0 * sqrt(|w - w.detach()|)`."""

    def __init__(self, model, at_steps):
        super().__init__(model)
        self.at_steps, self.step_nr = at_steps, 0

    def set_step_nr(self, step_nr):
        self.step_nr = step_nr

    def __call__(self, batch, metrics):
        loss, n = super().__call__(batch, metrics)
        if self.step_nr in self.at_steps:
            w = next(self.model.parameters())
            loss = loss + 0 * torch.sqrt((w - w.detach()).abs()).sum()
        return loss, n


@pytest.mark.parametrize("fused", [True, False])
def test_nan_gradient_with_finite_loss_is_never_saved(tmp_path, fused):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    trainer = Trainer(NanGradientUnit(model, {6}), batches(), opt, output_dir=tmp_path,
                      recorders=[], max_num_steps=12, checkpoint_every_n_steps=3)
    with pytest.raises(NonFiniteLossError, match="step 6: the parameters or the optimizer "
                                                 "state are not finite") as err:
        trainer.run()
    assert "the last good checkpoint is" in str(err.value) and "step_3" in str(err.value)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_3"]
    assert verify(checkpoints / "step_3") is None
    tensors = saved_tensors(checkpoints / "step_3")
    assert any("optimizer" in k for k in tensors)
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


@pytest.mark.parametrize("fused", [True, False])
def test_nan_gradient_is_skipped_under_the_skip_policy(tmp_path, fused):
    def run(nan_steps, out):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
        result = Trainer(NanGradientUnit(model, nan_steps), batches(), opt, output_dir=out,
                         recorders=[], max_num_steps=8, max_consecutive_non_finite=1).run()
        return result, model

    result, model = run({4}, tmp_path / "a")
    assert result.num_skipped_steps == 1 and result.num_steps == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- 2. starting over in a used directory ----------------------------------------------

def toy_trainer(out, max_num_steps, **kwargs):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    kwargs.setdefault("recorders", None)
    return Trainer(TokenUnit(model), batches(), opt, output_dir=out, progress=False,
                   max_num_steps=max_num_steps, checkpoint_every_n_steps=5,
                   publish_metrics_every_n_steps=5, **kwargs)


def jsonl_steps(out: Path, section="train") -> list[int]:
    lines = (out / "metrics" / f"{section}.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_starting_over_in_a_used_directory_is_refused_or_overwrites(tmp_path):
    toy_trainer(tmp_path, 20).run()
    with pytest.raises(UserError, match="holds another run .*step_20.*--overwrite"):
        toy_trainer(tmp_path, 10, resume=False)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_10", "step_15", "step_20", "step_5"]  # nothing deleted by the refusal
    assert jsonl_steps(tmp_path) == [5, 10, 15, 20]
    result = toy_trainer(tmp_path, 10, resume=False, overwrite=True).run()
    assert result.num_steps == 10  # the old step 20 was not resumed
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_10", "step_5"]
    assert jsonl_steps(tmp_path) == [5, 10]


# -- 3. a stop signal, then the same command again -----------------------------------------

# Patience 2: an off-schedule validation at the signal (score 2.0 at step 7) would make the
# restarted run stop at step 10; on schedule the run goes on to step 30.
SCORE_AT = {5: 1.0, 7: 2.0, 10: 1.5, 15: 0.9, 20: 0.8, 25: 0.7, 30: 0.6}


NO_STOPPER = object()


class SignalAt(Callback):
    def __init__(self, step_nr):
        self.step_nr = step_nr

    def on_step_end(self, trainer):
        if trainer.step_nr == self.step_nr:
            os.kill(os.getpid(), signal.SIGTERM)


def scored_trainer(out, callbacks=(), scores=SCORE_AT, early_stopper=None, **kwargs):
    model = make_model()
    steps = {}

    class StepScore(EvalUnit):
        metric_names = ("loss",)

        @property
        def model(self):
            return model

        def __call__(self, batch, metrics: MetricBag):
            metrics.update_mean("loss", scores[steps["trainer"].step_nr])

    # A reader that resumes mid-epoch: the restarted run sees the batches a straight one does.
    reader = StatefulDataLoader(batches(40), batch_size=None)
    trainer = Trainer(TokenUnit(model), reader, torch.optim.AdamW(model.parameters()),
                      output_dir=out, recorders=None, progress=False,
                      valid_units=[StepScore()], valid_data_readers=[[None]],
                      score_metric="valid/loss", validate_every_n_steps=5,
                      checkpoint_every_n_steps=5, max_num_steps=30, callbacks=callbacks,
                      early_stopper=None if early_stopper is NO_STOPPER
                      else early_stopper or patience(2), **kwargs)
    steps["trainer"] = trainer
    return trainer, model


def test_a_stopped_and_restarted_run_ends_as_one_never_stopped(tmp_path):
    # A sync point every step: the signal at step 7 is honoured at step 7.
    straight, straight_model = scored_trainer(tmp_path / "straight",
                                              publish_metrics_every_n_steps=1)
    straight_result = straight.run()
    assert (straight_result.stop_reason, straight_result.num_steps) == ("max_num_steps", 30)

    stopped, _ = scored_trainer(tmp_path / "stopped", callbacks=[SignalAt(7)],
                                publish_metrics_every_n_steps=1)
    assert (stopped.run().stop_reason, stopped.step_nr) == ("signal", 7)
    restarted, restarted_model = scored_trainer(tmp_path / "stopped",
                                                publish_metrics_every_n_steps=1)
    result = restarted.run()
    assert (result.stop_reason, result.num_steps) == ("max_num_steps", 30)
    assert result.score_history == straight_result.score_history
    for a, b in zip(straight_model.parameters(), restarted_model.parameters()):
        assert torch.equal(a, b)  # bit for bit
    for section in ("train", "valid"):
        assert jsonl_steps(tmp_path / "stopped", section) == jsonl_steps(
            tmp_path / "straight", section)


# -- 4. the LR scheduler on skipped steps ---------------------------------------------------

def lr_after_skips(out, fused, host_count, gangs=None, rank=0):
    """A run of 6 steps whose step 3 has no targets; the LR at its end (1 / (1 + steps))."""
    model = make_model()
    if gangs is not None:
        model = data_parallel(model, gangs)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, fused=fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
    data = batches(6, seed=7 + rank)
    x, y = data[2]
    data[2] = (x, torch.full_like(y, -1))  # step 3: no targets on any rank
    result = Trainer(TokenUnit(model, host_count=host_count), data, opt, output_dir=out,
                     gangs=gangs, lr_scheduler=scheduler, recorders=[], max_num_steps=6).run()
    return result.num_skipped_steps, opt.param_groups[0]["lr"]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("host_count", [True, False])
def test_lr_scheduler_steps_on_skipped_steps_alike_on_every_path(tmp_path, fused, host_count):
    assert lr_after_skips(tmp_path, fused, host_count) == (1, 1 / 7)


def _lr_on_two_ranks(fused, host_count):
    gangs = setup_gangs(setup_root_gang())
    return lr_after_skips(tempfile.mkdtemp(), fused, host_count, gangs, gangs.root.rank)


@pytest.mark.parametrize("fused", [True, False])
def test_lr_scheduler_rule_holds_on_two_ranks(fused):
    results = run_ranks(lambda: _lr_on_two_ranks(fused, host_count=True), world_size=2)
    assert results == [(1, 1 / 7)] * 2


# -- 5. uneven data over DP ranks --------------------------------------------------------

def _uneven_data():
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    data = batches(10 - gangs.root.rank, seed=3 + gangs.root.rank)  # rank 1: one fewer
    result = Trainer(TokenUnit(model), data, opt, output_dir=tempfile.mkdtemp(), gangs=gangs,
                     recorders=[], max_num_data_epochs=1, publish_metrics_every_n_steps=4).run()
    return result.stop_reason, result.num_steps


def test_uneven_data_stops_every_rank_at_the_same_step():
    assert run_ranks(_uneven_data, world_size=2) == [("end_of_data", 9)] * 2


# -- 6. one rank's failure reaches every rank --------------------------------------------

def _save_fails_on_rank_1():
    import trainer.checkpoint.writer as writer

    gangs = setup_gangs(setup_root_gang())
    out = Path(os.environ["FAILURE_TEST_DIR"])
    model = data_parallel(make_model(), gangs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)

    class BreakDiskAt(Callback):
        def on_step_end(self, trainer):
            if trainer.step_nr == 4 and gangs.root.rank == 1:
                def full(fd):
                    raise OSError(28, "No space left on device")
                writer.os.fsync = full

    trainer = Trainer(TokenUnit(model), batches(10, seed=3 + gangs.root.rank), opt,
                      output_dir=out, gangs=gangs, recorders=[], max_num_steps=8,
                      checkpoint_every_n_steps=2, callbacks=[BreakDiskAt()])
    try:
        trainer.run()
    except Exception as error:  # noqa: BLE001 (the test looks at what every rank raised)
        return type(error).__name__, str(error)
    return None


def test_a_save_failing_on_one_rank_fails_every_rank_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("FAILURE_TEST_DIR", str(tmp_path))
    results = run_ranks(_save_fails_on_rank_1, world_size=2)
    for name, message in results:
        assert name == "CheckpointError"
        assert "saving step 4 failed on rank 1: " in message and "No space left" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_2"]
    assert verify(tmp_path / "checkpoints" / "step_2") is None


def _stopper_fails_on_rank_0():
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)

    class Score(EvalUnit):
        metric_names = ("loss",)

        @property
        def model(self):
            return model

        def __call__(self, batch, metrics):
            metrics.update_mean("loss", 1.0)

    def broken_stopper(step_nr, score):
        raise ZeroDivisionError("division by zero in my stopper")

    trainer = Trainer(TokenUnit(model), batches(10, seed=5 + gangs.dp.rank),
                      torch.optim.AdamW(model.parameters()),
                      output_dir=tempfile.mkdtemp(), gangs=gangs, recorders=[],
                      valid_units=[Score()], valid_data_readers=[[None]],
                      score_metric="valid/loss", validate_every_n_steps=2,
                      early_stopper=broken_stopper, max_num_steps=6)
    with pytest.raises(UserError) as err:
        trainer.run()
    return str(err.value)


def test_an_early_stopper_error_reaches_every_rank():
    for message in run_ranks(_stopper_fails_on_rank_0, world_size=2):
        assert "early stopper" in message and "at step 2 failed on rank 0" in message
        assert "ZeroDivisionError: division by zero in my stopper" in message


class FailsOnRank(TokenUnit):
    """Raises at `step_nr` on `rank` only: the other ranks are then in DDP's all-reduce."""

    def __init__(self, model, rank, step_nr):
        super().__init__(model)
        self.rank, self.fail_at, self.step_nr = rank, step_nr, 0

    def set_step_nr(self, step_nr):
        self.step_nr = step_nr

    def __call__(self, batch, metrics):
        if self.step_nr == self.fail_at and self.rank == 1:
            raise ValueError("a corrupt sample on rank 1")
        return super().__call__(batch, metrics)


def _unit_fails_on_rank_1():
    import time

    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)
    unit = FailsOnRank(model, gangs.root.rank, 3)
    trainer = Trainer(unit, batches(10, seed=5 + gangs.dp.rank),
                      torch.optim.AdamW(model.parameters()),
                      output_dir=os.environ["FAILURE_TEST_DIR"], gangs=gangs, recorders=[],
                      max_num_steps=8)
    started = time.monotonic()
    try:
        trainer.run()
    except Exception as error:  # noqa: BLE001 (the test looks at what every rank raised)
        return type(error).__name__, str(error), time.monotonic() - started
    return None


def test_a_unit_error_on_one_rank_reaches_every_rank_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FAILURE_TEST_DIR", str(tmp_path))
    (name0, message0, seconds0), (name1, message1, seconds1) = run_ranks(
        _unit_fails_on_rank_1, world_size=2)
    assert (name1, message1) == ("ValueError", "a corrupt sample on rank 1")
    assert name0 == "RankFailure"
    assert message0 == ("rank 1 failed at step 3: ValueError: a corrupt sample on rank 1 "
                        "(rank 0 stopped with it)")
    assert max(seconds0, seconds1) < 10  # not the process-group timeout (30 s here)


# -- 7. early stop is not final when the stopper goes --------------------------------------

def test_an_early_stopped_run_continues_without_its_stopper(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gangtrain")
    first, _ = scored_trainer(tmp_path, early_stopper=patience(1))
    assert first.run().stop_reason == "early_stop"  # at 10: 1.5 is worse than 1.0
    again, _ = scored_trainer(tmp_path, early_stopper=patience(1))  # the same command
    result = again.run()
    assert (result.stop_reason, result.num_steps) == ("early_stop", 10)
    assert "early-stopped at step 10: nothing to do" in caplog.text
    freed, _ = scored_trainer(tmp_path, early_stopper=NO_STOPPER)
    result = freed.run()
    assert (result.stop_reason, result.num_steps) == ("max_num_steps", 30)
    assert "no early stopper now: training on" in caplog.text


# -- 8. built-in stoppers follow the trainer's direction -----------------------------------

ACCURACY = [0.496, 0.766, 0.824, 0.85, 0.86, 0.87]


def accuracy_trainer(out, stopper):
    model = make_model()
    calls = []

    class Accuracy(EvalUnit):
        metric_names = ("accuracy",)

        @property
        def model(self):
            return model

        def __call__(self, batch, metrics):
            metrics.update_mean("accuracy", ACCURACY[len(calls)])
            calls.append(1)

    return Trainer(TokenUnit(model), batches(), torch.optim.AdamW(model.parameters()),
                   output_dir=out, recorders=[], valid_units=[Accuracy()],
                   valid_data_readers=[[None]], score_metric="valid/accuracy",
                   lower_better=False, validate_every_n_steps=5, early_stopper=stopper,
                   max_num_steps=30)


def test_builtin_stoppers_follow_the_trainers_direction(tmp_path):
    result = accuracy_trainer(tmp_path / "a", patience(2)).run()
    assert (result.stop_reason, result.num_steps) == ("max_num_steps", 30)
    with pytest.raises(ValueError, match="lower_better=True but the Trainer has "
                                         "lower_better=False"):
        accuracy_trainer(tmp_path / "b", patience(2, lower_better=True))


# -- 9. bad unit returns and bad inputs ----------------------------------------------------

class Returns(TokenUnit):
    def __init__(self, model, make):
        super().__init__(model)
        self.make = make

    def __call__(self, batch, metrics):
        loss, n = super().__call__(batch, metrics)
        return self.make(loss, n)


@pytest.mark.parametrize("make, message", [
    (lambda loss, n: (loss.item(), n), r"step 1: Returns returned a float \(.*\) as its loss"),
    (lambda loss, n: (loss.repeat(2), n),
     r"step 1: Returns returned a tensor of shape \(2,\) as its loss"),
    (lambda loss, n: (loss, float(n)), r"step 1: Returns returned a float \(.*\) as "
                                       "num_targets; expected an int"),
])
def test_bad_unit_returns_name_the_unit(tmp_path, make, message):
    model = make_model()
    trainer = Trainer(Returns(model, make), batches(), torch.optim.AdamW(model.parameters()),
                      output_dir=tmp_path, recorders=[], max_num_steps=3)
    with pytest.raises(TypeError, match=message):
        trainer.run()


def test_bad_inputs_fail_before_training(tmp_path):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="num_accumulate must be a valid integer"):
        Trainer(TokenUnit(model), batches(), opt, output_dir=tmp_path, num_accumulate=2.5)
    with pytest.raises(UserError, match="yielded no batch"):
        Trainer(TokenUnit(model), [], opt, output_dir=tmp_path / "empty", recorders=[]).run()
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(UserError, match=f"output_dir {a_file} is a file"):
        Trainer(TokenUnit(model), batches(), opt, output_dir=a_file)
    with pytest.raises(ValueError, match="dtype='bf16' with amp=False"):
        Trainer(TokenUnit(model), batches(), opt, output_dir=tmp_path, dtype="bf16",
                amp=False)


# -- 10. logged truthfully -----------------------------------------------------------------

def test_keep_last_only_never_calls_a_lesser_checkpoint_best(tmp_path):
    result = scored_trainer(tmp_path / "a", early_stopper=NO_STOPPER,
                            keep_last_n_checkpoints=1)[0].run()
    assert result.best_step == 30  # 0.6: the newest is the best here
    assert result.best_checkpoint == tmp_path / "a" / "checkpoints" / "step_30"

    best_at_25 = {**SCORE_AT, 25: 0.1}
    result = scored_trainer(tmp_path / "b", scores=best_at_25, early_stopper=NO_STOPPER,
                            keep_last_n_checkpoints=1)[0].run()
    assert (result.best_step, result.best_checkpoint) == (25, None)  # deleted by retention
    assert not (tmp_path / "b" / "checkpoints" / "best").exists()
    assert not (tmp_path / "b" / "checkpoints" / "best_model.safetensors").exists()


def test_what_a_user_must_know_reaches_the_console_of_a_plain_script(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from toy import TokenUnit, collate, make_model, make_samples\n"
        "from trainer import Trainer\n"
        "s = make_samples(40, seed=1)\n"
        "data = [collate(s[i:i + 2]) for i in range(0, 40, 2)]\n"
        "model = make_model()\n"
        "Trainer(TokenUnit(model), data, torch.optim.AdamW(model.parameters()),\n"
        f"        output_dir={str(tmp_path / 'out')!r}, recorders=[],\n"
        "        max_num_steps=int(sys.argv[1]), checkpoint_every_n_steps=2).run()\n")
    subprocess.run([sys.executable, str(script), "4"], check=True, capture_output=True)
    second = subprocess.run([sys.executable, str(script), "6"], check=True,
                            capture_output=True, text=True)
    assert "resumed from" in second.stderr and "(step 4)" in second.stderr


def test_fp16_overflow_is_logged_as_an_overflow(tmp_path, caplog):
    class Overflow(TokenUnit):
        step_nr = 0

        def set_step_nr(self, step_nr):
            self.step_nr = step_nr

        def __call__(self, batch, metrics):
            loss, n = super().__call__(batch, metrics)
            return (loss * math.inf if self.step_nr == 2 else loss), n

    model = make_model()
    Trainer(Overflow(model), batches(), torch.optim.AdamW(model.parameters()),
            output_dir=tmp_path, recorders=[], dtype="fp16", max_num_steps=4,
            publish_metrics_every_n_steps=2).run()
    assert "step 2: fp16 gradients overflowed: step skipped, loss scale halved" in caplog.text
    assert "has no targets" not in caplog.text


def test_a_sampler_is_told_each_epoch(tmp_path):
    from torch.utils.data import DistributedSampler

    samples = batches(6)
    sampler = DistributedSampler(samples, num_replicas=1, rank=0, shuffle=True, seed=1)
    seen = []

    class Recording(DistributedSampler):
        def set_epoch(self, epoch):
            seen.append(epoch)
            super().set_epoch(epoch)

    sampler.__class__ = Recording
    reader = StatefulDataLoader(samples, batch_size=None, sampler=sampler)
    model = make_model()
    Trainer(TokenUnit(model), reader, torch.optim.AdamW(model.parameters()),
            output_dir=tmp_path, recorders=[], max_num_data_epochs=3).run()
    assert seen == [0, 1, 2]
