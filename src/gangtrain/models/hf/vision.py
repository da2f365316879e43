"""A vision-language model's parts known by module name (`vlm_parts`), freezing by pattern
(`model.freeze`), LoRA's default targets on the language model only, the console line of what
trains, and Gemma 3's packed-row masks.

Parts, from transformers' own declarations (no attribute names per family):
- language model: `model.get_decoder()` (transformers 5: the text decoder of every
  *ForConditionalGeneration), found by identity among `named_modules()`;
- vision tower: the top-most module whose `config` is of the type of `model.config.vision_config`
  (transformers builds the tower from that sub-config: LLaVA `model.vision_tower`, Gemma 3
  `model.vision_tower`, Idefics3 `model.vision_model`);
- projector: the other children of the base model (`base_model_prefix`) that hold parameters
  (LLaVA/Gemma 3 `multi_modal_projector`, Idefics3 `connector`); Qwen-VL builds its projector
  inside the tower (`model.visual.merger`, `PROJECTOR_IN_TOWER`: transformers declares it
  nowhere), so there the vision part is the tower's other children;
- head: `get_output_embeddings()`.
Cross-checked with the class's `_tp_plan`/`_pp_plan` (they name the decoder's prefix, e.g.
`model.language_model.` / `model.text_model.`).
"""
from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

from torch import nn

from trainer.errors import UserError

PART_ALIASES = {"vision_tower": "vision", "vision": "vision", "projector": "projector",
                "multi_modal_projector": "projector", "language_model": "language",
                "language": "language", "lm_head": "head", "head": "head"}
LORA_LAYER_NAMES = ("q_proj", "v_proj")  # gangtrain's HF_LORA_TARGETS
PROJECTOR_IN_TOWER = {"qwen2_vl": "merger", "qwen2_5_vl": "merger"}
"""Families whose projector is a child of the vision tower: its name there."""


def is_vlm(config: Any) -> bool:
    """Whether a transformers config (or model) is a vision-language model's: it declares a
    vision tower's sub-config."""
    config = getattr(config, "config", config)
    return getattr(config, "vision_config", None) is not None


def load_processor(path: str | Path) -> Any:
    """The processor of the VLM directory `path`: `AutoProcessor`'s, Qwen-VL's built without
    its torchvision video processor (`data.qwen_vl_processor`)."""
    from transformers import AutoProcessor

    from gangtrain.data import qwen_vl_processor
    from gangtrain.models.hf.hf_config import read_hf_config

    model_type = read_hf_config(Path(path)).model_type
    try:
        if model_type in qwen_vl_processor.FAMILIES:  # AutoProcessor needs torchvision there
            return qwen_vl_processor.image_only_processor(path, model_type)
        return AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: a vision-language model needs its processor files "
                        f"(processor_config.json or preprocessor_config.json): {error}") from None


def processor_as_used(path: str, tokenizer: Any) -> Any:
    """The processor of the VLM directory `path` with the run's tokenizer (its chat template
    and end token as the run set them) in place of its own: what reads the data and what
    step_N/hf/ and OUT/hf/ keep, so that `AutoProcessor` (Qwen-VL: `load_processor`) loads
    the run's."""
    processor = load_processor(path)
    processor.tokenizer = tokenizer
    if getattr(tokenizer, "chat_template", None):
        processor.chat_template = tokenizer.chat_template
    return processor


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def vlm_parts(model: nn.Module) -> dict[str, list[str]]:
    """{"vision": [module names], "projector": [...], "language": [...], "head": [...]}."""
    config = model.config
    vision_config = getattr(config, "vision_config", None)
    if vision_config is None:
        raise ValueError(f"{type(model).__name__}: its config has no vision_config: not a VLM")
    language = _name_of(model, model.get_decoder())
    vision = []
    for name, module in model.named_modules():
        if (type(getattr(module, "config", None)) is type(vision_config) and module is not model
                and not any(name.startswith(v + ".") for v in vision)):
            vision.append(name)
    head = model.get_output_embeddings()
    base = getattr(model, model.base_model_prefix)
    base_name = _name_of(model, base)
    taken = {language, *vision}
    projector = [f"{base_name}.{n}" if base_name else n for n, m in base.named_children()
                 if (f"{base_name}.{n}" if base_name else n) not in taken
                 and any(True for _ in m.parameters())]
    inside = PROJECTOR_IN_TOWER.get(config.model_type)
    if inside is not None and len(vision) == 1:
        tower = model.get_submodule(vision[0])
        projector.append(f"{vision[0]}.{inside}")
        vision = [f"{vision[0]}.{n}" for n, m in tower.named_children()
                  if n != inside and any(True for _ in m.parameters())]
    parts = {"vision": vision, "projector": projector, "language": [language],
             "head": [_name_of(model, head)] if head is not None else []}
    if not vision:
        raise ValueError(f"{type(model).__name__}: no module built from its vision_config")
    return parts


def parameters_of(model: nn.Module, prefixes: list[str]) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters()
            if any(n == pre or n.startswith(pre + ".") for pre in prefixes)]


