"""Watching a run: callbacks, recorders (console, JSONL, TensorBoard, W&B), profiler,
system metrics. Imports only errors, lifecycle/, checkpoint/, state/, step/ and gangs."""
