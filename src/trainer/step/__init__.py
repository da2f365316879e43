"""One training step: forward and backward over its micro-batches (`forward_backward`), then
normalise, unscale, clip, step or skip (without torch's profiler wrapper while it has nothing
to do), and the per-step log.
Imports only errors, torch_shortcuts, lifecycle/, checkpoint/, state/, units and gangs."""
