"""`python -m recipes.sft` end to end, as users run it: a tiny Llama with a ChatML BPE
tokenizer and 600 arithmetic conversations made here (`gangtrain.tiny.chat`); then read back
through what a user relies on: masks equal the assistant tokens of `apply_chat_template`,
`--eval-only`'s loss is the assistant-token NLL computed by hand on OUT/hf, OUT/hf stops
generating at <|im_end|>, 2-rank layouts give one process's losses, a killed run resumes
bit for bit, and mistakes are one clear line."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import warm_launch
from killed_runs import assert_same_state, checkpoint_state, kill_repeatedly
from recipe_runs import REPO, describe, recipe_env, run_all, run_module
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangtrain.data.mixing import hold_out
from gangtrain.data.sft import tokenize_files
from gangtrain.tiny.chat import (
    CHATML_TEMPLATE_WITH_GENERATION,
    chat_conversations,
    make_tiny_chat_model,
    write_chat_data,
)
from recipes.sft.recipe import cli
from trainer.errors import UserError
from trainer.observe.recorders import read_jsonl

MAX_STEPS = 60  # the tiny preset's
NUM_CONVERSATIONS = 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model directory, chat JSONL, datasets cache)."""
    base = tmp_path_factory.mktemp("sft")
    return (make_tiny_chat_model(base / "model"),
            write_chat_data(base / "chat.jsonl", NUM_CONVERSATIONS), base / "cache")


def sft_args(out: Path, tiny, *extra: str) -> list:
    model, chat, cache = tiny
    return [out, "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{chat}]", "--set", f"data.cache_dir={cache}", *extra]


@pytest.fixture(scope="module")
def straight(tiny, tmp_path_factory) -> Path:
    """The tiny preset, never interrupted."""
    out = tmp_path_factory.mktemp("straight") / "out"
    proc = run_module("recipes.sft", *sft_args(out, tiny))
    assert proc.returncode == 0, describe(proc)
    assert "Traceback" not in proc.stderr
    return out


def by_step(out: Path, section: str, key: str = "loss") -> dict[int, float]:
    key = key if section == "train" else f"{section}/{key}"
    return {r["step"]: r[key] for r in read_jsonl(out / "metrics" / f"{section}.jsonl")}


