"""The JSONL records of preference pairs and GRPO prompts with images (`jsonl_records`), and
the image files a record names (`images`, or one `image`), checked up front for them and for
SFT's image records (`gangtrain.data.vision`): paths relative to the data file, URLs refused
(no network at train time), each file's header readable (`PIL.Image.open` decodes no
pixels); a mistake named by file, line and field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gangs.errors import UserError

__all__ = ["image_files", "image_names", "jsonl_records"]


def image_names(record: dict[str, Any]) -> list[Any]:
    """The record's `images` list, or its one `image` as a list; [] when neither."""
    images = record.get("images")
    if images is None and record.get("image") is not None:
        images = [record["image"]]
    return images if isinstance(images, list) else [] if images is None else [images]


def image_files(names: list[Any], base: Path, where: str) -> list[Path]:
    """The paths of `names` (relative to `base`, the data file's folder), each checked."""
    from PIL import Image

    paths = []
    for i, name in enumerate(names):
        field = f"images[{i}]"
        if not isinstance(name, str):
            raise UserError(f"{where}: field '{field}' is a {type(name).__name__}: give a path "
                            "relative to the data file")
        if "://" in name:
            raise UserError(f"{where}: field '{field}' is a URL ({name}): there is no network "
                            "at train time; download the images and give their paths")
        path = base / name
        try:
            with Image.open(path) as image:  # the header only: no pixels decoded
                image.size  # noqa: B018
        except (OSError, ValueError) as error:
            raise UserError(f"{where}: field '{field}': cannot read image {path}: "
                            f"{error}") from None
        paths.append(path)
    return paths


def jsonl_records(path: Path, what: str) -> Iterator[tuple[dict[str, Any], str]]:
    """(record, "data file F, line N") of each non-blank line of a JSONL file of `what`
    (refused by name when the file is not JSONL, a line is not a JSON object, or there is
    no record)."""
    if path.suffix != ".jsonl":
        raise UserError(f"data file {path}: {what} with images are read from JSONL files")
    seen = False
    with path.open() as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"data file {path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{where}: not JSON: {error}") from None
            if not isinstance(record, dict):
                raise UserError(f"{where}: a record is a JSON object, not a "
                                f"{type(record).__name__}")
            seen = True
            yield record, where
    if not seen:
        raise UserError(f"data file {path} holds no records")
