"""The GPT family's build: the model parallelised over the gangs by the build plan every model
goes through (`parallel.plan.build_model`), whole or cut into pipeline stages, with the same
initial bits on every layout. Any recipe may build it."""

from __future__ import annotations

import torch

from gangs import Gangs
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.spec import GPT_SPEC
from gangtrain.parallel import plan
from gangtrain.parallel.materialize import materialize, seeded_init
from gangtrain.parallel.pipeline import PipelinedModel, pipeline_model
from units.pipeline import summed_lm_loss
from units.router_aux_loss import share_router_statistics

__all__ = ["build_model", "build_pipelined_model"]


def build_model(gpt_config: GPTConfig, gangs: Gangs, data_parallel: str = "ddp",
                seed: int = 0) -> torch.nn.Module:
    """The GPT, parallelised over `gangs` and ready to train, by the build plan every model
    goes through (`parallel.plan.build_model`): built on the meta device, parallelised, then
    materialised with each parameter drawn whole on the host from a generator seeded by
    (seed, its name) and sliced to this rank's shard (`parallel.materialize`): the same
    initial bits on every layout, and no rank ever holds more than its shards plus one full
    parameter."""

    def init(model: torch.nn.Module, device: torch.device) -> None:
        materialize(model, device, seeded_init(seed, model.init_parameter))

    model = plan.build_model(
        lambda: GPT(gpt_config, ep_gang=gangs.ep if gangs.ep.size > 1 else None), gangs,
        tensor_parallel=GPT_SPEC.tensor_parallel, materialize=init,
        # One DP rank (one process, or TP alone): nothing to wrap.
        data_parallel=data_parallel if gangs.dp.size > 1 else None)
    # The MoE aux loss is the global micro-batch's: its counts summed over the ranks holding
    # other tokens of it (units.router_aux_loss).
    share_router_statistics(model, (gangs.dp, gangs.cp))
    return model


def build_pipelined_model(gpt_config: GPTConfig, gangs: Gangs, seed: int, *,
                          num_microbatches: int, schedule: str,
                          boundaries: list[int] | None = None,
                          data_parallel: str | None = "ddp") -> PipelinedModel:
    """The GPT cut into pipeline stages over `gangs.pp` (tensor parallel inside each stage
    over `gangs.tp`; each stage sharded over DP with data_parallel "fsdp", else replicated),
    this rank's stages materialised by the same seeded rule as `build_model`: the same
    initial bits as one process."""

    def init(model: torch.nn.Module, device: torch.device) -> None:
        materialize(model, device, seeded_init(seed, rule))

    def split(model: torch.nn.Module) -> PipelinedModel:
        return pipeline_model(model, gangs.pp.as_process_group(), spec=GPT_SPEC,
                              loss_fn=summed_lm_loss,
                              num_microbatches=num_microbatches, schedule=schedule,
                              boundaries=boundaries, device=gangs.device)

    with torch.device("meta"):
        whole = GPT(gpt_config)
    rule = whole.init_parameter  # by whole-model name: the stages keep those names
    return plan.build_model(lambda: whole, gangs, materialize=init, pipeline=split,
                            tensor_parallel=GPT_SPEC.tensor_parallel,
                            data_parallel=data_parallel)
