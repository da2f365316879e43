"""Every checkpoint of an SFT run holds the tokenizer as the run used it (issue 66): with
`data.chat_template=FILE` and `data.eos_token`, `step_N/hf/`, what `export_pretrained`
makes of it, and `OUTPUT_DIR/hf/` load (`AutoTokenizer.from_pretrained`) with the file's
template and that end token, not the source model's."""

from __future__ import annotations

from transformers import AutoTokenizer

from gangtrain.models.hf import export_pretrained
from gangtrain.tiny.chat import (
    CHATML_TEMPLATE_WITH_GENERATION,
    make_tiny_chat_model,
    write_chat_data,
)
from recipes.sft.recipe import cli


def test_each_checkpoint_and_the_export_hold_the_template_and_end_token_as_used(tmp_path):
    model_dir = make_tiny_chat_model(tmp_path / "model")
    source = AutoTokenizer.from_pretrained(model_dir)
    # The same rendering as the model's ChatML, written otherwise: a template of the run's own.
    template = "{#- the run's own template -#}\n" + CHATML_TEMPLATE_WITH_GENERATION
    assert template != source.chat_template
    (tmp_path / "chat.jinja").write_text(template, encoding="utf-8")
    eos = "<|endoftext|>"
    assert source.eos_token != eos
    out = tmp_path / "out"
    assert cli([str(out), "--preset", "tiny", "--set", f"model.path={model_dir}",
                "--set", f"data.files=[{write_chat_data(tmp_path / 'chat.jsonl', 24)}]",
                "--set", f"data.cache_dir={tmp_path / 'cache'}",
                "--set", f"data.chat_template={tmp_path / 'chat.jinja'}",
                "--set", f"data.eos_token={eos}",
                "--set", "trainer.max_num_steps=2", "--set", "trainer.checkpoint_every_n_steps=1",
                "--set", "trainer.validate_every_n_steps=1",
                "--set", "trainer.keep_last_n_checkpoints=2"]) == 0
    steps = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in steps] == ["step_1", "step_2"]
    exported = [export_pretrained(steps[0], tmp_path / "export_1")]
    for directory in [*(step / "hf" for step in steps), *exported, out / "hf"]:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert tokenizer.chat_template == template, directory
        assert tokenizer.eos_token == eos, directory
        assert tokenizer.get_vocab() == source.get_vocab(), directory
