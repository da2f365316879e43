"""Multi-turn trajectories in `GRPOUnit`: rolled out by the agent loop (`gangtrain.rl.agents`)
and scored with the whole conversation, or read back from recorded rollouts. A trajectory is
a `Completion` with its sampled-token mask: the unit scores only the tokens the policy
sampled (`window.slice_tensors`), so tool results and turn markers are neither targets nor
counted, and a trajectory's length is its sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from gangtrain.data.prompts import PromptSet
from gangtrain.rl.agents import AgentLoop
from gangtrain.rl.generation import Completion
from gangtrain.rl.rewards import RewardSource, score
from units.metrics import MetricBag

__all__ = ["replayed_completion", "roll_out"]


def roll_out(agent: AgentLoop, prompts: PromptSet, where: Sequence[tuple[int, int]],
             seeds: Sequence[int], rewards: Sequence[RewardSource], step_nr: int,
             metrics: MetricBag) -> tuple[list[Completion], Tensor]:
    """(this rank's trajectories, their reward values [n, sources]); the tools run here, on
    the rank that owns the trajectory. The rewards see the conversation after the prompt as
    messages (TRL's signature), ``environments=`` one per trajectory where there are any.
    Publishes TRL's tool metrics and the context's length beside the sampled one."""
    chosen = [prompts[p] for p, _ in where]
    rows = [{"prompt": p.prompt, **p.columns} for p in chosen]
    trajectories, environments = agent.rollout(rows, seeds)
    completions = [t.completion() for t in trajectories]
    columns: dict[str, list[Any]] = {
        key: [p.columns.get(key) for p in chosen]
        for key in sorted({k for p in chosen for k in p.columns})}
    if any(e is not None for e in environments):
        columns["environments"] = environments
    values = score(rewards, [p.prompt for p in chosen],
                   [list(c.messages or ()) for c in completions],
                   [c.ids for c in completions], columns, step_nr=step_nr,
                   publish=lambda name, value: metrics.update_mean(name, float(value)))
    n = float(len(trajectories))
    for name, total in (("tools/call_frequency", sum(t.tool_calls for t in trajectories)),
                        ("tools/failure_frequency", sum(t.tool_failures for t in trajectories)),
                        ("turns/mean", sum(t.turns for t in trajectories)),
                        ("completions/mean_context_tokens", sum(len(t.ids) for t in trajectories))):
        metrics.update_total(name, float(total), n)
    return completions, values


def replayed_completion(record: dict[str, Any]) -> Completion:
    """A recorded rollout as the unit trains it (a multi-turn one with its sampled mask and
    the context it was sampled after)."""
    multi_turn = "completion_mask" in record
    return Completion(tuple(record["completion_ids"]), tuple(record.get("logprobs") or ()),
                      bool(record["truncated"]),
                      mask=tuple(record["completion_mask"]) if multi_turn else None,
                      prompt_ids=tuple(record["prompt_ids"]) if multi_turn else None,
                      messages=tuple(record.get("messages") or ()) if multi_turn else None,
                      tool_calls=int(record.get("tool_calls", 0)),
                      tool_failures=int(record.get("tool_failures", 0)))
