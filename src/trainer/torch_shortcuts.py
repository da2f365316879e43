"""Where gangtrain reaches past the public API of torch (or of a library) for speed, and the one
switch that turns every such shortcut off.

Each shortcut is feature-detected, so that a version without it takes the public path, and
each is kept because it pays (docs/measured.md):

* `step.step_call.StepCall`: the optimizer's own `step` without torch's idle profiler wrapper
  (reads `_optimizer_step_pre_hooks`, `_global_optimizer_*_hooks`, `_is_profiler_enabled`;
  sets `_opt_called`): 69-88 us a step in place, ~8% of a small model's step.
* `step.optimizer_step.OptimizerStep.clear_gradients`: `param.grad = None` without
  `zero_grad`'s profiler range and dynamo guard: ~25-30 us a step at the small size (~3%).
* `step.gradients`: a fused optimizer's `found_inf` / `grad_scale` attributes, the protocol
  `torch.amp.GradScaler` drives (`_step_supports_amp_scaling`): normalisation, clipping and
  a device-decided skip inside the optimizer's kernel: no pass over the gradients and no
  host read a step. The public path scales the gradients with foreach ops and reads a
  device-decided skip on the host.
* `checkpoint.manifest`: stored tensors read straight into their targets by the reader's
  `storage_data` records (DCP's `_StorageInfo`; `gangtrain.io.dcp_records`), and plain
  values set by DCP's `_traverse.set_element`, without a second serialisation round trip.
* `checkpoint.digest`: crc32c by ctypes (`gangtrain.io.crc32c`) on the buffer (the C library of `google_crc32c`):
  no copy of each tensor into `bytes`, and the GIL released while hashing.

`GANGTRAIN_PUBLIC_TORCH_ONLY=1` (read at import) or `public_only()` (tests) takes the public
path everywhere; the suite trains both ways and compares the weights bit for bit. Objects
decide when they are built (a `StepCall`, an `OptimizerStep`), the digest at each call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_enabled = os.environ.get("GANGTRAIN_PUBLIC_TORCH_ONLY", "0") in ("", "0")


def enabled() -> bool:
    """Whether the shortcuts may be taken (each still checks that it applies)."""
    return _enabled


@contextmanager
def public_only() -> Iterator[None]:
    """The public paths only, inside the block (for tests: not thread-safe)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before