def matching(model: nn.Module, pattern: str, setting: str) -> list[str]:
    """The parameter names a part ("vision_tower", "projector", "language_model", "lm_head")
    or an fnmatch pattern over parameter names ("model.vision_tower.*") names; none is an
    error naming `setting`."""
    parts = vlm_parts(model) if is_vlm(model) else {}
    if pattern in PART_ALIASES and parts:
        matched = [n for n, _ in parameters_of(model, parts[PART_ALIASES[pattern]])]
    else:
        matched = [n for n, _ in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
    if not matched:
        raise UserError(f"config '{setting}': {pattern!r} matches no parameter of "
                        f"{type(model).__name__} (parts: {parts})")
    return matched


def freeze(model: nn.Module, patterns: list[str]) -> list[str]:
    """`model.freeze`: the parameters each pattern names (`matching`) kept as loaded;
    returns their names."""
    frozen = [n for pattern in patterns for n in matching(model, pattern, "model.freeze")]
    named = dict(model.named_parameters())
    for n in frozen:
        named[n].requires_grad_(False)
    return frozen


def lr_groups(model: nn.Module, part_lr: dict[str, float]) -> list[dict[str, Any]]:
    """`optimizer.part_lr` (VeOmni's `vit_lr`): optimizer groups of the trained parameters,
    those each pattern names (`matching`; the first pattern wins) at its learning rate, the
    rest at the optimizer's."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    taken: set[str] = set()
    groups = []
    for pattern, lr in part_lr.items():
        names = [n for n in matching(model, pattern, "optimizer.part_lr")
                 if n in named and n not in taken]
        taken.update(names)
        if names:
            groups.append({"params": [named[n] for n in names], "lr": lr})
    rest = [p for n, p in named.items() if n not in taken]
    return ([{"params": rest}] if rest else []) + groups


def lora_targets(model: nn.Module, layer_names: tuple[str, ...] = LORA_LAYER_NAMES) -> tuple[str, ...]:
    """LoRA's default targets for a VLM: the fully-qualified names of the language model's
    `q_proj`/`v_proj` (gangtrain's `apply_lora` matches a name exactly or by suffix, so full
    names keep the SigLIP/CLIP towers' own `q_proj`/`v_proj` unadapted)."""
    (language,) = vlm_parts(model)["language"]
    return tuple(n for n, m in model.named_modules()
                 if n.startswith(language + ".") and isinstance(m, nn.Linear)
                 and n.rsplit(".", 1)[-1] in layer_names)


def trained_summary(model: nn.Module) -> str:
    """The console line: trained / frozen parameters per part."""
    parts = vlm_parts(model)
    out = []
    for part, prefixes in parts.items():
        ps = parameters_of(model, prefixes)
        t = sum(p.numel() for _, p in ps if p.requires_grad)
        f = sum(p.numel() for _, p in ps if not p.requires_grad)
        out.append(f"{part} {t:,} trained / {f:,} frozen")
    return "; ".join(out)


def packed_image_block_masks(position_ids, token_type_ids, sliding_window: int | None, dtype):  # noqa: ANN001, ANN201
    """Additive 4-D masks [b, 1, t, t] for a packed row of a model whose image tokens attend
    both ways within their image (Gemma 3's `token_type_ids`): allowed where query and key are
    in the same document (from position_ids restarting at 0) and (key <= query, or both in the
    same image block); the sliding one also needs query - key < sliding_window."""
    import torch

    b, t = position_ids.shape
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = start.cumsum(-1)
    is_image = token_type_ids == 1
    prev = torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    block = torch.where(is_image, (is_image & ~prev).cumsum(-1), 0)
    q = torch.arange(t)
    causal = q[None, :, None] >= q[None, None, :]
    same_doc = doc[:, :, None] == doc[:, None, :]
    same_block = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)
    allowed = same_doc & (causal | same_block)
    masks = {"full_attention": allowed}
    if sliding_window:
        masks["sliding_attention"] = allowed & ((q[:, None] - q[None, :]) < sliding_window)[None]
    low = torch.finfo(dtype).min
    return {k: torch.zeros(v.shape, dtype=dtype).masked_fill(~v, low)[:, None] for k, v in masks.items()}


def prepare_for_packed_rows(model: nn.Module) -> None:
    """What a family needs to read packed rows of image + text records as transformers
    does one record a row: Gemma 3's masks (`fix_packed_gemma3`), Qwen-VL's M-RoPE positions
    per record (`qwen_vl.use_packed_mrope`)."""
    from gangtrain.data.qwen_vl_processor import FAMILIES as QWEN_VL
    from gangtrain.models.hf import qwen_vl

    if model.config.model_type == "gemma3":
        fix_packed_gemma3(model)
    elif model.config.model_type in QWEN_VL:
        qwen_vl.use_packed_mrope(model)


def fix_packed_gemma3(model: nn.Module) -> None:
    """transformers 5.25's Gemma 3 builds its *sliding* layers' mask wrong for packed rows
    holding images: the blockwise (two-way image) overlay is an `or_mask_function`, applied
    before `remap_positions_for_packed_sequence`, so it is indexed with positions within the
    document instead of the row's (gemma3_packing_probe.py: packed != padded with a sliding
    layer, == with full layers only). Workaround: when a forward gets position_ids that
    restart (packed), token_type_ids and no attention_mask, hand the model the two masks built
    here (it takes a prepared {layer type: mask} mapping, as `generate` does)."""
    base = getattr(model, model.base_model_prefix)
    window = getattr(model.config.get_text_config(), "sliding_window", None)

    def hook(module, args, kwargs):  # noqa: ANN001, ANN202
        pos, tt = kwargs.get("position_ids"), kwargs.get("token_type_ids")
        if pos is None or tt is None or kwargs.get("attention_mask") is not None:
            return None
        if not bool((pos[:, 1:] != pos[:, :-1] + 1).any()):
            return None  # one document a row: transformers' own masks are right
        dtype = next(module.parameters()).dtype
        kwargs["attention_mask"] = packed_image_block_masks(pos, tt, window, dtype)
        return args, kwargs

    base.register_forward_pre_hook(hook, with_kwargs=True)
