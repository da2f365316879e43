"""Watching a run: callbacks, recorders (console, JSONL, TensorBoard, W&B), profiler,
system metrics. Imports only errors, run_dir, lifecycle/, checkpoint/, state/, step/ and
gangs."""
