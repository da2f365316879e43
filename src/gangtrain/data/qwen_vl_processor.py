"""Qwen2-VL and Qwen2.5-VL's processor without torchvision.

transformers' `Qwen2VLProcessor` / `Qwen2_5_VLProcessor` hold a video processor, whose classes
need torchvision: `ProcessorMixin.__init__` checks the class of every sub-processor its
`__init__` names (a `None` one too), and without torchvision `VideoProcessorMixin` is not
exported, so the processor cannot be built, nor loaded by `AutoProcessor` (it loads the video
processor with `AutoVideoProcessor`). `image_only_processor` builds the family's processor
class without it: a subclass whose `__init__` names only the image processor and the
tokenizer, so `ProcessorMixin` neither checks nor loads a video processor; images go through
the family's own code (`Qwen2VLImageProcessorPil`, the placeholder expansion,
`mm_token_type_ids`). It saves itself as the family's class, with the image processor's
settings also as the video processor's (what a hub checkpoint's single
preprocessor_config.json gives both), so where torchvision is installed `AutoProcessor` can
load the family's own processor from the same files.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "image_only_processor", "image_only_processor_class"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


@cache
def image_only_processor_class(model_type: str) -> type:
    """The family's processor class without a video processor (see the module docstring)."""
    import transformers

    family = getattr(transformers, _PROCESSORS[model_type])

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None,  # noqa: ANN001, N807
                 **kwargs) -> None:  # noqa: ANN003
        family.__init__(self, image_processor, tokenizer, None, chat_template=chat_template,
                        **kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = family.to_dict(self)
        out["processor_class"] = family.__name__  # AutoProcessor loads the family's own
        video = {k: v for k, v in out.get("image_processor", {}).items()
                 if k != "image_processor_type"}
        out["video_processor"] = {**video, "video_processor_type":
                                  family.__name__.replace("Processor", "VideoProcessor")}
        return out

    return type(f"ImageOnly{family.__name__}", (family,), {
        "__init__": __init__, "to_dict": to_dict, "__module__": __name__})


def image_only_processor(path: str | Path, model_type: str) -> Any:
    """The processor of the Qwen-VL directory `path` (see the module docstring)."""
    return image_only_processor_class(model_type).from_pretrained(str(path))
