"""One training step: forward and backward over its micro-batches (`forward_backward`, or a
pipeline schedule, or each cp rank's slice of every sequence: `parallel_axes.build_seam`),
then normalise, unscale, clip, step or skip (without torch's profiler wrapper while it has
nothing to do), and the per-step log.
Imports only `trainer.errors`, `trainer.torch_shortcuts`, `gangtrain.parallel`, units and gangs."""
