"""``loss.sampler_correction`` (TRL's ``vllm_importance_sampling_*``) through the Trainer.

Replayed rollouts whose recorded sampler log-probabilities are pushed away from the trained
forward's (as a vLLM sampler's would be): for each mode, the loss the Trainer logs and the
gradient its optimizer sees at both updates of a window equal a float64 hand computation of
TRL 1.16's formula (rho = exp(old - sampler) per token or summed per completion, clamped or
masked to [clip_min, clip_max], multiplying the clipped term before the KL term). With the
``hf`` generator, whose log-probabilities are the trained forward's, the ratio is 1 within
float32 and the loss is the uncorrected one.
"""

from __future__ import annotations

import copy
import math

import pytest
import test_grpo_exact as exact
import torch
from grpo_hand import advantages, token_logps
from transformers import AutoModelForCausalLM

from gangtrain.rl.generation import HFGenerator
from gangtrain.rl.rewards import RewardFunction
from gangtrain.rl.rollouts import read_replay
from gangtrain.rl.windows import PromptWindows
from gangtrain.tiny.prompts import low_tokens
from trainer import Trainer
from trainer.observe.recorders import read_jsonl
from units.online_rl import GRPOLoss, GRPOUnit, Rollouts

G, MAX_NEW, TEMPERATURE = exact.G, exact.MAX_NEW, exact.TEMPERATURE
CLIP_MIN, CLIP_MAX = 0.7, 1.4  # tight, so that both bounds act on the perturbed ratios
CASES = {
    "token_truncate": "grpo",
    "token_mask": "dapo",
    "sequence_truncate": "dr_grpo",
    "sequence_mask": "grpo",
}


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """The replayed window with sampler log-probs = the start model's + noise."""
    base = tmp_path_factory.mktemp("sampler_correction")
    model_dir, prompts, stop = exact.replay_inputs(base)
    model = AutoModelForCausalLM.from_pretrained(model_dir).double()
    generator = torch.Generator().manual_seed(3)
    records = []
    for c, (length, reward) in enumerate(zip(exact.LENGTHS, exact.REWARDS, strict=True)):
        ids = torch.randint(3, 300, (length,), generator=generator).tolist()
        truncated = length == MAX_NEW
        if not truncated:
            ids[-1] = stop
        prompt = list(prompts[c // G].ids)
        with torch.no_grad():
            true = token_logps(model, prompt, ids, TEMPERATURE)
        # small on half the completions (their ratios stay inside), large on the others
        scale = 0.02 if c % 2 else 0.4
        noise = scale * torch.randn(length, generator=generator, dtype=torch.float64)
        records.append({"window": 0, "prompt_index": c // G, "sample_index": c % G,
                        "prompt_ids": prompt, "completion_ids": ids, "truncated": truncated,
                        "rewards": {"r": reward}, "logprobs": (true + noise).tolist()})
    exact.write_replay(base, records)
    return model_dir, prompts, records, base


def hand_rho(old, sampler, mode):
    """TRL 1.16's `vllm_importance_sampling_ratio` of one completion, float64."""
    diff = old - sampler
    rho = torch.exp(diff.sum() if mode.startswith("sequence") else diff) * torch.ones_like(old)
    if mode.endswith("truncate"):
        return rho.clamp(CLIP_MIN, CLIP_MAX)
    return rho.masked_fill((rho < CLIP_MIN) | (rho > CLIP_MAX), 0.0)


def hand_loss(model, reference, old_model, start, records, adv, kind, mode, beta):
    total = torch.zeros((), dtype=torch.float64)
    tokens = 0
    for r, a in zip(records, adv, strict=True):
        prompt, completion = r["prompt_ids"], r["completion_ids"]
        logp = token_logps(model, prompt, completion, TEMPERATURE)
        old = logp.detach() if old_model is None else \
            token_logps(old_model, prompt, completion, TEMPERATURE).detach()
        with torch.no_grad():  # the old policy when the window opened: the start's
            opened = token_logps(start, prompt, completion, TEMPERATURE)
        rho = hand_rho(opened, torch.tensor(r["logprobs"], dtype=torch.float64), mode)
        ratio = torch.exp(logp - old)
        per_token = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a) * rho
        ref = token_logps(reference, prompt, completion, TEMPERATURE).detach()
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        total = total + {"grpo": per_token.mean(), "dr_grpo": per_token.sum() / MAX_NEW,
                         "dapo": per_token.sum()}[kind]
        tokens += len(completion)
    return total / (tokens if kind == "dapo" else len(records))


@pytest.mark.parametrize("mode", sorted(CASES))
def test_loss_and_gradient_equal_trls_formula(perturbed, mode, tmp_path):
    _, _, records, _ = perturbed
    kind, beta = CASES[mode], 0.05
    case = {"kind": kind, "beta": beta, "sampler_correction": {
        "mode": mode, "clip_min": CLIP_MIN, "clip_max": CLIP_MAX}}
    if kind == "dr_grpo":
        case["scale_rewards"] = "none"
    start, reference, grads, logged = exact.run_trainer(perturbed, case, tmp_path)
    model0, ref64 = copy.deepcopy(start).double(), copy.deepcopy(reference).double()
    adv = advantages(exact.REWARDS, G, case.get("scale_rewards", "group"), kind)
    rhos = torch.cat([hand_rho(token_logps(model0, r["prompt_ids"], r["completion_ids"],
                                           TEMPERATURE).detach(),
                               torch.tensor(r["logprobs"], dtype=torch.float64), mode)
                      for r in records])
    # both bounds acted: some ratios clamped or masked, some kept as they are
    inside = (rhos > CLIP_MIN) & (rhos < CLIP_MAX)
    assert inside.any() and not inside.all()
    exact.assert_both_steps_match(start, grads, logged, lambda model, old: hand_loss(
        model, ref64, old, model0, records, adv, kind, mode, beta))
    metrics = logged[1]
    assert CLIP_MIN <= metrics["sampling/importance_sampling_ratio/max"] <= CLIP_MAX \
        or mode.endswith("mask")
    assert metrics["sampling/sampling_logp_difference/max"] > 0.4


def test_the_hf_generator_needs_no_correction(tmp_path):
    """The hf engine's log-probs are the trained forward's: rho is 1 within float32 and the
    loss equals the run without the correction."""
    from test_generation import setup

    logged = {}
    for name, correction in (("off", None), ("on", {"mode": "token_mask"})):
        model_dir, prompts, model, stop = setup(tmp_path / name)
        generator = HFGenerator(model, stop_ids=stop, pad_id=0, max_new_tokens=8,
                                temperature=TEMPERATURE)
        loss = GRPOLoss(max_new_tokens=8, sampler_correction=correction)
        unit = GRPOUnit(model, loss, prompts,
                        [RewardFunction("low_tokens", "tiny:low_tokens", low_tokens)],
                        Rollouts(generator), num_generations=4, batch_size=8, window=1,
                        temperature=TEMPERATURE)
        Trainer(unit, PromptWindows(16, 2, 1), torch.optim.AdamW(model.parameters(), lr=3e-2),
                output_dir=tmp_path / name / "out", max_num_steps=2, dtype="fp32", seed=0,
                publish_metrics_every_n_steps=1,
                progress=False).run()
        logged[name] = {r["step"]: r for r in read_jsonl(tmp_path / name / "out" / "metrics"
                                                         / "train.jsonl")}
    for step in (1, 2):
        on, off = logged["on"][step], logged["off"][step]
        # the generator's log-probs equal the trained forward's within 1e-5 (test_engine)
        assert on["sampling/sampling_logp_difference/max"] < 1e-5
        for stat in ("min", "mean", "max"):
            assert on[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1, abs=1e-5)
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=1e-7)
        assert "sampling/importance_sampling_ratio/mean" not in off
    assert not math.isnan(logged["on"][2]["loss"])


