"""Tiny "pretrained" models and data made in seconds, with nothing downloaded, for tests,
docs and benchmarks: a chat model and conversations (`chat`), preference pairs (`pairs`),
prompts and reward functions for online RL (`prompts`), a plain causal LM and a text corpus
(`corpus`), tiny vision-language models and a colour task (`vision`)."""
