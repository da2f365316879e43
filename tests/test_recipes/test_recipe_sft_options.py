"""The SFT options TRL users reach for, each against an independent reference: the schedule
types against transformers' own `get_scheduler` (through a recipe run's logged learning
rates, whose length follows from epochs x batches, and tokens/s), `data.train_on` against
`apply_chat_template`'s assistant mask, NEFTune's noise (HF's formula, training only) on the
recipe's own model, the optimizer by name, and TRL's names hinted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, get_scheduler

from gangtrain.app.cli import recipe_gangs
from gangtrain.app.config.loading import load_config
from gangtrain.data.sft import tokenize_files
from gangtrain.layers.neftune import neftune_magnitude
from gangtrain.models.hf import hf_model_of
from gangtrain.posttrain.objectives.sft import load_model, load_tokenizer, prepare_data
from gangtrain.tiny.chat import (
    CHATML_TEMPLATE_WITH_GENERATION,
    chat_conversations,
    make_tiny_chat_model,
    write_chat_data,
)
from recipes.sft.config import PRESETS, SFTConfig
from recipes.sft.recipe import check_inputs, cli
from trainer.errors import UserError
from trainer.lr_schedules import SCHEDULE_TYPES, warmup_decay
from trainer.observe.recorders import read_jsonl


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("sft_options") / "model")


# -------------------------------------------------------------------------------------------
# Schedules


def rates(kind: str, warmup: int, total: int, final_scale: float = 0.0) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    section = SFTConfig().lr_scheduler.model_copy(update={
        "type": kind, "warmup_steps": warmup, "final_lr_scale": final_scale})
    schedule = warmup_decay(optimizer, section, total)
    return [schedule.factor(step) for step in range(total + 2)]


def hf_rates(kind: str, warmup: int, total: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    return [schedule.lr_lambdas[0](step) for step in range(total + 2)]


@pytest.mark.parametrize("kind", SCHEDULE_TYPES)
def test_each_schedule_type_has_hugging_faces_shape(kind):
    """After the warm-up, HF's own schedule of the same name (final_lr_scale 0, HF's end);
    during it, HF's rate one step later (ours trains its first step at lr / warmup, HF's at
    0). Float64 arithmetic on both sides: 1e-12."""
    ours, theirs = rates(kind, 5, 30), hf_rates(kind, 5, 30)
    warmup = 0 if kind == "constant" else 5
    assert ours[:warmup] == pytest.approx(theirs[1:warmup + 1], abs=1e-12)
    assert ours[warmup:31] == pytest.approx(theirs[warmup:31], abs=1e-12)
    assert ours[31] == pytest.approx(ours[30])  # past the end: the final rate stays


def test_an_extended_run_keeps_the_first_runs_schedule_warm_up_ratio_included():
    """Resumed with a larger max_num_steps, the schedule keeps the checkpoint's length, and a
    warm-up by ratio is of that length: the steps already taken keep their rates."""
    section = SFTConfig().lr_scheduler.model_copy(update={"type": "linear",
                                                          "warmup_ratio": 0.2})
    first = warmup_decay(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                         section, 20)
    for _ in range(7):
        first.optimizer.step()
        first.step()
    extended = warmup_decay(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                            section, 40)
    extended.load_state_dict(first.state_dict())
    assert (extended.warmup_steps, extended.num_steps) == (4, 20)
    assert [extended.factor(s) for s in range(25)] == [first.factor(s) for s in range(25)]


def test_a_decay_with_no_length_is_refused_by_name():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(UserError, match="trainer.max_num_data_epochs"):
        warmup_decay(optimizer, SFTConfig().lr_scheduler, None)


def test_an_epochs_only_run_decays_over_epochs_times_batches(model_dir, tmp_path):
    """No max_num_steps: the schedule's length is 2 epochs of ceil(batches / num_accumulate)
    steps; warm-up by ratio (HF's ceil). The rates the recipe logs against HF's linear
    schedule of that length, computed here from the reader's own count."""
    chat = write_chat_data(tmp_path / "chat.jsonl", 100)
    out = tmp_path / "out"
    args = [str(out), "--preset", "tiny", "--set", f"model.path={model_dir}",
            "--set", f"data.files=[{chat}]", "--set", f"data.cache_dir={tmp_path / 'c'}",
            "--set", "trainer.max_num_steps=null", "--set", "trainer.max_num_data_epochs=2",
            "--set", "trainer.num_accumulate=2", "--set", "lr_scheduler.type=linear",
            "--set", "lr_scheduler.warmup_ratio=0.2", "--set", "lr_scheduler.final_lr_scale=0",
            "--set", "trainer.publish_metrics_every_n_steps=1",
            "--set", "trainer.validate_every_n_steps=100",
            "--set", "trainer.checkpoint_every_n_steps=100"]
    assert cli(args) == 0
    config = load_config(SFTConfig, PRESETS, preset="tiny", overrides=[
        a for a in args[4:] if a != "--set"])
    batches = len(prepare_data(config, load_tokenizer(config)).train)
    assert batches % 2 == 1  # each epoch's last window is one micro-batch, and a step
    steps = 2 * (batches + 1) // 2
    warmup = math.ceil(0.2 * steps)
    records = read_jsonl(out / "metrics" / "train.jsonl")
    logged = {r["step"]: r["lr"] for r in records}
    # tokens/s beside targets/s: the rows' tokens (4 packed rows of 256 a micro-batch, 2 a
    # step; an epoch's last step has 1), over the same window's time.
    windows = [r["num_tokens"] for r in records]
    assert windows == [2048.0, 2048.0, 2048.0, 1024.0] * 2
    for r in records:
        assert r["tokens_per_s"] == pytest.approx(
            r["targets_per_s"] * r["num_tokens"] / r["num_targets"], rel=1e-12)
    assert sorted(logged) == list(range(1, steps + 1))
    hf = hf_rates("linear", warmup, steps)
    # Logged at step s: the rate step s trained at, after s - 1 scheduler steps (issue 66);
    # HF's one step later in warm-up.
    expected = {s: 3e-3 * (hf[s] if s - 1 < warmup else hf[s - 1]) for s in logged}
    assert logged == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # Decayed to the end: the last step trains at the last rate before 0, which the schedule
    # reaches at the run's length (not the silent constant of old).
    assert logged[steps] > 0.0 and hf[steps] == 0.0


# -------------------------------------------------------------------------------------------
# What the loss trains on


def test_train_on_all_and_completion_against_the_assistant_mask(model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = [c for c in chat_conversations(20, seed=7)
                     if sum(m["role"] == "assistant" for m in c) > 1][:6]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    tables = {train_on: tokenize_files([path], tokenizer, name="tiny", train_on=train_on,
                                       cache_dir=tmp_path / "c").dataset
              for train_on in ("assistant", "completion", "all")}
    for i, messages in enumerate(conversations):
        reference = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            chat_template=CHATML_TEMPLATE_WITH_GENERATION)
        ids, mask = list(reference["input_ids"]), list(reference["assistant_masks"])
        # The last assistant turn: the mask's last run of ones.
        last_start = max(k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1]))
        last_only = [m if k >= last_start else 0 for k, m in enumerate(mask)]
        assert 0 < sum(last_only) < sum(mask)
        for train_on, expected in (("assistant", mask), ("completion", last_only),
                                   ("all", [1] * len(ids))):
            row = tables[train_on][i]
            assert row["input_ids"] == ids, (train_on, i)
            assert row["trained"] == expected, (train_on, i)


