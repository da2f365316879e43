"""GRPO loss kinds as objects: the registry and the config union (each kind its own defaults,
a bad value a pydantic error naming the field, an unknown key refused), `GRPOLoss(...)` as
before, each kind's need for old log-probs, and the advantages against a float64 hand
computation (group-normalised; RLOO's leave-one-out with the KL in the reward)."""

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from units.online_rl.losses import (
    GRPO_LOSS_KINDS,
    DAPOLoss,
    GRPOKindLoss,
    GRPOLoss,
    GRPOLossSettings,
    RLOOLoss,
)

SETTINGS = TypeAdapter(GRPOLossSettings)


def test_the_union_picks_the_kind_and_each_kind_keeps_its_defaults():
    for kind, cls in GRPO_LOSS_KINDS.items():
        loss = SETTINGS.validate_python({"kind": kind, "beta": 0.04})
        assert type(loss) is cls and loss.kind == kind and loss.beta == 0.04
    assert SETTINGS.validate_python({"kind": "rloo"}).scale_rewards == "none"
    assert SETTINGS.validate_python({"kind": "grpo"}).scale_rewards == "group"


@pytest.mark.parametrize(("entry", "field"), [
    ({"kind": "grpo", "beta": -0.1}, "beta"),
    ({"kind": "dapo", "epsilon": 1.0}, "epsilon"),
    ({"kind": "dr_grpo", "num_iterations": 0}, "num_iterations"),
    ({"kind": "rloo", "scale_rewards": "group"}, "scale_rewards"),
    ({"kind": "grpo", "temperature": 1.0}, "temperature"),
    ({"kind": "ppo"}, "kind"),
])
def test_a_bad_setting_is_a_pydantic_error_naming_the_field(entry, field):
    with pytest.raises(ValidationError) as error:
        SETTINGS.validate_python(entry)
    assert field in str(error.value)


def test_the_former_constructor_builds_the_kind_object():
    assert GRPOLoss("dapo", 0.05, 0.2, 0.28) == DAPOLoss(beta=0.05, epsilon_high=0.28,
                                                         max_new_tokens=256)
    assert GRPOLoss(kind="rloo", beta=0.05, scale_rewards="none").needs_sequence_kl()
    with pytest.raises(ValueError, match="loss.kind 'x'"):
        GRPOLoss("x")


def test_old_log_probs_are_needed_when_a_micro_batch_trains_after_an_update():
    assert not GRPOKindLoss().needs_old_logps(False)
    assert GRPOKindLoss().needs_old_logps(True)
    assert GRPOKindLoss(num_iterations=2).needs_old_logps(False)
    assert RLOOLoss(beta=0.1).needs_old_logps(False)  # the KL in the reward is old - ref
    assert not RLOOLoss().needs_old_logps(False)


def test_advantages_equal_the_hand_computation():
    rewards = [1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 1.0, 3.0]
    kl = [0.1, -0.2, 0.3, 0.0, 0.5, 0.1, 0.2, 0.4]
    r, k = torch.tensor(rewards, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64)
    g = 4
    want = []
    for start in (0, 4):
        group = rewards[start:start + g]
        mean = sum(group) / g
        std = (sum((x - mean) ** 2 for x in group) / (g - 1)) ** 0.5
        want += [(x - mean) / (std + 1e-4) for x in group]
    assert GRPOKindLoss().advantages(r, g).tolist() == pytest.approx(want, rel=1e-12)
    beta, want = 0.5, []
    penalised = [x - beta * y for x, y in zip(rewards, kl, strict=True)]
    for start in (0, 4):
        group = penalised[start:start + g]
        want += [x - (sum(group) - x) / (g - 1) for x in group]
    got = RLOOLoss(beta=beta).advantages(r, g, k)
    assert got.tolist() == pytest.approx(want, rel=1e-12)
