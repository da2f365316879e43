"""`export_pretrained`: a gangtrain checkpoint of a Hugging Face model written back as a HF
directory that `from_pretrained`, vLLM or any HF tool loads.

    step_{N}/model_optim/   DCP, any layout   ─┐
    step_{N}/hf/            config, tokenizer ─┴─>  OUTPUT/config.json, generation_config.json,
                                                      tokenizer files,
                                                      model.safetensors, or
                                                      model-0000k-of-0000n.safetensors
                                                      + model.safetensors.index.json

Offline, in one process, no process group. Tensors are read from DCP and written to
safetensors one at a time (`trainer.checkpoint.streaming`), so host memory stays at about
the largest tensor. The names are the checkpoint's model keys, which are the HF model's
own (`get_state_dict` strips DDP/FSDP/compile prefixes at save time); tied aliases are
written once, under the name `save_pretrained` keeps (GPT-2: `transformer.wte.weight`,
not `lm_head.weight`), and the keys are checked against the model the config describes
before anything is written. The directory appears whole or not at all: it is written
under a temporary name beside `output_dir` and renamed; the copies an interrupted export
left there (killed mid-write) are removed by the next export to the same place.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from gangtrain.layers.lora import is_adapter
from gangtrain.models.hf.adapter_files import ADAPTER_CONFIG, BASE_REFERENCE
from gangtrain.models.hf.adapters import (
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    is_lora_checkpoint,
    merged_tensors,
)
from gangtrain.models.hf.conversion import saved_layout
from gangtrain.models.hf.meta import build_on_meta, tensor_aliases
from gangtrain.models.hf.model_files import HF_FILES
from gangtrain.models.hf.safetensors_files import SINGLE_FILE
from trainer.checkpoint.export import export_best
from trainer.checkpoint.loading import best_step_dir, find_step_dir
from trainer.checkpoint.manifest import fsync_dir
from trainer.checkpoint.streaming import (
    ModelTensors,
    TensorInfo,
    plan_shards,
    shard_file_name,
    write_safetensors,
    write_shards_index,
)
from trainer.errors import UserError
from trainer.run_dir import ADAPTER_DIR, BEST_MODEL

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "export_adapter", "export_best_model", "export_pretrained",
           "remove_interrupted_exports"]

log = logging.getLogger("gangtrain")

DEFAULT_MAX_SHARD_SIZE = 5 * 2**30
"""Bytes per safetensors file above which the weights are split into shards (5 GiB)."""


def export_pretrained(
    checkpoint: Path | str,
    output_dir: Path | str,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the HF model of `checkpoint` to `output_dir` and return `output_dir`.

    checkpoint: a step directory (`.../checkpoints/step_N`), or a checkpoints directory,
        whose best-scored checkpoint is taken, else its newest complete one.
    output_dir: replaced atomically when it exists.
    max_shard_size: bytes per weight file; above it, shards with an index, like
        `save_pretrained`.
    dtype: convert the floating-point weights (e.g. `torch.bfloat16` for half the size of
        float32 master weights) and say so in `config.json`; default: as trained.

    A checkpoint of LoRA adapters gives the merged model: the base read from the files the
    checkpoint references (checked unchanged), each adapted weight `W + alpha/r * B @ A`
    (`gangtrain.models.hf.adapters`).

    A `UserError` when the checkpoint is incomplete, holds no HF config (the model was not
    a transformers model), or its weights do not fit the model its config describes.
    """
    step_dir = find_step_dir(Path(checkpoint), best=True)
    hf_files = step_dir / HF_FILES
    if not (hf_files / "config.json").is_file():
        raise UserError(
            f"checkpoint {step_dir} holds no {HF_FILES}/config.json: it is not the checkpoint "
            "of a transformers model (export other models with "
            "trainer.checkpoint.export_safetensors)"
        )
    if is_lora_checkpoint(step_dir):  # adapters only: merged into the base's weights
        infos, read_model_tensor = merged_tensors(step_dir)
    else:
        tensors = ModelTensors(step_dir)
        infos, source = _hf_tensors(tensors, hf_files)

        def read_model_tensor(name: str) -> torch.Tensor:
            return tensors.load(source[name])

    infos, read = _in_saved_layout(hf_files, infos, read_model_tensor)
    if dtype is not None:
        infos = [TensorInfo(i.name, dtype if i.dtype.is_floating_point else i.dtype, i.shape)
                 for i in infos]
    wanted = {info.name: info.dtype for info in infos}

    def load(name: str) -> torch.Tensor:
        return read(name).to(wanted[name])

    def write(tmp: Path) -> None:
        # Config, generation config, tokenizer files; not a LoRA checkpoint's adapter files:
        # from_pretrained would take the directory for an adapter and load its base.
        shutil.copytree(hf_files, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(ADAPTER_CONFIG, BASE_REFERENCE))
        if dtype is not None:
            _set_config_dtype(tmp / "config.json", dtype)
        _write_weights(tmp, infos, load, max_shard_size)

    return _write_dir(Path(output_dir), write)