def test_train_on_all_trains_the_prompt_of_prompt_completion(model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 plus 3?", "completion": " 5."}) + "\n")
    row = tokenize_files([path], tokenizer, name="tiny", train_on="all",
                         cache_dir=tmp_path / "c").dataset[0]
    prompt = tokenizer("What is 2 plus 3?", add_special_tokens=False)["input_ids"]
    answer = tokenizer(" 5.", add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == prompt + answer + [tokenizer.eos_token_id]
    assert row["trained"] == [1] * len(row["input_ids"])


# -------------------------------------------------------------------------------------------
# NEFTune, dtype, optimizer


def test_neftune_noise_in_training_only(model_dir):
    """On the recipe's own model: in training the input embeddings move by uniform noise
    bounded by alpha / sqrt(length * width) (HF's formula), in evaluation not at all."""
    alpha = 5.0
    gangs, _ = recipe_gangs(60)
    config = SFTConfig.model_validate({"model": {"path": str(model_dir)},
                                       "trainer": {"data_parallel": "ddp"}})
    plain = load_model(config, gangs).model
    noisy = load_model(config.model_copy(update={"model": config.model.model_copy(
        update={"neftune_noise_alpha": alpha})}), gangs).model
    ids = torch.randint(0, 200, (3, 40))
    clean = hf_model_of(plain).get_input_embeddings()(ids)
    captured = []
    target = hf_model_of(noisy)
    target.get_input_embeddings().register_forward_hook(
        lambda module, args, output: captured.append(output.detach()))
    torch.manual_seed(0)
    target.train()
    target(input_ids=ids, use_cache=False)
    noise = captured[-1] - clean.detach()
    bound = neftune_magnitude(alpha, 40, clean.shape[-1])
    # Uniform on [-m, m] over 3*40*width draws: every |x| <= m (float32 rounding of the sum
    # adds ~1e-7 relative to the embedding), max close to m, std m / sqrt(3) within 5%.
    assert noise.abs().max() <= bound * (1 + 1e-5) + 1e-6
    assert noise.abs().max() > 0.95 * bound
    assert noise.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.05)
    target.eval()
    with torch.no_grad():
        target(input_ids=ids, use_cache=False)
    assert torch.equal(captured[-1], clean.detach())


def test_optimizer_by_name_and_its_options(model_dir):
    config = SFTConfig.model_validate({"optimizer": {"name": "SGD", "momentum": 0.9,
                                                     "options": {"nesterov": True}}})
    optimizer = config.optimizer.build(torch.nn.Linear(2, 2))
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (2e-5, 0.9, True)
    with pytest.raises(UserError, match="optimizer.name.*AdamW"):
        SFTConfig.model_validate({"optimizer": {"name": "Adamm"}}).optimizer.build(
            torch.nn.Linear(2, 2))
    with pytest.raises(UserError, match="optimizer.momentum"):
        SFTConfig.model_validate({"optimizer": {"name": "Adam", "momentum": 0.9}}
                                 ).optimizer.build(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(("given", "meant"), [
    ("data.max_length", "data.seq_len"), ("max_seq_length", "data.seq_len"),
    ("data.completion_only_loss", "data.train_on"), ("optim", "optimizer.name"),
    ("lr_scheduler_type", "lr_scheduler.type"), ("optimizer.learning_rate", "optimizer.lr"),
    ("trainer.bf16", "trainer.dtype"), ("model.torch_dtype", "model.dtype"),
])
def test_trls_names_are_hinted(given, meant):
    with pytest.raises(UserError, match=f"did you mean '{meant}'"):
        load_config(SFTConfig, PRESETS, overrides=[f"{given}=1"])


def test_model_dtype_and_attention_kernel_reach_the_model(model_dir):
    gangs, _ = recipe_gangs(60)
    config = SFTConfig.model_validate({
        "model": {"path": str(model_dir), "dtype": "bf16", "attn_implementation": "eager"},
        "data": {"seq_len": 256}, "trainer": {"data_parallel": "ddp"}})
    model = load_model(config, gangs).model
    hf = hf_model_of(model)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    assert hf.config._attn_implementation == "eager"
    with pytest.raises(UserError, match="lora.base_dtype"):
        check_inputs(config.model_copy(update={"lora": config.lora.model_copy(
            update={"r": 4})}))
