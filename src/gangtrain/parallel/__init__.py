"""PyTorch's own parallelism applied over the gangs, and the one build plan that orders it.

- `plan`: `build_model`, the order every model is built in (meta -> transforms -> TP/EP ->
  FSDP2/HSDP -> materialise -> DDP) and the rules between the steps;
- `data`, `fsdp`, `blocks`: DDP or FSDP2/HSDP over `gangs.dp`, per repeated block;
- `expert`: expert parameters left out of DDP/FSDP2 and reduced over `gangs.expert_dp`;
- `materialize`: fill a model built on meta, each rank its own slices;
- `tensor`: optimizer groups for models mixing plain tensors and DTensors;
- `gradient_norm`: the global gradient norm (and clipping) over any layout;
- `spec`: `ModelSpec`, what a model family tells the generic layers;
- `pipeline`, `pipeline_stages`: pipeline schedules over `gangs.pp`, stages cut by the spec;
- `context`: Ulysses context parallelism over `gangs.cp`, installed by the spec.

Everything model-specific (TP plans, pipeline stages, attention) lives with the model's
family (`gangtrain.models.gpt.spec`, `models.hf`); nothing here names a family or a model attribute.
Imports `gangs` and `layers` only."""

from gangtrain.parallel.data import data_parallel, is_data_parallel
from gangtrain.parallel.expert import ddp_ignored_names, reduce_expert_gradients
from gangtrain.parallel.fsdp import fully_shard_model
from gangtrain.parallel.plan import build_model, check_hsdp, parallelize
from gangtrain.parallel.tensor import param_groups

__all__ = [
    "build_model",
    "check_hsdp",
    "data_parallel",
    "ddp_ignored_names",
    "fully_shard_model",
    "is_data_parallel",
    "param_groups",
    "parallelize",
    "reduce_expert_gradients",
]
