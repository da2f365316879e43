"""The preference objective's data when the pairs hold images (TRL's VLM preference format,
`gangtrain.data.vision_pairs`) and the model is a vision-language model.

The same split as text pairs (data.valid_files, else data.valid_fraction held out by
data.split_seed), one pair a bin, each pair's longer side planned from the image headers;
an over-long pair is dropped and counted (cutting the prompt would cut an image's tokens).
The processor runs per side when its micro-batch is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gangtrain.data.mixing import hold_out
from gangtrain.data.preference import PairFields
from gangtrain.data.vision_pairs import (
    ImagePairEvalBatches,
    ImagePairReader,
    ImagePairs,
    has_image_pairs,
    plan_image_pairs,
    read_pairs,
)
from gangtrain.models.hf.hf_config import read_hf_config
from gangtrain.models.hf.vision import is_vlm, processor_as_used
from trainer.errors import UserError

if TYPE_CHECKING:
    from gangtrain.posttrain.objectives.preference import PreferenceConfig

__all__ = ["prepare_image_pairs", "uses_image_pairs"]


def _fields(config: PreferenceConfig) -> PairFields:
    d = config.data
    return PairFields(d.prompt_field, d.chosen_field, d.rejected_field)


def uses_image_pairs(config: PreferenceConfig) -> bool:
    """Whether the run's pair files hold images (JSONL records with `images` or image
    parts)."""
    return has_image_pairs([*config.data.files, *config.data.valid_files], _fields(config))


def _read(files: list[str], fields: PairFields) -> list:
    return [pair for f in files for pair in read_pairs(f, fields)]


def prepare_image_pairs(config: PreferenceConfig, tokenizer: Any, dp_rank: int = 0,
                        dp_size: int = 1, train: bool = True
                        ) -> tuple[ImagePairReader | None, ImagePairEvalBatches, list[str]]:
    """`prepare_pairs` for pairs with images (see the module docstring): the fields of
    `PairData` (train reader, valid batches, the summary lines)."""
    d = config.data
    if config.loss.kind == "kto":
        raise UserError("config 'loss.kind' is kto: KTO's unpaired records with images are "
                        "not read yet; use a paired kind (dpo, ipo, simpo, orpo)")
    hf_config = read_hf_config(Path(config.model.path))
    if not is_vlm(hf_config):
        raise UserError(f"config 'data.files' holds images, but {config.model.path} is not a "
                        "vision-language model (no vision_config)")
    if not d.files and (train or not d.valid_files):
        raise UserError("config 'data.files' is empty: list the JSONL files of preference "
                        "pairs, e.g. --set 'data.files=[pairs.jsonl]'")
    processor = processor_as_used(config.model.path, tokenizer)
    family = hf_config.model_type
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    fields = _fields(config)
    pairs = _read(list(d.files), fields) if d.files else []
    if d.valid_files:
        valid_pairs = _read(list(d.valid_files), fields)
        kept, held = np.arange(len(pairs)), np.arange(len(valid_pairs))
    else:
        valid_pairs = pairs
        kept, held = hold_out(len(pairs), d.valid_fraction, d.split_seed)
    sizes: dict[Any, int] = {}  # image size -> tokens its placeholder expands to
    valid_bins = plan_image_pairs(processor, valid_pairs, held, d.seq_len, sizes)
    valid = ImagePairEvalBatches(ImagePairs(valid_pairs, processor, family), valid_bins,
                                 d.valid_batch_size, pad_id, dp_rank, dp_size)
    summary = [f"valid: {len(valid_bins):,} image pairs of {len(held):,}; "
               f"{_dropped(valid_bins)}"]
    reader = None
    if train:
        bins = plan_image_pairs(processor, pairs, kept, d.seq_len, sizes)
        reader = ImagePairReader(ImagePairs(pairs, processor, family), bins, d.batch_size,
                                 pad_id, dp_rank, dp_size, seed=d.shuffle_seed)
        summary.insert(0, f"train: {len(bins):,} image pairs of {len(kept):,}; "
                          f"{_dropped(bins)}")
    return reader, valid, summary


def _dropped(bins: Any) -> str:
    return (f"{bins.num_dropped} dropped as longer than data.seq_len={bins.seq_len} (an "
            "image's tokens are never cut)")
