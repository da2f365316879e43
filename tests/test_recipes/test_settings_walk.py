"""Every setting a recipe's config accepts is read by a real run, or refused by name.

For each recipe (lm, sft, finetune, preference, classify, grpo) a short run through its own path
(the shell's `gangs.fault_tolerance` hand-over, the recipe's input checks, its `main`:
training, validation, checkpoints, the export) records which settings of the config it read
(`settings_walk.reads_of`). A setting it did not read must be one used only under another
setting (`CONDITIONAL`): given a value of its own without that setting, the recipe's command
line refuses it, exit 2, naming it. A new setting that nothing reads fails here. A new recipe
(recipes.grpo) joins by an entry in CONDITIONAL ({} when it reads everything) and one in
`recipe`."""

from __future__ import annotations

from functools import partial

import pytest
from settings_walk import leaves, reads_of

from gangtrain.app.cli import load_config, run_recipe
from gangtrain.app.replica_groups import join_replica_groups

STEPS = ["trainer.max_num_steps=2", "trainer.validate_every_n_steps=1",
         "trainer.checkpoint_every_n_steps=2", "trainer.publish_metrics_every_n_steps=1"]

# Read only under another setting: (a value of its own, the setting it needs).
CONDITIONAL = {
    "lm": {"gangs.pp_schedule": ("gpipe", "gangs.pp_size"),
           "gangs.pp_boundaries": ("[1]", "gangs.pp_size")},
    "classify": {"trainer.early_stopper.stoppers": ("[{name: non_finite}]", "any_of")},
    "sft": {"data.padding": ("free", "data.packing=false"),
            "lora.alpha": ("16", "lora.r"), "lora.dropout": ("0.1", "lora.r"),
            "lora.target_modules": ("[q_proj]", "lora.r"), "lora.base_dtype": ("bf16", "lora.r")},
    "finetune": {"lora.alpha": ("16", "lora.r"), "lora.dropout": ("0.1", "lora.r"),
                 "lora.target_modules": ("[q_proj]", "lora.r"),
                 "lora.base_dtype": ("bf16", "lora.r")},
    "grpo": {"gangs.pp_schedule": ("gpipe", "gangs.pp_size"),
             "gangs.pp_boundaries": ("[1]", "gangs.pp_size"),
             "generation.max_turns": ("2", "tools"), "generation.tool_timeout": ("5", "tools"),
             "generation.tool_isolation": ("process", "tools"),
             "lora.alpha": ("16", "lora.r"), "lora.dropout": ("0.1", "lora.r"),
             "lora.target_modules": ("[q_proj]", "lora.r"), "lora.base_dtype": ("bf16", "lora.r")},
    "preference": {"gangs.pp_schedule": ("gpipe", "gangs.pp_size"),
                   "gangs.pp_boundaries": ("[1]", "gangs.pp_size"),
                   "data.completion_field": ("answer", "loss.kind"),
                   "data.label_field": ("good", "loss.kind"),
                   "lora.alpha": ("16", "lora.r"), "lora.dropout": ("0.1", "lora.r"),
                   "lora.target_modules": ("[q_proj]", "lora.r"),
                   "lora.base_dtype": ("bf16", "lora.r")},
}


