"""`load_pretrained`: a local Hugging Face checkpoint, built on meta, parallelised, then
filled with each rank reading only its own slices of the weight files, by the build plan
every model goes through (`parallel.plan.build_model`):

    config ──> model on the meta device (no memory, no initialisation)
           ──> LoRA adapters, the base frozen (`lora=`)
           ──> experts split over gangs.ep (MoE models, ep > 1)
           ──> tensor parallel over gangs.tp, from the model's own plan (tp > 1)
           ──> FSDP2 / HSDP per block over gangs.dp (data_parallel="fsdp")
           ──> to_empty: this rank's shards allocated, uninitialised
           ──> every parameter: this rank's slice read from the safetensors files,
               through transformers' own conversion rules (`models.hf.conversion`)
           ──> non-persistent buffers (rotary tables) recomputed by the model's own init
           ──> DDP over gangs.dp (data_parallel="ddp": DDP needs real weights to wrap)

A rank holds at most its shards plus one slice being copied (a tensor fused from several,
e.g. one layer's experts, is assembled whole first), plus the mapped pages of the one file
being read (see `gangtrain.models.hf.safetensors_files`). Every rank reads the same bytes
for the same slice, so the layout changes nothing in the values: one process, DDP, FSDP2,
HSDP, DP x TP and EP start from the weights `from_pretrained` gives.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gangs import Gangs
from gangtrain.layers.lora import LoraSettings, apply_lora, init_adapter, is_adapter
from gangtrain.models.hf import vision
from gangtrain.models.hf.conversion import ConvertedFiles
from gangtrain.models.hf.gated_mlp import recompute_gated_activations
from gangtrain.models.hf.meta import build_on_meta, head_of, named_tensors, tensor_aliases
from gangtrain.models.hf.model_files import hf_model_of
from gangtrain.models.hf.safetensors_files import WeightFiles
from gangtrain.models.hf.spec import HFSpec, spec_for
from gangtrain.models.hf.tied_embedding import add_tied_embedding_rows_in_place
from gangtrain.models.hf.trainer_files import HFModelFiles
from gangtrain.parallel import plan
from gangtrain.parallel.materialize import local_slices, materialize, seeded_init
from trainer.errors import UserError

__all__ = ["build_on_meta", "load_pretrained", "tensor_aliases"]

log = logging.getLogger("gangtrain")

# The flag transformers' own initialisers (`transformers.initialization`) check before
# writing a tensor: a tensor that carries it was loaded and is left alone.
_HF_INITIALIZED = "_is_hf_initialized"


def load_pretrained(
    path: Path | str,
    gangs: Gangs,
    *,
    data_parallel: Literal["fsdp", "ddp"] | None = "fsdp",
    dtype: torch.dtype | None = None,
    lora: LoraSettings | None = None,
    seed: int = 0,
    attn_implementation: str | None = None,
    pipeline: plan.Split | None = None,
    spec: HFSpec | None = None,
    freeze: tuple[str, ...] = (),
    head: str | None = None,
    head_config: dict[str, Any] | None = None,
    trainable: tuple[str, ...] = (),
    **kwargs: Any,
) -> Any:
    """The Hugging Face model saved in the local directory `path` (`config.json` and
    `model.safetensors`, or shards with `model.safetensors.index.json`), ready for the
    `Trainer` (see the module docstring for the steps).

    gangs: tensor parallel over `gangs.tp` by the family's plan when `gangs.tp.size > 1`
        (its spec's, `models.hf.spec_for`: the model's own declared plan, e.g. LLaMA, Qwen,
        Mistral; a family file's, e.g. StableLM's; GPT-2 has neither and is refused, as are
        the MoE families' packed expert styles); a MoE model's experts split over `gangs.ep`
        when `gangs.ep.size > 1` (`models.hf.experts`).
    data_parallel: "fsdp" (FSDP2, or HSDP when the gangs have a `dp_shard_size`), "ddp"
        (under TP: FSDP2 without resharding after forward, as DDP cannot wrap DTensors),
        or None (no data-parallel wrapper; the caller wraps).
    dtype: of the parameters (the weights are converted as read); default float32, the
        master-weight dtype for training. Compute in bf16 with `amp`/`param_dtype`.
    kwargs: options of `parallel.data_parallel` (e.g. `activation_checkpointing=True`,
        `param_dtype=torch.bfloat16` for FSDP2; `find_unused_parameters` for DDP).
    lora: LoRA adapters on the frozen base (`layers.lora`): the plan's model transform,
        on meta before TP (which splits them like their layer) and FSDP2; they train in
        float32 whatever `dtype` the base has.
    attn_implementation: transformers' attention kernel ("sdpa", "eager", ...); default
        the model's own choice, as `from_pretrained`.
    seed: of the adapters' initialisation (peft's: `lora_A` Kaiming-uniform, `lora_B`
        zero), drawn per name: the same on every rank and layout.
    pipeline: cut the model into pipeline stages (`parallel.plan.Split`); then the
        `PipelinedModel` of this rank's stages is returned, only they read from the files.
    freeze: parameters kept as loaded (`requires_grad` off, on meta before any wrapper):
        module-name patterns, or a vision-language model's parts ("vision_tower",
        "projector"; `models.hf.vision.freeze`).
    spec: the model's family spec when the caller has it (`gangtrain.posttrain` hands the
        one it looked up); None: looked up here (`spec_for`).
    head, head_config: the model's head (`models.hf.meta.HEADS`; None: the one its
        config.json names) and the config settings it needs (`build_on_meta`). A head
        the files lack (a reward model's `score` built on a causal LM's files) is drawn
        from `seed` per name, normal(0, initializer_range) as transformers initialises
        it: the same on every rank and layout; the files' causal-LM head (`lm_head`) is
        then not read.
    trainable: with `lora`, the modules (by name) that train whole beside the adapters
        (peft's `modules_to_save`: a reward model's new `score` head).

    The files are read as `from_pretrained` reads them: transformers' own load-time
    conversion rules rename and fuse their tensors into the model's (per-expert tensors
    fused into `experts.gate_up_proj`, GPT-NeoX's `embed_out` into `lm_head`;
    `models.hf.conversion`).

    Tied weights stay tied (GPT-2's `lm_head.weight` is `transformer.wte.weight`) when the
    files hold them once or equal; a config that ties them while the files hold both with
    different values is loaded untied with a warning, as `from_pretrained` does (and the
    model's config then says `tie_word_embeddings: false`, so that its checkpoints and
    exports say what the weights are). A key the model needs that the files lack, a key of
    the files that no conversion rule maps to the model, a shape that differs, or a file that cannot be read is a
    `UserError` naming the key and the file.
    """
    if data_parallel not in ("fsdp", "ddp", None):
        raise UserError(f"data_parallel must be 'fsdp', 'ddp' or None, got {data_parallel!r}")
    if data_parallel is None and kwargs and pipeline is None:  # the plan checks a pipeline's
        raise UserError(f"load_pretrained options {sorted(kwargs)} configure data_parallel, "
                        "which is None")
    pretrained = _Pretrained(Path(path), dtype, seed, attn_implementation, head, head_config)
    transforms = [] if lora is None else [partial(_with_adapters, settings=lora, spec=spec,
                                                  trainable=trainable)]
    if freeze:
        transforms.append(partial(_frozen, patterns=list(freeze)))
    model = plan.build_model(pretrained.on_meta, gangs,
                             tensor_parallel=partial(_tensor_parallel, spec=spec),
                             data_parallel=data_parallel, materialize=pretrained.materialize,
                             transforms=transforms, pipeline=pipeline, **kwargs)
    add_tied_embedding_rows_in_place(model)  # where tied and neither wrapped nor sharded
    trained = model if isinstance(model, nn.Module) else model.model
    recompute_gated_activations(trained)
    if hf_model_of(trained) is not None:  # the Trainer's default files for this model
        trained.gangtrain_model_files = HFModelFiles()
    return model


def _frozen(model: nn.Module, patterns: list[str]) -> nn.Module:
    vision.freeze(model, patterns)
    return model


def _with_adapters(model: nn.Module, settings: LoraSettings, spec: HFSpec | None,
                   trainable: tuple[str, ...] = ()) -> nn.Module:
    if settings.target_modules is None and vision.is_vlm(model):
        # The language model's projections only: a vision tower has q_proj/v_proj too.
        settings = replace(settings, target_modules=vision.lora_targets(model))
    elif settings.target_modules is None:  # the family's own targets
        settings = replace(settings, target_modules=(spec or spec_for(model)).lora_targets)
    try:
        model = apply_lora(model, settings)
    except ValueError as error:  # a target the model does not have, or not a linear layer
        raise UserError(str(error)) from None
    for name, param in model.named_parameters():
        if name.split(".")[0] in trainable:
            param.requires_grad_(True)
    return model


class _Pretrained:
    """The two ends of the build plan that read the directory: the model on meta, checked
    against the weight files, and later this rank's slices of those files."""

    def __init__(self, path: Path, dtype: torch.dtype | None, seed: int,
                 attn_implementation: str | None, head: str | None = None,
                 head_config: dict[str, Any] | None = None) -> None:
        self.path, self.dtype, self.seed = path, dtype, seed
        self.attn_implementation = attn_implementation
        self.head, self.head_config = head, head_config
        self.files: ConvertedFiles | None = None
        self.targets: dict[str, list[str]] = {}

    def on_meta(self) -> nn.Module:
        model = build_on_meta(self.path, self.dtype,
                              attn_implementation=self.attn_implementation,
                              head=self.head, head_config=self.head_config)
        weight_files = WeightFiles(self.path)
        self.files = ConvertedFiles(model, weight_files)
        self.targets = tensor_aliases(model)
        if _saved_apart(self.targets, self.files):
            model = _untied(self.path, self.dtype, self.files, self.attn_implementation)
            self.files = ConvertedFiles(model, weight_files)
            self.targets = tensor_aliases(model)
        self.new_head = _new_head(head_of(model.config), self.targets, self.files)
        _check_keys_and_shapes(model, self.targets, self.files, self.new_head)
        return model

    def materialize(self, model: nn.Module, device: torch.device) -> None:
        assert self.files is not None, "on_meta first"
        # to_empty keeps each tied Parameter one object
        _fill(model, self.targets, self.files, device, self.seed, self.new_head)


def _tensor_parallel(model: nn.Module, gangs: Gangs, spec: HFSpec | None) -> None:
    """The family's TP step (its spec's: the experts over `gangs.ep`, its TP plan over
    `gangs.tp`)."""
    (spec or spec_for(model)).tensor_parallel(model, gangs)


def _file_key(names: list[str], files: ConvertedFiles) -> str | None:
    """The name under which the files hold a tensor known by `names` (tied aliases)."""
    return next((name for name in names if name in files.names), None)


def _saved_apart(targets: dict[str, list[str]], files: ConvertedFiles) -> list[list[str]]:
    """The tied names (one list per tensor) that the files hold more than once, with values
    that differ: the config ties what the files keep apart."""
    apart = []
    for names in targets.values():
        present = [name for name in names if name in files.names]
        if any(not files.equal(present[0], other) for other in present[1:]):
            apart.append(present)
    return apart


def _untied(path: Path, dtype: torch.dtype | None, files: ConvertedFiles,
            attn_implementation: str | None) -> nn.Module:
    """The model built untied, as `from_pretrained` loads a tied config whose files hold the
    tied weights apart with different values (it warns and does not tie them: training a tied
    model would be training another model than the one saved)."""
    model = build_on_meta(path, dtype, untie_word_embeddings=True,
                          attn_implementation=attn_implementation)
    still = _saved_apart(tensor_aliases(model), ConvertedFiles(model, files.files))
    if still:  # tied by the model's code, not by tie_word_embeddings: nothing to follow
        raise UserError(f"{files.source} holds {' and '.join(map(repr, still[0]))} with "
                        f"different values, which {type(model).__name__} ties into one weight")
    log.warning("%s ties the output embedding to the input embedding (tie_word_embeddings), "
                "but %s holds both with different values: loading them untied, as "
                "from_pretrained does; set \"tie_word_embeddings\": false in config.json to "
                "silence this", path / "config.json", files.source)
    return model


def _new_head(head: str, targets: dict[str, list[str]], files: ConvertedFiles) -> set[str]:
    """The tensors of a head other than the causal LM's that the files lack (drawn from the
    seed), after leaving out of `files.unexpected` the causal LM's head they hold instead."""
    if head != "sequence_classification":  # every other head is in the files
        return set()
    files.unexpected = [k for k in files.unexpected if not k.startswith(_CAUSAL_LM_HEAD)]
    return {name for name, names in targets.items()
            if name.startswith(_NEW_HEADS) and _file_key(names, files) is None}


_CAUSAL_LM_HEAD = ("lm_head.",)
_NEW_HEADS = ("score.",)  # transformers' *ForSequenceClassification head, every family


def _init_new_head(model: nn.Module) -> Any:
    std = getattr(model.config.get_text_config(), "initializer_range", None) or 0.02

    def init(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        if name.endswith("bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, std, generator=generator)

    return init


def _check_keys_and_shapes(
    model: nn.Module, targets: dict[str, list[str]], files: ConvertedFiles,
    new_head: set[str] = frozenset(),  # type: ignore[assignment]
) -> None:
    """One `UserError` naming the first missing key, unexpected key or shape mismatch, before
    anything is allocated."""
    tensors = dict(named_tensors(model))
    where = files.source
    for name, names in targets.items():
        key = _file_key(names, files)
        if key is None and name in new_head:
            continue
        if key is None:
            raise UserError(f"{where} has no weight {name!r}, which "
                            f"{type(model).__name__} needs")
        expected, saved = tuple(tensors[name].shape), files.shape(key)
        if saved != expected:
            raise UserError(f"{files.where(key)}: {files.describe(key)} has shape {saved}, "
                            f"{type(model).__name__} expects {expected}")
    unexpected = files.unexpected  # file keys that no rule of transformers maps to the model
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UserError(f"{files.files.where(unexpected[0])} holds weight {unexpected[0]!r}"
                        f"{more}, which {type(model).__name__} does not have")


def _fill(model: nn.Module, targets: dict[str, list[str]], files: ConvertedFiles,
          device: torch.device, seed: int,
          new_head: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Allocate this rank's storage and copy its slice of every tensor from the files
    (`parallel.materialize(sliced=True)`, which keeps tied weights tied), adapters from
    their seeded initialisation; then let the model's own initialisation compute what the
    files do not hold."""
    keys = {name: _file_key(names, files) for name, names in targets.items()}
    non_persistent = {name for name, _ in model.named_buffers()} - set(model.state_dict())
    adapter_init = seeded_init(seed, init_adapter)
    head_init = (seeded_init(seed, _init_new_head(hf_model_of(model) or model))
                 if new_head else None)

    def source(name: str, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of `like`, read from the files: a DTensor's slice (the whole
        tensor only when `like` is not sharded)."""
        part = local_slices(like)
        key = keys.get(name)
        if key is None and is_adapter(name):
            return adapter_init(name, like)[part]
        if key is None and name in new_head:
            assert head_init is not None
            return head_init(name, like)[part]
        if key is None:
            if name not in non_persistent:
                raise RuntimeError(f"{name!r} of the parallelised model is not in its files")
            # Recomputed below.
            return torch.zeros(tuple(s.stop - s.start for s in part), dtype=like.dtype)
        return files.read(key, part if isinstance(like, DTensor) else None)

    try:
        materialize(model, device, source, sliced=True)
    finally:
        files.close()
    # Non-persistent buffers (e.g. LLaMA's rotary `inv_freq`) are no checkpoint's business:
    # transformers recomputes them in `initialize_weights`, which skips the tensors that
    # carry its "initialised" flag, i.e. every tensor just read.
    tensors = dict(named_tensors(model))
    for name in [*targets, *(name for name in tensors if is_adapter(name))]:
        if name in tensors:  # a pipeline stage holds some of the model's tensors
            setattr(tensors[name], _HF_INITIALIZED, True)
    initialize = getattr(model, "initialize_weights", None)
    if callable(initialize):
        initialize()