def export_adapter(checkpoint: Path | str, output_dir: Path | str) -> Path:
    """Write the LoRA adapters of `checkpoint` (a step directory, or a checkpoints
    directory: its best, else newest) in peft's format to `output_dir`, atomically:
    `adapter_config.json` and `adapter_model.safetensors`, which
    `peft.PeftModel.from_pretrained(base, output_dir)` loads. Returns `output_dir`."""
    step_dir = find_step_dir(Path(checkpoint), best=True)
    if not is_lora_checkpoint(step_dir):
        raise UserError(f"checkpoint {step_dir} holds no LoRA adapters "
                        f"({HF_FILES}/{ADAPTER_CONFIG} is missing)")
    tensors = ModelTensors(step_dir)
    infos = [TensorInfo(PEFT_PREFIX + info.name, info.dtype, info.shape)
             for info in tensors.infos.values() if is_adapter(info.name)]

    def write(tmp: Path) -> None:
        shutil.copyfile(step_dir / HF_FILES / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
        write_safetensors(tmp / ADAPTER_WEIGHTS, infos,
                          lambda name: tensors.load(name.removeprefix(PEFT_PREFIX)))

    return _write_dir(Path(output_dir), write)


def remove_interrupted_exports(output_dir: Path) -> list[Path]:
    """Delete what an interrupted export to `output_dir` left beside it (a whole model's
    copy each: `.NAME.tmp-PID`, `.NAME.old-PID`) when process PID is gone (or is this
    one); an export still running elsewhere on this machine keeps its own. The paths
    removed."""
    removed = []
    for pattern in (f".{output_dir.name}.tmp-*", f".{output_dir.name}.old-*"):
        for path in output_dir.parent.glob(pattern):
            pid = path.name.rpartition("-")[2]
            if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def export_best_model(checkpoint_dir: Path, hf_output_dir: Path) -> Path | None:
    """The end-of-run export of the best checkpoint of `checkpoint_dir`: to the HF directory
    `hf_output_dir` for a HF model, else (or when its weights do not fit its config, with a
    warning) to `checkpoint_dir/best_model.safetensors`; None when no checkpoint has a
    score. A checkpoint of LoRA adapters is also written in peft's format to `adapter/`
    beside `hf_output_dir`, and `hf_output_dir` gets the merged model."""
    best = best_step_dir(checkpoint_dir)
    if best is None:
        return None
    if is_lora_checkpoint(best):
        export_adapter(best, Path(hf_output_dir).with_name(ADAPTER_DIR))
    if (best / HF_FILES / "config.json").is_file():
        try:
            return export_pretrained(best, hf_output_dir)
        except UserError as error:  # e.g. weights added to the model: keep them anyway
            log.warning("the best checkpoint is not exported as a HF directory (%s); "
                        "writing %s instead", error, Path(checkpoint_dir) / BEST_MODEL)
    return export_best(checkpoint_dir)


def _hf_tensors(
    tensors: ModelTensors, hf_files: Path
) -> tuple[list[TensorInfo], dict[str, str]]:
    """The checkpoint's tensors under the HF model's names, one per tied group, and `{that
    name: the checkpoint's name}`; a `UserError` naming the first key that does not fit the
    model."""
    model = build_on_meta(hf_files)  # on meta: only names and shapes
    kept, source, shapes = [], {}, dict(model.state_dict())
    for name, aliases in tensor_aliases(model).items():
        present = [alias for alias in aliases if alias in tensors.infos]
        if not present:
            raise UserError(f"checkpoint {tensors.step_dir} has no model weight {name!r}, "
                            f"which {type(model).__name__} ({hf_files / 'config.json'}) needs")
        info = tensors.infos[present[0]]
        if info.shape != tuple(shapes[name].shape):
            raise UserError(f"checkpoint {tensors.step_dir}: weight {present[0]!r} has shape "
                            f"{info.shape}, {type(model).__name__} expects "
                            f"{tuple(shapes[name].shape)}")
        kept.append(TensorInfo(name, info.dtype, info.shape))
        source[name] = present[0]
    known = {alias for aliases in tensor_aliases(model).values() for alias in aliases}
    unexpected = sorted(set(tensors.infos) - known)
    if unexpected:
        raise UserError(f"checkpoint {tensors.step_dir} has model weight {unexpected[0]!r}, "
                        f"which {type(model).__name__} does not have")
    return kept, source


def _in_saved_layout(hf_files: Path, infos: list[TensorInfo],
                     read: Callable[[str], torch.Tensor]
                     ) -> tuple[list[TensorInfo], Callable[[str], torch.Tensor]]:
    """The model's tensors `infos` (read by `read(model name)`) as `save_pretrained` writes
    them: transformers' saving rules applied (e.g. fused experts split per expert, GPT-NeoX's
    `lm_head` as `embed_out`); the infos and reader of the written tensors."""
    layout = saved_layout(build_on_meta(hf_files), [info.name for info in infos])
    dtypes = {info.name: info.dtype for info in infos}
    written = [TensorInfo(file_name, dtypes[name], shape)
               for file_name, (name, shape) in layout.names.items()]
    return written, lambda file_name: layout.read(file_name, read)


def _write_weights(directory: Path, infos: list[TensorInfo],
                   load: Callable[[str], torch.Tensor], max_shard_size: int) -> None:
    shards = plan_shards(infos, max_shard_size)
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_FILE, shards[0], load)
        return
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = shard_file_name(number, len(shards))
        write_safetensors(directory / name, shard, load)
        weight_map.update(dict.fromkeys((info.name for info in shard), name))
    write_shards_index(directory, weight_map, sum(info.num_bytes for info in infos))


def _set_config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """Record the weights' dtype where `from_pretrained(dtype="auto")` reads it."""
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a new directory beside `target`, then put it at `target`: `target`
    is never half written (an old one is moved aside first, then deleted), and nothing half
    written is left behind when `write` fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_interrupted_exports(target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target
