"""The HF export at the end of a pipeline-parallel run: `python -m recipes.sft` with
`gangs.pp_size=2` on 2 forked Gloo ranks writes `OUT/hf/` (each rank's checkpoint shard holds
its stages' weights under the whole model's names; rank 0's stage names the model it was cut
from, whose config, generation config and tokenizer travel with the checkpoint), which
`from_pretrained` loads with no missing or unexpected keys and whose logits are those of one
process trained on the same steps; the model-only saves (`model_checkpoint_every_n_steps`)
are written as transformers' sharded layout, a shard a stage. A family whose attention differs (Mistral's sliding
window) with 1F1B, with TP2 inside each stage and with each stage sharded by FSDP2 over 2
DP ranks (4 ranks each); Qwen3 with LoRA adapters (merged
into the export) and two stages a rank (interleaved 1F1B: the rank's stages merged into one
module)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from model_families import VOCAB, save_tiny, save_tokenizer
from ranks import run_ranks
from transformers import AutoModelForCausalLM

STEPS, ACC = 3, 2
# Two rows of the model's vocabulary (ids past the tokenizer's words score too).
INPUT_IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))


def write_chats(path: Path, count: int) -> Path:
    """Conversations in the words of `save_tokenizer`'s vocabulary (`w0` ... `w39`)."""
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(count):
            words = [f"w{i}" for i in torch.randint(0, 40, (14,), generator=g).tolist()]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(words[:6])},
                {"role": "assistant", "content": " ".join(words[6:])}]}) + "\n")
    return path


def sft(out: Path, model_dir: Path, chats: Path, *settings: str) -> int:
    from recipes.sft.recipe import cli

    args = [str(out), "--preset", "tiny", "--set", f"model.path={model_dir}",
            "--set", f"data.files=[{chats}]", "--set", f"data.cache_dir={out.parent / 'cache'}",
            "--set", "data.seq_len=64", "--set", f"trainer.max_num_steps={STEPS}",
            "--set", f"trainer.num_accumulate={ACC}",
            "--set", f"trainer.validate_every_n_steps={STEPS}",
            "--set", f"trainer.checkpoint_every_n_steps={STEPS}", "--set", "gangs.timeout_s=60",
            "--set", "trainer.data_parallel=ddp"]
    return cli([*args, *(x for s in settings for x in ("--set", s))])


def logits_of(directory: Path) -> torch.Tensor:
    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(INPUT_IDS).logits


LORA = ("lora.r=4", "lora.alpha=8", "lora.target_modules=[q_proj,v_proj,gate_proj]")


@pytest.mark.parametrize(("family", "settings", "layout", "ranks"), [
    pytest.param("mistral", (), (), 2, id="mistral_1f1b"),
    pytest.param("qwen3", LORA, ("gangs.pp_schedule=interleaved_1f1b",), 2,
                 id="qwen3_lora_interleaved"),
    # Each stage's weights DTensors split over 2 TP ranks: made whole by both.
    pytest.param("mistral", (), ("gangs.tp_size=2",), 4, id="mistral_pp2_tp2"),
    # ... sharded over 2 DP ranks by FSDP2: made whole by both.
    pytest.param("mistral", (), ("trainer.data_parallel=fsdp",), 4, id="mistral_pp2_fsdp2"),
])
def test_a_pipeline_run_exports_the_model_one_process_trains(tmp_path, family, settings,
                                                             layout, ranks):
    model_dir = save_tokenizer(save_tiny(family, tmp_path / "model"))
    chats = write_chats(tmp_path / "chats.jsonl", 60)
    pipeline = ["gangs.pp_size=2", f"trainer.model_checkpoint_every_n_steps={STEPS}", *layout]
    one = tmp_path / "one" / "out"
    assert run_ranks(partial(sft, one, model_dir, chats, *settings), world_size=1)[0] == 0
    two = tmp_path / "pp2" / "out"
    assert run_ranks(partial(sft, two, model_dir, chats, *settings, *pipeline),
                     world_size=ranks, timeout=300) == [0] * ranks

    assert not (two / "checkpoints" / "best_model.safetensors").exists()
    exported, reference = logits_of(two / "hf"), logits_of(one / "hf")
    moved = (reference - logits_of(model_dir)).abs().max().item()
    gap = (exported - reference).abs().max().item()
    print(f"{family}: PP2 export vs one process {gap:.1e}; training moved the logits {moved:.1e}")
    assert moved > 1e-2  # the export is of a trained model, not the pretrained one
    # float32 weights after 3 AdamW steps whose gradients were summed in another order
    # (micro-batches through the stage boundary): logits of size ~1 differ by rounding,
    # measured 0.9e-7 to 1.2e-7 (PP2, PP2xTP2); 1e-6 leaves room for other CPUs' kernels, while a stage's
    # weights left out or adapters not merged move them by 4e-2 or more (`moved`).
    assert gap < 1e-6, gap
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (two / "hf" / name).read_bytes() == (one / "hf" / name).read_bytes(), name

    # The model-only save of the last step: each stage's shard, the index, the HF files;
    # the same weights as the export of that step's checkpoint, bit for bit.
    saved = two / "models" / f"step_{STEPS}"
    assert sorted(p.name for p in saved.glob("model*")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    if not settings:  # a LoRA run's model saves hold the adapters unmerged
        assert torch.equal(logits_of(saved), exported)


def test_tied_embeddings_under_a_pipeline_are_refused_by_name_before_anything_runs(
        tmp_path, capsys):
    """A model whose output layer is its input embedding would hold that weight on the
    first and the last stage: two copies trained apart, exported as one. Refused (exit 2,
    one line naming the setting) before any process group, model or file."""
    model_dir = save_tokenizer(save_tiny("llama", tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    out = tmp_path / "out"
    code = sft(out, model_dir, write_chats(tmp_path / "chats.jsonl", 4), "gangs.pp_size=2")
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "config 'gangs.pp_size' 2: the model ties its output layer" in err, err
    assert [p.name for p in out.iterdir()] == [".run.lock"]  # nothing written, the lock aside
