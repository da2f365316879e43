"""Configs and the command line's loading: `TrainerConfig` for YAML, presets, `--set`,
error messages, import paths of user objects. Imports only
what lies below it: every part of trainer but the command line and the package face."""