def recipe(name: str, tmp_path):
    """(config type, presets, main, check_inputs or None, cli, the tiny run's overrides)."""
    if name == "lm":  # its command line as recipes/lm/__main__.py runs it
        from recipes.lm.config import PRESETS, RESUME_GUARD, LMConfig
        from recipes.lm.recipe import eval_main, main
        return LMConfig, PRESETS, main, None, partial(
            run_recipe, LMConfig, PRESETS, main, resume_guard=RESUME_GUARD,
            eval_main=eval_main), ["data.max_train_bytes=20000"]
    if name == "classify":
        from recipes.classify.config import PRESETS, ClassifyConfig
        from recipes.classify.recipe import eval_main, main
        return ClassifyConfig, PRESETS, main, None, partial(
            run_recipe, ClassifyConfig, PRESETS, main, eval_main=eval_main), []
    if name == "sft":
        from gangtrain.tiny.chat import make_tiny_chat_model, write_chat_data
        from recipes.sft.config import PRESETS, SFTConfig
        from recipes.sft.recipe import check_inputs, cli, main
        model = make_tiny_chat_model(tmp_path / "model")
        data = write_chat_data(tmp_path / "chat.jsonl", 100)
        return SFTConfig, PRESETS, main, check_inputs, cli, [
            f"model.path={model}", f"data.files=[{data}]", f"data.cache_dir={tmp_path}/cache"]
    if name == "finetune":
        from gangtrain.tiny.corpus import make_tiny_model, write_tiny_corpus
        from recipes.finetune.config import PRESETS, FinetuneConfig
        from recipes.finetune.recipe import check_inputs, cli, main
        model = make_tiny_model(tmp_path / "model")
        files = ",".join(map(str, write_tiny_corpus(tmp_path / "corpus")))
        return FinetuneConfig, PRESETS, main, check_inputs, cli, [
            f"model.path={model}", f"data.files=[{files}]"]
    if name == "grpo":
        from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts
        from recipes.grpo.config import PRESETS, GRPOConfig
        from recipes.grpo.recipe import check_inputs, cli, main
        model = make_tiny_chat_model(tmp_path / "model")
        train = write_prompts(tmp_path / "train.jsonl", 16)
        valid = write_prompts(tmp_path / "valid.jsonl", 4, seed=1)
        return GRPOConfig, PRESETS, main, check_inputs, cli, [
            f"model.path={model}", f"data.files=[{train}]", f"data.valid_files=[{valid}]",
            'rewards=["gangtrain.tiny.prompts:low_tokens"]', "loss.beta=0.04",
            "generation.max_new_tokens=4"]
    from gangtrain.tiny.pairs import make_tiny_chat_model, write_pair_data
    from recipes.preference.config import PRESETS, PreferenceConfig
    from recipes.preference.recipe import cli, main
    model = make_tiny_chat_model(tmp_path / "model")
    data = write_pair_data(tmp_path / "pairs.jsonl", 100)
    return PreferenceConfig, PRESETS, main, None, cli, [
        f"model.path={model}", f"data.files=[{data}]", f"data.cache_dir={tmp_path}/cache"]


@pytest.mark.parametrize("name", sorted(CONDITIONAL))
def test_every_setting_is_read_or_refused_by_name(name, tmp_path, capsys):
    config_type, presets, main, check_inputs, cli, overrides = recipe(name, tmp_path)
    config = load_config(config_type, presets, preset="tiny", overrides=[*overrides, *STEPS])

    def run() -> None:  # what the shell and the recipe do with the config
        join_replica_groups(config)
        if check_inputs is not None:
            check_inputs(config)
        assert main(config, tmp_path / "out", False) == 0

    unread = set(leaves(config)) - reads_of(config, run)
    # A conditional setting may be read on every path (e.g. by a layout check) and still be
    # refused on its own; every other setting must be read.
    assert unread <= set(CONDITIONAL[name]), f"{name}: read by nothing: {sorted(unread)}"
    for key, (value, needs) in CONDITIONAL[name].items():
        capsys.readouterr()
        argv = [str(tmp_path / f"refused_{key}"), "--preset", "tiny",
                *(f"--set={o}" for o in [*overrides, *STEPS, f"{key}={value}"])]
        assert cli(argv) == 2, f"{name}: {key}={value} was not refused"
        err = capsys.readouterr().err
        section, _, setting = key.rpartition(".")
        assert setting in err and section.split(".")[0] in err, err
        assert needs.split("=")[0] in err, err
        assert not (tmp_path / f"refused_{key}").exists()  # nothing written
