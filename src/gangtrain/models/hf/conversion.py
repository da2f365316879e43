"""transformers' own load-time conversion of checkpoint names and layouts, both ways.

transformers 5 keeps a model's parameters in its own layout and converts checkpoints as it
loads them, by rules it declares per family (`transformers.conversion_mapping`): renames
(GPT-NeoX's `embed_out` -> `lm_head`, Mixtral's `block_sparse_moe` -> `mlp`) and converters
(per-expert `experts.{e}.gate_proj/up_proj` stacked and fused into `experts.gate_up_proj`).
`save_pretrained` applies the reverse rules, so the files it writes are in the old layout.

- `ConvertedFiles`: a directory's weight files seen under the model's own names, by the rules
  `from_pretrained` applies (`get_model_conversion_mapping`, `rename_source_key`, each
  converter's own operations). A renamed tensor is read by slices as before; a converted one
  is assembled whole from its sources (one fused tensor at a time), then sliced.
- `saved_layout`: the names and shapes `save_pretrained` writes for the model's tensors
  (`revert_weight_conversion`), and the reverse conversion of one tensor at a time, for
  `export_pretrained`.

No rule is re-written here: the rules, their matching and their operations are transformers'.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gangs.errors import UserError

__all__ = ["ConvertedFiles", "SavedLayout", "saved_layout"]


class _Group:
    """The file tensors one converter turns into model tensors (e.g. every expert's
    `gate_proj` and `up_proj` of one layer into that layer's `experts.gate_up_proj`)."""

    def __init__(self, converter: Any, target: str) -> None:
        self.converter, self.target = converter, target
        self.keys: dict[str, list[str]] = {}  # source pattern -> file keys, in order

    def convert(self, model: nn.Module, read: Callable[[str], torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        converter = deepcopy(self.converter)  # it collects tensors: one instance per use
        for pattern, keys in self.keys.items():
            for key in keys:
                converter.add_tensor(self.target, key, pattern, lambda key=key: read(key))
        outputs = converter.convert(self.target, model=model, config=model.config)
        return {name: value[0] if isinstance(value, list) else value
                for name, value in outputs.items()}


class ConvertedFiles:
    """The tensors of `files` under the names of `model` (on meta), converted as
    `from_pretrained` converts them (see the module docstring). `files`: the checkpoint's
    weight files by their own names (`gangtrain.models.hf.safetensors_files.WeightFiles`: `file_of`,
    `shape`, `dtype`, `read`, `equal`, `where`, `close`, `source`).

    `names`: every model tensor name the files give; `unexpected`: the file keys no model
    tensor takes. A file key that two model tensors would take, or a converter whose rule
    fails on the files' shapes, is a `UserError` naming the file."""

    def __init__(self, model: nn.Module, files: Any) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            dot_natural_key,
            rename_source_key,
        )

        self.model, self.files, self.source = model, files, files.source
        rules = get_model_conversion_mapping(model)  # as from_pretrained: legacy renames too
        converters = [rule for rule in rules if isinstance(rule, WeightConverter)]
        renamings = [rule for rule in rules if not isinstance(rule, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        meta = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)

        self._renamed: dict[str, str] = {}  # model name -> file key
        groups: dict[str, _Group] = {}
        self.unexpected: list[str] = []
        for key in sorted(files.file_of, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if name not in meta and key in meta:  # a rule that does not apply to this model
                name, pattern = key, None
            if name not in meta:
                self.unexpected.append(key)
            elif pattern is None:
                if name in self._renamed:
                    raise UserError(f"{files.where(key)}: weights {self._renamed[name]!r} and "
                                    f"{key!r} are both {type(model).__name__}'s {name!r}")
                self._renamed[name] = key
            else:
                group = groups.setdefault(name, _Group(by_pattern[pattern], name))
                group.keys.setdefault(pattern, []).append(key)

        # Each group's outputs and their shapes, from its own operations run on meta.
        self._group_of: dict[str, _Group] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for group in groups.values():
            try:
                outputs = group.convert(model, self._meta_tensor)
            except Exception as error:  # transformers' own message names the operation
                first = next(iter(group.keys.values()))[0]
                counts = ", ".join(f"{len(keys)} like {keys[0]!r}"
                                   for keys in group.keys.values())
                raise UserError(f"{files.where(first)}: the weights converted into "
                                f"{group.target!r} ({counts}) do not fit transformers' rule "
                                f"for them: {error}") from None
            for name, tensor in outputs.items():
                self._group_of[name] = group
                self._shapes[name] = tuple(tensor.shape)
        self.names = set(self._renamed) | set(self._group_of)
        self._assembled: tuple[_Group, dict[str, torch.Tensor]] | None = None

    def _meta_tensor(self, key: str) -> torch.Tensor:
        return torch.empty(self.files.shape(key), dtype=self.files.dtype(key), device="meta")

    def file_key(self, name: str) -> str:
        """The file key of model tensor `name` (the first source of a converted one)."""
        if name in self._renamed:
            return self._renamed[name]
        return next(iter(self._group_of[name].keys.values()))[0]

    def describe(self, name: str) -> str:
        """What the files hold for model tensor `name`, for a message."""
        if name in self._renamed:
            return f"weight {self._renamed[name]!r}"
        keys = [key for keys in self._group_of[name].keys.values() for key in keys]
        return f"{name!r}, converted from {len(keys)} weights like {keys[0]!r},"

    def where(self, name: str) -> Path:
        return self.files.where(self.file_key(name))

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._renamed:
            return tuple(self.files.shape(self._renamed[name]))
        return self._shapes[name]

    def equal(self, first: str, second: str) -> bool:
        """Whether model tensors `first` and `second` hold the same values in the files
        (converted tensors are never tied)."""
        if first in self._renamed and second in self._renamed:
            return self.files.equal(self._renamed[first], self._renamed[second])
        return False

    def read(self, name: str, slices: Sequence[slice] | None = None) -> torch.Tensor:
        """Model tensor `name`, or its part `slices`. A converted tensor is assembled whole
        from its sources once (kept until the group's next output is read)."""
        if name in self._renamed:
            return self.files.read(self._renamed[name], slices)
        group = self._group_of[name]
        if self._assembled is None or self._assembled[0] is not group:
            with torch.device("cpu"):
                self._assembled = (group, group.convert(self.model, self.files.read))
        whole = self._assembled[1][name]
        return whole[tuple(slices)] if slices else whole

    def close(self) -> None:
        self._assembled = None
        self.files.close()


class SavedLayout:
    """The files `save_pretrained` writes for a model's tensors: `names` {file name: (model
    name, shape)} in writing order, and `read(file name, load)`: that tensor, reverse
    converted from `load(model name)`, the model tensor's value."""

    def __init__(self, model: nn.Module, outputs: dict[str, dict[str, tuple[int, ...]]]
                 ) -> None:
        self.model = model
        self.names = {file_name: (name, shape) for name, files in outputs.items()
                      for file_name, shape in files.items()}
        self._reverted: tuple[str, dict[str, torch.Tensor]] | None = None

    def read(self, file_name: str, load: Callable[[str], torch.Tensor]) -> torch.Tensor:
        from transformers.core_model_loading import revert_weight_conversion

        name, _ = self.names[file_name]
        if self._reverted is None or self._reverted[0] != name:
            self._reverted = (name, revert_weight_conversion(self.model, {name: load(name)}))
        return self._reverted[1][file_name].contiguous()


def saved_layout(model: nn.Module, names: Sequence[str]) -> SavedLayout:
    """The layout `save_pretrained` gives the tensors `names` of `model` (on meta), one model
    tensor at a time; a `UserError` when a reverse rule needs several model tensors at once
    (the export would not be what `save_pretrained` writes)."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    outputs = {name: {file_name: tuple(tensor.shape) for file_name, tensor in
                      revert_weight_conversion(model, {name: state[name]}).items()}
               for name in names}
    together = revert_weight_conversion(model, {name: state[name] for name in names})
    separately = {file_name for files in outputs.values() for file_name in files}
    if set(together) != separately:
        raise UserError(f"{type(model).__name__}: transformers' saving rules combine several "
                        "of its tensors into one file tensor, which export_pretrained does not "
                        "write; save it with save_pretrained from a loaded model instead")
    return SavedLayout(model, outputs)
