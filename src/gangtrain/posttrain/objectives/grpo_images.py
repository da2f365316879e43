"""The GRPO objective's prompts when they hold images (TRL's VLM prompt-only format,
`gangtrain.data.vision_prompts`) and the model is a vision-language model: the prompts read
with the model's processor, and what does not run with images refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gangtrain.data.prompts import PromptSet
from gangtrain.data.vision_prompts import (
    ImagePromptSet,
    read_image_prompts,
    records_have_images,
)
from gangtrain.models.hf.vision import is_vlm, processor_as_used
from trainer.errors import UserError

if TYPE_CHECKING:
    from gangtrain.posttrain.objectives.grpo import GRPOConfig

__all__ = ["check_image_layout", "read_prompts_with_images", "uses_images"]


def uses_images(config: GRPOConfig) -> bool:
    """Whether the run's prompt files hold images (`image`/`images` or image parts)."""
    d = config.data
    return records_have_images([*d.files, *d.valid_files], d.prompt_field)


def read_prompts_with_images(config: GRPOConfig, tokenizer: Any, hf_config: Any,
                             files: list[str], setting: str, max_prompt_tokens: int
                             ) -> PromptSet:
    if not is_vlm(hf_config):
        raise UserError(f"config '{setting}' holds images, but {config.model.path} is not a "
                        "vision-language model (no vision_config)")
    if config.tools or config.environment is not None:
        raise UserError("config 'tools'/'environment': multi-turn rollouts with images are "
                        "not built yet; leave them out with image prompts")
    processor = processor_as_used(str(Path(config.model.path)), tokenizer)
    return read_image_prompts(files, processor, hf_config.model_type,
                              max_prompt_tokens=max_prompt_tokens,
                              prompt_field=config.data.prompt_field, setting=setting)


def check_image_layout(config: GRPOConfig, prompts: list[PromptSet | None], dp_size: int
                       ) -> None:
    """Under data parallelism refuse FSDP2: the generator's prefill runs the vision tower on
    ranks with new rows only, and FSDP2's all-gathers would not meet. DDP takes prompts
    without images: the policy looks for unused parameters (`vision_ddp`), so a rank whose
    micro-batch skips the tower adds nothing to its gradient, as one process would."""
    image_sets = [some for some in prompts if isinstance(some, ImagePromptSet)]
    if dp_size > 1 and image_sets and config.trainer.data_parallel == "fsdp":
        raise UserError(f"config 'trainer.data_parallel' is fsdp over {dp_size} ranks: GRPO "
                        "with images runs under DDP (trainer.data_parallel=ddp) for now: the "
                        "generator prefills a rank's new rows, with their images, while "
                        "another rank may have none, and FSDP2's all-gathers of the vision "
                        "tower would not meet")