def test_replayed_rollouts_without_logprobs_are_refused(tmp_path):
    model_dir, prompts, _ = exact.replay_inputs(tmp_path)
    exact.write_replay(tmp_path, [{"window": 0, "prompt_index": c // G, "sample_index": c % G,
                                   "prompt_ids": list(prompts[c // G].ids),
                                   "completion_ids": [5, 6], "truncated": True,
                                   "rewards": {"r": float(c)}} for c in range(8)])
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    unit = GRPOUnit(policy, GRPOLoss(max_new_tokens=MAX_NEW, sampler_correction={}), prompts,
                    [], Rollouts(replay=read_replay(tmp_path / "replay")), num_generations=G,
                    batch_size=4, window=2, num_accumulate=2, temperature=TEMPERATURE)
    from gangs.errors import UserError
    with pytest.raises(UserError, match="loss.sampler_correction needs"):
        Trainer(unit, PromptWindows(2, 2, 4, shuffle=False),
                torch.optim.SGD(policy.parameters(), lr=0.1), output_dir=tmp_path / "out",
                max_num_steps=1, num_accumulate=2, dtype="fp32", progress=False).run()


@pytest.mark.parametrize(("entry", "words"), [
    ({"kind": "grpo", "sampler_correction": {"mode": "token"}}, "mode"),
    ({"kind": "grpo", "sampler_correction": {"clip_min": 3.0}}, r"clip_min \(3.0\) must be less"),
    ({"kind": "dapo", "sampler_correction": {"mode": "token_truncate", "clip_max": None}},
     "needs clip_max or clip_min"),
    ({"kind": "rloo", "scale_rewards": "none", "sampler_correction": {}}, "rloo takes no"),
])
def test_a_bad_correction_is_refused_by_name(entry, words):
    from pydantic import TypeAdapter, ValidationError

    from units.online_rl.losses import GRPOLossSettings
    with pytest.raises(ValidationError, match=words) as error:
        TypeAdapter(GRPOLossSettings).validate_python(entry)
    assert "sampler_correction" in str(error.value)
    assert GRPOLoss().sampler_correction is None  # off by default
