"""One optimizer step: normalise, unscale, clip, step or skip (without torch's profiler wrapper
while it has nothing to do), and the per-step log.
Imports only errors, lifecycle/, checkpoint/, state/, units and gangs."""