def reference_masks(tokenizer, messages) -> tuple[list[int], list[int]]:
    """The input ids and assistant-token mask transformers gives for a template that marks
    the assistant's content and end token with {% generation %}."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True,
                                        chat_template=CHATML_TEMPLATE_WITH_GENERATION)
    return list(out["input_ids"]), list(out["assistant_masks"])


# -------------------------------------------------------------------------------------------
# Masks against apply_chat_template


def test_masks_are_the_assistant_tokens_of_apply_chat_template(tiny, tmp_path):
    """50 conversations through the recipe's tokenising (the tiny tokenizer's template has
    no generation markers: masks come from rendering prefixes) against transformers' own
    assistant mask of the same rendering with the markers."""
    model, _, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversations = chat_conversations(50, seed=3)
    path = tmp_path / "fifty.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    tokenized = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "cache")
    assert tokenized.format == "chat" and len(tokenized) == 50
    num_trained = 0
    for i, messages in enumerate(conversations):
        ids, mask = reference_masks(tokenizer, messages)
        row = tokenized.dataset[i]
        assert row["input_ids"] == ids, i
        assert row["trained"] == mask, i
        num_trained += sum(mask)
        # The trained tokens decode to the assistant turns, each closed by <|im_end|>.
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert trained == "".join(answers)
    assert num_trained > 1000


def test_a_template_that_cannot_be_masked_is_refused_by_name(tiny, tmp_path):
    model, _, _ = tiny
    tokenizer = AutoTokenizer.from_pretrained(model)
    # Renders earlier assistant turns differently once more follow (as templates that drop
    # earlier reasoning do): no prefix of the rendering is stable.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n...<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tmp_path / "two_turns.jsonl"
    conversation = [{"role": "user", "content": "What is 1 plus 1?"},
                    {"role": "assistant", "content": "1 plus 1 is 2."},
                    {"role": "user", "content": "What is 2 plus 2?"},
                    {"role": "assistant", "content": "2 plus 2 is 4."}]
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    with pytest.raises(UserError, match="the chat template of tiny-model cannot be masked"):
        tokenize_files([path], tokenizer, name="tiny-model", cache_dir=tmp_path / "cache")


# -------------------------------------------------------------------------------------------
# One run, read back


@torch.no_grad()
def assistant_nll(model, tokenizer, conversations) -> tuple[float, int, int]:
    """(summed NLL of the assistant tokens, how many, how many predicted right), one
    conversation at a time, masks from `reference_masks`."""
    total, count, correct = 0.0, 0, 0
    for messages in conversations:
        ids, mask = reference_masks(tokenizer, messages)
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
        targets = torch.tensor(ids[1:])
        trained = torch.tensor(mask[1:]).bool()
        total += F.cross_entropy(logits[trained], targets[trained], reduction="sum").item()
        count += int(trained.sum())
        correct += int((logits.argmax(-1)[trained] == targets[trained]).sum())
    return total, count, correct


def held_out_conversations() -> list:
    _, held = hold_out(NUM_CONVERSATIONS, 0.1, seed=0)  # the tiny preset's split
    conversations = chat_conversations(NUM_CONVERSATIONS)
    return [conversations[i] for i in held]


@pytest.fixture(scope="module")
def pretrained_nll(tiny) -> float:
    """The pretrained model's mean NLL per assistant token of the held-out conversations,
    by hand."""
    model_dir, _, _ = tiny
    total, count, _ = assistant_nll(AutoModelForCausalLM.from_pretrained(model_dir),
                                    AutoTokenizer.from_pretrained(model_dir),
                                    held_out_conversations())
    return total / count


def test_eval_only_on_a_fresh_directory_scores_the_pretrained_model(tiny, pretrained_nll,
                                                                    tmp_path, capsys):
    out = tmp_path / "fresh"
    assert cli(list(map(str, sft_args(out, tiny, "--eval-only")))) == 0
    console = capsys.readouterr().out
    assert f"evaluating the pretrained model {tiny[0]}" in console.replace("\n", ""), console
    [record] = read_jsonl(out / "metrics" / "eval.jsonl")
    assert record["step"] == 0
    # fp32 sums of ~10^3 token losses of ~6 against a float64 reference: a few 1e-7.
    assert record["valid/loss"] == pytest.approx(pretrained_nll, rel=1e-6)
    assert not (out / "checkpoints").exists() and not (out / "config.yaml").exists()


def test_sft_learns_and_eval_only_is_the_assistant_nll_by_hand(straight, tiny):
    model_dir, _, _ = tiny
    valid = by_step(straight, "valid")
    assert sorted(valid) == [20, 40, 60]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = held_out_conversations()
    before, count, _ = assistant_nll(AutoModelForCausalLM.from_pretrained(model_dir),
                                     tokenizer, conversations)
    best_step = min(valid, key=valid.get)
    assert valid[best_step] < before / count - 2.0, (before / count, valid)  # 5.8 -> 1.8

    assert cli(list(map(str, sft_args(straight, tiny, "--eval-only")))) == 0  # in-process
    [record] = read_jsonl(straight / "metrics" / "eval.jsonl")
    assert record["step"] == best_step
    exported = AutoModelForCausalLM.from_pretrained(straight / "hf")
    total, count, correct = assistant_nll(exported, AutoTokenizer.from_pretrained(
        straight / "hf"), conversations)
    assert record["valid/loss"] == pytest.approx(total / count, rel=1e-5)
    assert record["valid/accuracy"] == pytest.approx(correct / count, abs=1e-6)
    assert record["valid/loss"] == pytest.approx(valid[best_step], rel=1e-6)


def test_export_carries_the_tokenizer_and_generation_config_and_stops_at_im_end(
        straight, tiny):
    model_dir, _, _ = tiny
    exported = straight / "hf"
    # The pretrained generation_config.json as it was: it alone stops at <|im_end|>
    # (config.json's eos is <|endoftext|>).
    assert json.loads((exported / "generation_config.json").read_text()) == \
        json.loads((model_dir / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(model_dir).chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(exported)
    stopped = 0
    for a, b in ((3, 4), (12, 2), (7, 9)):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {a} plus {b}?"}],
            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**prompt, max_new_tokens=40)
        new = out[0, prompt["input_ids"].shape[1]:].tolist()
        stopped += new[-1] == im_end and len(new) < 40
        assert tokenizer.decode(new).endswith(".<|im_end|>") or new[-1] != im_end
    assert stopped == 3


# -------------------------------------------------------------------------------------------
# Layouts, through the recipe's settings


def torchrun(ranks: int, out: Path, tiny, *extra: str) -> list:
    return ["torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "recipes.sft", *sft_args(out, tiny, "--set", "gangs.timeout_s=60", *extra)]


def test_fsdp2_and_tp2_track_one_process(straight, tiny, pretrained_nll, tmp_path):
    """FSDP2, TP2 and LoRA under FSDP2, each validating at the start (validation must leave
    no inference tensor for the next backward): step 0 scores the pretrained model as the
    hand-written NLL does, and the 60 steps, clipped at norm 1 (the preset's), give one
    process's losses."""
    start = ("--set", "trainer.validate_at_start=true")
    procs = run_all({
        "fsdp2": torchrun(2, tmp_path / "fsdp2", tiny, *start),
        "tp2": torchrun(2, tmp_path / "tp2", tiny, *start, "--set", "gangs.tp_size=2",
                        "--set", "trainer.data_parallel=ddp"),
        "lora_fsdp2": torchrun(2, tmp_path / "lora_fsdp2", tiny, *start, "--set", "lora.r=4",
                               "--set", "trainer.max_num_steps=1"),
    })
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
    for name in procs:  # LoRA's B starts at 0: the pretrained model
        first = by_step(tmp_path / name, "valid")[0]
        print(f"{name} step 0: relative gap to the hand NLL {abs(first / pretrained_nll - 1):.1e}")
        # fp32 sums of ~10^3 token losses of ~6 against a float64 reference: a few 1e-7
        # (measured 0.9e-8 to 2.9e-8).
        assert first == pytest.approx(pretrained_nll, rel=1e-6), name
    for section in ("train", "valid"):
        reference = by_step(straight, section)
        for name in ("fsdp2", "tp2"):
            losses = {s: v for s, v in by_step(tmp_path / name, section).items() if s}
            assert losses.keys() == reference.keys()
            gap = max(abs(losses[s] - reference[s]) / reference[s] for s in reference)
            print(f"{name} {section}: largest relative gap to one process {gap:.1e}")
            # Measured 3.7e-8 to 6.3e-8 (FSDP2 and TP2, train and valid).
            assert gap < 1e-6, (name, section, losses, reference)


# -------------------------------------------------------------------------------------------
# Kill and resume


def command(out: Path, tiny) -> list[str]:
    return [sys.executable, "-m", "recipes.sft", *map(str, sft_args(out, tiny))]


def test_killed_run_resumes_bit_for_bit(straight, tiny, tmp_path):
    killed = tmp_path / "killed"
    hits = kill_repeatedly(command(killed, tiny), killed / "checkpoints", 2, random.Random(0),
                           final_step=MAX_STEPS, cwd=REPO, env=recipe_env())
    assert hits >= 1
    proc = warm_launch.run(command(killed, tiny), cwd=REPO, env=recipe_env(), timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert "resumed from" in proc.stderr
    final = f"checkpoints/step_{MAX_STEPS}"
    assert_same_state(checkpoint_state(straight / final), checkpoint_state(killed / final))
    for section in ("train", "valid"):
        assert by_step(killed, section) == by_step(straight, section)


# -------------------------------------------------------------------------------------------
# Mistakes: exit 2, one clear `error:` line, no traceback


def test_user_mistakes_are_one_clear_line(tiny, tmp_path, capsys):
    """Run in this process (`cli` is the command line as a function): exit 2, one `error:`
    line on stderr."""
    cases = {
        "text_field_on_chat": (["--set", "data.format=text", "--set", "data.text_field=messages"],
                               "field 'messages' (data.text_field) of the first record holds "
                               "messages, format text needs text: 'messages' holds "
                               "conversations, read them with data.format=chat"),
        "seq_len_beyond_context": (["--set", "data.seq_len=4096"],
                                   "error: config 'data.seq_len' (4096) is beyond the model's "
                                   "context: max_position_embeddings=256"),
        "missing_file": (["--set", f"data.files=[{tmp_path / 'gone.jsonl'}]"],
                         f"no such file or directory: '{tmp_path / 'gone.jsonl'}'"),
    }
    for name, (extra, expected) in cases.items():
        code = cli(list(map(str, sft_args(tmp_path / name, tiny, *extra))))
        err = capsys.readouterr().err
        assert code == 2, f"{name}: {err}"
        assert "Traceback" not in err and expected in err, f"{name}: {err}"
