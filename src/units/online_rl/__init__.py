"""Online RL as units: GRPO, Dr. GRPO, DAPO and RLOO (`losses`), generation and scoring
inside the unit (`unit`), a generation window's completions on one rank (`window`)."""

from units.online_rl.losses import GRPOLoss, TokenScores, loss_and_targets
from units.online_rl.token_logps import token_logps
from units.online_rl.unit import GRPOUnit, Rollouts

__all__ = ["GRPOLoss", "GRPOUnit", "Rollouts", "TokenScores", "loss_and_targets",
           "token_logps"]
