"""`ModelSaves`: the model's weights alone, on their own schedule and retention.

A full checkpoint (`CheckpointManager`) holds everything a resume needs, sharded as trained.
A model-only save is for evaluating or serving a step while training goes on (fairseq2's
model checkpoints): `OUTPUT_DIR/models/step_N/model.safetensors`, full tensors under the
model's canonical names (no DDP/FSDP/compile prefixes), loadable with
`model.load_state_dict(safetensors.torch.load_file(path))`; for a transformers model the
directory is also a HF model directory (`config.json`, `generation_config.json`, the
tokenizer files it was loaded from), ready for `from_pretrained`.

Every rank takes part in gathering the full state (FSDP2 shards); rank 0 writes it to a
temporary directory, renames it to `step_N` (a crash leaves no half save under that name)
and deletes all but the newest `keep_last_n`. Its outcome is shared, so every rank returns
or raises alike.

Under pipeline parallelism no rank holds the whole model: each stage's ranks gather their
stages' full tensors (DTensors of TP or FSDP2 made whole by every rank of their mesh), one
rank a stage (the pp gang of rank 0) writes them as its shard of transformers' sharded
layout (`model-0000k-of-0000N.safetensors`, k the pp rank), and rank 0 writes the index
(`model.safetensors.index.json`) that `from_pretrained` reads, so no rank ever holds more
than its own stages.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from gangs import Gangs, on_rank0
from trainer.checkpoint.manifest import fsync_dir
from trainer.checkpoint.model_files import ModelFiles, model_files_for
from trainer.checkpoint.streaming import SHARDS_INDEX, shard_file_name, write_shards_index
from trainer.run_dir import HF_FILES, MODEL_FILE, parse_step_dir, step_dir_name

log = logging.getLogger("gangtrain")

_FORMAT = {"format": "pt"}  # the safetensors metadata transformers reads


class ModelSaves:
    """Model-only saves under `path` (`RunDir.models`), keeping the newest `keep_last_n`
    (None: all)."""

    def __init__(self, path: Path, gangs: Gangs, keep_last_n: int | None = None,
                 model_files: ModelFiles | None = None) -> None:
        self.path = Path(path)
        self.model_files = model_files  # None: the family registered for the model
        self.gangs = gangs
        self.keep_last_n = keep_last_n
        self.last_step: int | None = None  # saved by this run

    def steps(self) -> list[int]:
        """The complete model-only saves on disk, ascending."""
        if not self.path.is_dir():
            return []
        found = (parse_step_dir(p.name) for p in self.path.iterdir()
                 if (p / MODEL_FILE).is_file() or (p / SHARDS_INDEX).is_file())
        return sorted(step for step in found if step is not None)

    def step_dir(self, step_nr: int) -> Path:
        return self.path / step_dir_name(step_nr)

    def save(self, step_nr: int, model: nn.Module) -> Path:
        """Save `model`'s weights as step `step_nr` (collective); returns its directory."""
        files = self.model_files if self.model_files is not None else model_files_for(model)
        is_hf = files.is_for(model)  # a family's own save: its names, its files beside
        tmp = self.path / f".tmp_{step_dir_name(step_nr)}"
        what = f"saving the model of step {step_nr}"
        if self.gangs.pp.size > 1:
            write_weights = self._write_stages(model, tmp, is_hf, what)
        else:
            # Full tensors on the CPU, gathered from every rank's shards (rank 0 keeps them).
            state = get_model_state_dict(
                model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

            def write_weights() -> None:
                _fresh_dir(tmp)
                save_file(_unshared(state, keep_aliases=not is_hf), tmp / MODEL_FILE,
                          metadata=_FORMAT)
        on_rank0(self.gangs.root, lambda: self._write(step_nr, model, tmp, write_weights,
                                                      is_hf), what, OSError)
        self.last_step = step_nr
        return self.step_dir(step_nr)

    def _write_stages(self, model: nn.Module, tmp: Path, is_hf: bool,
                      what: str) -> Callable[[], None]:
        """Pipeline parallelism (see the module docstring): each stage's shard written into
        `tmp`; the index writer rank 0 then runs."""
        gangs = self.gangs
        on_rank0(gangs.root, lambda: _fresh_dir(tmp), what, OSError)
        # Every rank of a stage's mesh enters (FSDP2/TP DTensors made whole); not cpu_offload,
        # which keeps the tensors on global rank 0 alone.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        shards: list[Any] = []
        if all(gang.rank == 0 for gang in (gangs.dp, gangs.cp, gangs.tp)):  # one rank a stage
            written: Any = None
            try:
                name = shard_file_name(gangs.pp.rank + 1, gangs.pp.size)
                tmp.mkdir(parents=True, exist_ok=True)  # made by rank 0 (a shared directory)
                tensors = {key: tensor.detach().cpu() for key, tensor in
                           _unshared(state, keep_aliases=not is_hf).items()}
                save_file(tensors, tmp / name, metadata=_FORMAT)
                written = ({key: name for key in tensors},
                           sum(t.numel() * t.element_size() for t in tensors.values()))
            except Exception as error:  # told to rank 0, which fails the save on every rank
                written = f"pp rank {gangs.pp.rank}: {error}"
            for source in range(gangs.pp.size):  # names and sizes to rank 0
                shard = [written if source == gangs.pp.rank else None]
                gangs.pp.broadcast_objects(shard, source_rank=source)
                shards.append(shard[0])

        def write_index() -> None:
            failed = [shard for shard in shards if isinstance(shard, str)]
            if failed:
                raise OSError("; ".join(failed))
            weight_map = {key: name for names, _ in shards for key, name in names.items()}
            write_shards_index(tmp, weight_map, sum(size for _, size in shards))
        return write_index

    def _write(self, step_nr: int, model: nn.Module, tmp: Path,
               write_weights: Callable[[], None], is_hf: bool) -> None:
        """Rank 0: write, rename, apply retention."""
        write_weights()
        if is_hf:  # config, generation config, tokenizer: beside the weights
            (self.model_files or model_files_for(model)).write(model, tmp)
            for file in (tmp / HF_FILES).iterdir():
                os.replace(file, tmp / file.name)
            (tmp / HF_FILES).rmdir()
        final = self.step_dir(step_nr)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.path)
        if self.keep_last_n is not None:
            for old in self.steps()[:-self.keep_last_n]:
                log.info("retention: deleting model save %s", self.step_dir(old))
                shutil.rmtree(self.step_dir(old), ignore_errors=True)


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _unshared(state: dict[str, Any], keep_aliases: bool) -> dict[str, Any]:
    """safetensors refuses tensors that share memory (tied weights): an alias is cloned
    (`keep_aliases`), or left out (a HF model ties it again when loaded)."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            if keep_aliases:
                out[name] = tensor.clone()
            continue
        seen.add(key)
        out[name] = tensor.contiguous()
    return out
