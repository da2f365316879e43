"""Preference tuning (DPO, IPO, SimPO, ORPO) of a local Hugging Face causal LM on pairs of
chosen and rejected answers."""
