"""Reward modelling (Bradley-Terry) of a local Hugging Face causal LM on pairs of chosen and
rejected answers: a sequence-classification model with one label."""
