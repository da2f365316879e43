"""State a user adds is checkpointed under its name and restored, in process; what is
refused. (An EMA-of-weights callback SIGKILLed and resumed bit for bit, 1 process and FSDP2
over 2: test_resume.py, on the kill-and-resume runs there.)"""

from __future__ import annotations

import pytest
import torch

# -- in process: what is saved, under which name, and what is refused ---------------------


class Counter:
    """A user's object with state, registered with `Trainer(stateful=...)`."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class CountSteps:
    state_key = "steps_seen"

    def __init__(self, counter):
        self.counter = counter

    def on_step_end(self, trainer):
        self.counter.count += 1

    def state_dict(self):
        return self.counter.state_dict()

    def load_state_dict(self, state):
        self.counter.load_state_dict(state)


def toy_trainer(out, max_num_steps, callbacks=(), stateful=None):
    from toy import TokenUnit, collate, make_model, make_samples

    from trainer.trainer import Trainer

    model = make_model()
    reader = [collate(make_samples(2, seed=i)) for i in range(6)]
    return Trainer(TokenUnit(model), reader, torch.optim.SGD(model.parameters(), lr=0.1),
                   output_dir=out, max_num_steps=max_num_steps, checkpoint_every_n_steps=2,
                   callbacks=callbacks, stateful=stateful, recorders=[])


def test_states_are_saved_by_name_and_restored(tmp_path):
    counter, user = Counter(), Counter()
    user.count = 41
    toy_trainer(tmp_path, 4, [CountSteps(counter)], {"my_counter": user}).run()
    saved = torch.load(tmp_path / "checkpoints" / "step_4" / "rank_0.pt", weights_only=True)
    assert saved["callback.steps_seen"] == {"count": 4} and saved["my_counter"] == {"count": 41}

    counter, user = Counter(), Counter()
    resumed = CountSteps(counter)
    toy_trainer(tmp_path, 6, [resumed], {"my_counter": user}).run()
    assert counter.count == 6 and user.count == 41  # restored, then counted on


def test_two_states_under_one_name_are_refused(tmp_path):
    class EMA:
        def on_step_end(self, trainer):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    with pytest.raises(ValueError, match="'callback.EMA'.*state_key"):
        toy_trainer(tmp_path, 2, [EMA(), EMA()])
    with pytest.raises(ValueError, match=r"stateful\['data'\]: the name is taken"):
        toy_trainer(tmp_path, 2, stateful={"data": Counter()})
