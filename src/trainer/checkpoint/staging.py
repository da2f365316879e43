"""The host copy of an async save, and when each part of it is made.

A forward may change buffers in place (BatchNorm statistics, an MoE router's counts, DDP's
buffer broadcast); parameters and optimizer state change only in the optimizer's step. So
`HostStaging.stage` copies the buffers and everything that is not a tensor before it
returns, and the parameters and optimizer state on a thread of its own while the next
forward and backward run. The optimizer's next step waits for that copy (a step pre-hook),
so it never changes a tensor that is still being copied: `save()` blocks training only for
the copy of what a forward may change.

The rule for a hand-written loop: between an async `save()` and the optimizer's next step,
change the parameters and optimizer state only through `optimizer.step()` (or call the
manager's `wait()` first). Without an optimizer everything is copied before `save()` returns.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

log = logging.getLogger(__name__)


class HostStaging:
    """Host buffers (pinned on CUDA, cached and reused by the next save: one extra copy of
    the model and optimizer state stays in CPU memory while async saving is on) and the
    thread that fills them, both created on first use."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._stager: DefaultStager | None = None
        self._stream: torch.Stream | None = None
        self._guards: list[RemovableHandle] = []

    def stage(self, state: dict[str, Any], model: nn.Module,
              optimizer: Optimizer | None) -> Future[dict[str, Any]]:
        """A CPU copy of `state` (`model_optim_state(model, optimizer)`; DTensors stay
        DTensors, with CPU local shards), as a future: what a forward may change is copied
        when this returns, the rest by the time the future is done."""
        self.release_guards()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-staging",
                                                initializer=_one_cpu_thread)
        if torch.accelerator.is_available():
            # The copies run on a stream of their own, after what the caller has queued.
            if self._stream is None:
                self._stream = torch.Stream()
            self._stream.wait_stream(torch.accelerator.current_stream())
        now, later = _split(state, _parameter_storages(model) if optimizer is not None else set())
        staged_now = self._executor.submit(self._copy, now).result()
        staged = self._executor.submit(lambda: _merge(staged_now, self._copy(later)))
        if optimizer is not None and not staged.done():
            def wait_for_the_copy(*_: Any) -> None:
                if not staged.done():  # the hook stays until the manager's next call
                    wait([staged])  # a failed copy fails the save, not the training step
            self._guards.append(optimizer.register_step_pre_hook(wait_for_the_copy))
        return staged

    def _copy(self, state: dict[str, Any]) -> dict[str, Any]:
        """The staging thread: a host copy of `state`, done when this returns."""
        try:
            return self._stage_on_stream(state)
        except Exception:
            # torch 2.11's stager fails when reused (KeyError: <class 'type'>); a fresh one
            # works, at the price of new host buffers. Nothing changed the source meanwhile:
            # the optimizer's step waits for this copy.
            log.debug("checkpoint staging failed with a reused stager; retrying", exc_info=True)
            self._get_stager().close()
            self._stager = None
            return self._stage_on_stream(state)

    def _stage_on_stream(self, state: dict[str, Any]) -> dict[str, Any]:
        with self._stream if self._stream is not None else nullcontext():
            return self._get_stager().stage(state)

    def _get_stager(self) -> DefaultStager:
        if self._stager is None:
            options = StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,  # this class's thread is the asynchrony
                use_non_blocking_copy=False,  # done when stage() returns, on our stream
            )
            self._stager = DefaultStager(options)
        return self._stager

    def release_guards(self) -> None:
        """Remove the optimizer pre-hooks of earlier copies (main thread only: a hook cannot
        remove itself while the optimizer iterates its hooks)."""
        for guard in self._guards:
            guard.remove()
        self._guards.clear()

    def close(self) -> None:
        """Wait for a copy in flight, then release the thread and the host buffers."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.release_guards()
        if self._stager is not None:
            self._stager.close()


def _parameter_storages(model: nn.Module) -> set[int]:
    """The addresses of the parameters' (local) storages."""
    locals_ = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return {t.untyped_storage().data_ptr() for t in locals_ if t.numel() > 0}


def _split(state: dict[str, Any], parameters: set[int]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what a forward may change or is not a tensor, the parameters and optimizer
    state): the model's entries by storage, the optimizer's `state` (its tensors change
    only in a step) and `param_groups` (plain values, rewritten by the LR scheduler)."""
    if not parameters:
        return state, {}
    now: dict[str, Any] = {"model": {}}
    later: dict[str, Any] = {"model": {}}
    for name, value in state["model"].items():
        local = value.to_local() if isinstance(value, DTensor) else value
        is_parameter = (isinstance(local, torch.Tensor) and local.numel() > 0
                        and local.untyped_storage().data_ptr() in parameters)
        (later if is_parameter else now)["model"][name] = value
    if "optimizer" in state:
        # Flattened (`STATE_DICT_OPTIONS`): "state.<fqn>.exp_avg", "param_groups.<fqn>.lr".
        optim = state["optimizer"]
        is_state = {key: key == "state" or key.startswith("state.") for key in optim}
        later["optimizer"] = {key: value for key, value in optim.items() if is_state[key]}
        now["optimizer"] = {key: value for key, value in optim.items() if not is_state[key]}
    return now, later


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """`a` and `b` (disjoint leaves) as one nested dict."""
    merged = dict(a)
    for key, value in b.items():
        merged[key] = _merge(merged[key], value) if key in merged else value
    return merged


def _one_cpu_thread() -> None:
    """The staging thread copies with one CPU thread: a parallel copy starts a second OpenMP
    team beside the training thread's, and where the step keeps every core busy the two
    wait on each other (on the 2-core machine the step after a save took 365 ms longer,
    for a copy of 90 ms). The setting is this thread's own. It keeps the default priority:
    the optimizer's next step waits for it."""
    torch.set_num_threads(1)
