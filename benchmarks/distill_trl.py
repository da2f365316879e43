"""Distillation here (`recipes.distill`) against TRL's `GKDTrainer` (trl 1.16,
`trl.experimental.gkd`): step 1 equal on the records' own completions, then throughput off
and on policy.

    PYTHONPATH=DIR_WITH_TRL .venv/bin/python -m benchmarks.distill_trl [--rounds 4]
        [--steps 16] [--batch 8] [--prompts 256] [--hidden 256] [--layers 4]
        [--teacher-hidden 384] [--max-new-tokens 16] [--head-share 0.275] [--sft-steps 100]
        [--qwen-shape 1] [--work DIR]

Step 1: the tiny chat model as the student, a wider one of its tokenizer as the teacher,
8 conversational prompts each with a completion, `lmbda` 0 (the records' own completions:
sampling cannot be matched across the two), beta 0.5, temperature 1, one micro-batch.
TRL is given the token ids our data path makes (`input_ids` with a `completion_mask`, a
form its collator takes): the assistant turn through `<|im_end|>`; from messages TRL would
also score the newline its template renders after it. Step 1's loss (the divergence per
completion token) and gradient norm, both sides' published ones. The definitions agree;
they part where: GKD's loss runs at temperature 1 whatever `temperature` (which it uses
for sampling only; ours is `loss.temperature`), and under on-policy micro-batches GKD
divides by the tokens of the batch it was handed, not of the completions it sampled
(transformers counts `num_items_in_batch` before `training_step` replaces the batch), so
its on-policy loss is scaled by their ratio; ours counts the trained tokens. TRL's `lmbda`
draw is Python's `random` per micro-batch and process, ours a function of the seed, step
and micro-batch.

Throughput: student ``--hidden`` x ``--layers``, teacher ``--teacher-hidden`` x
``--layers`` (``--qwen-shape 1``: both random Llamas of Qwen2.5-0.5B's shape, 151,936
rows, no warm start; one step there takes ~20 s a side on one CPU thread), their
vocabulary the tokenizer's 320 tokens padded to the rows at which the
student's head holds ``--head-share`` of its matmul parameters (Qwen2-0.5B's by default,
3,520 rows; 0: 320, where the head is 3% and the loss's softmax costs nothing:
`benchmarks.trl_common.padded_vocab`), the student first SFT-trained ``--sft-steps`` on the
records (on-policy distillation starts from an instruction-tuned student: its samples then
stop at ``<|im_end|>`` after 6-8 tokens as the records' do; 0: a random student, whose
samples run to ``--max-new-tokens``), ``--prompts`` prompts with completions, ``--batch`` a
step in one micro-batch, float32 on the CPU, one intra-op thread, AdamW at a constant 1e-4, no
clipping, TRL's gradient checkpointing and bf16 off; `lmbda` 0 (the records' completions)
and 1 (the student samples up to ``--max-new-tokens`` at temperature 1 with its KV cache:
our generator, TRL's `model.generate`); each run its own process, alternated
(`benchmarks.trl_common`). Printed: trained completion tokens per CPU second of the step
(median after the first 3 steps), peak RSS; medians over rounds, ours over TRL. Ours is
always the whole loop's (our published ``steps_per_s``); TRL's ``tokens_per_s`` times its
step alone, ``tokens_per_loop_s`` its whole loop as ours (step end to step end).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from benchmarks.trl_common import (
    QWEN2_HEAD_SHARE,
    arguments,
    child,
    our_step_s,
    our_train_records,
    padded_vocab,
    print_gaps,
    require_trl,
    step_timer,
    throughput_rounds,
)

LR = 1e-4
WARMUP = 3
SEQ_LEN = 128


def write_data(path: Path, num: int, seed: int) -> Path:
    """Prompts (`gangtrain.tiny.prompts`) with a completion each."""
    from gangtrain.tiny.prompts import prompt_records

    records = prompt_records(num, seed)
    for r in records:
        r["completion"] = [{"role": "assistant", "content": f"It is {r['answer']}."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def our_args(out: Path, student: Path, teacher: Path, data: Path, batch: int, steps: int,
             lmbda: float, max_new_tokens: int) -> list[str]:
    """(Validation, left out of the step times, once at the end on 8 prompts: the recipe
    keeps the best checkpoint by it.)"""
    valid = write_data(data.parent / "valid8.jsonl", 8, seed=1)
    return [str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={student}",
            "--set", f"teacher.path={teacher}", "--set", f"data.files=[{data}]",
            "--set", f"data.valid_files=[{valid}]",
            "--set", f"data.seq_len={SEQ_LEN}", "--set", f"data.batch_size={batch}",
            "--set", f"loss.lmbda={lmbda}", "--set", "loss.beta=0.5",
            "--set", "loss.temperature=1.0", "--set", "generation.temperature=1.0",
            "--set", f"generation.max_new_tokens={max_new_tokens}",
            "--set", f"optimizer.lr={LR}", "--set", "optimizer.betas=[0.9,0.999]",
            "--set", "lr_scheduler.warmup_steps=0", "--set", "lr_scheduler.final_lr_scale=1.0",
            "--set", "trainer.max_gradient_norm=null", "--set", f"trainer.max_num_steps={steps}",
            "--set", f"trainer.checkpoint_every_n_steps={steps}",
            "--set", f"trainer.validate_every_n_steps={steps}",
            "--set", "trainer.publish_metrics_every_n_steps=1"]


def tokenised(student: Path, data: Path) -> list[dict]:
    """The records as our data path encodes them (prompt ids, completion ids), in TRL's
    pre-tokenised form."""
    from transformers import AutoTokenizer

    from gangtrain.data.prompts import read_prompts
    from gangtrain.posttrain.objectives.distill import examples

    tokenizer = AutoTokenizer.from_pretrained(student)
    encoded = examples(read_prompts([data], tokenizer, max_prompt_tokens=SEQ_LEN), tokenizer,
                       "completion", str(student))
    return [{"prompt": "", "input_ids": [*p, *c], "completion_mask": [0] * len(p) + [1] * len(c)}
            for p, c in zip(encoded.prompts, encoded.completions, strict=True)]


def trl_trainer(a: argparse.Namespace, records: list[dict], out: Path, lmbda: float,
                callbacks: list, student: Path | None = None, teacher: Path | None = None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    student, teacher = student or a.work / "student", teacher or a.work / "teacher"
    config = GKDConfig(
        output_dir=str(out), max_steps=a.steps, per_device_train_batch_size=a.batch,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1e9,
        lmbda=lmbda, beta=0.5, temperature=1.0, max_new_tokens=a.max_new_tokens,
        max_length=SEQ_LEN, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, dataloader_num_workers=0,
        disable_tqdm=True, seed=0)
    return GKDTrainer(model=AutoModelForCausalLM.from_pretrained(student),
                      teacher_model=AutoModelForCausalLM.from_pretrained(teacher), args=config,
                      train_dataset=Dataset.from_list(records),
                      processing_class=AutoTokenizer.from_pretrained(student),
                      callbacks=callbacks)


def step_one(work: Path) -> None:
    from gangtrain.tiny.pairs import make_tiny_chat_model
    from recipes.distill.recipe import cli

    student = make_tiny_chat_model(work / "small_student")
    teacher = make_tiny_chat_model(work / "small_teacher", hidden_size=96, seed=1)
    data = write_data(work / "eight.jsonl", 8, seed=3)
    assert cli(our_args(work / "ours", student, teacher, data, 8, 1, 0.0, 8)) == 0
    ours = our_train_records(work / "ours")[0]
    one = argparse.Namespace(steps=1, batch=8, max_new_tokens=8)
    trainer = trl_trainer(one, tokenised(student, data), work / "trl", 0.0, [], student,
                          teacher)
    trainer.train()
    theirs = next(r for r in trainer.state.log_history if "loss" in r)
    print_gaps({k: ours[k] for k in ("loss", "grad_norm")},
               {k: theirs[k] for k in ("loss", "grad_norm")})


def ours_rate(a: argparse.Namespace) -> dict[str, float]:
    from recipes.distill.recipe import cli

    out = a.work / f"ours_rate_{a.lmbda}"
    assert cli(our_args(out, a.work / "student", a.work / "teacher", a.work / "train.jsonl",
                        a.batch, a.steps, a.lmbda, a.max_new_tokens)) == 0
    records = our_train_records(out)[WARMUP:]
    tokens = statistics.median(r["completions/mean_length"] * a.batch for r in records)
    rate = tokens / our_step_s(out, WARMUP)
    return {"tokens_per_s": rate, "tokens_per_loop_s": rate}  # (ours counts the loop)


def trl_rate(a: argparse.Namespace) -> dict[str, float]:
    callback, times = step_timer()
    counts: list[int] = []
    trainer = trl_trainer(a, tokenised(a.work / "student", a.work / "train.jsonl"),
                          a.work / f"trl_rate_{a.lmbda}", a.lmbda, [callback])
    compute_loss = trainer.compute_loss

    def counting(model, inputs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts.append(int((inputs["labels"][:, 1:] != -100).sum()))  # after any sampling
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counting
    trainer.train()
    rates = [n / t for n, t in zip(counts[WARMUP:], times[WARMUP:], strict=True)]
    # loop_times[i] ends at step i + 2's end: its tokens are counts[i + 1]
    loops = [n / t for n, t in zip(counts[WARMUP + 1:], callback.loop_times[WARMUP:],
                                   strict=True)]
    return {"tokens_per_s": statistics.median(rates),
            "tokens_per_loop_s": statistics.median(loops)}


def warm_start(work: Path, steps: int) -> None:
    """Replace ``work/student`` by itself SFT-trained ``steps`` steps (`recipes.sft`, 16
    records a step) on the records' prompts and completions."""
    from recipes.sft.recipe import cli

    records = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    sft = work / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": [*r["prompt"], *r["completion"]]}) + "\n"
                           for r in records))
    assert cli([str(work / "sft"), "--overwrite", "--preset", "tiny",
                "--set", f"model.path={work / 'student'}", "--set", f"data.files=[{sft}]",
                "--set", "data.seq_len=64", "--set", "data.batch_size=16",
                "--set", f"trainer.max_num_steps={steps}",
                "--set", f"trainer.checkpoint_every_n_steps={steps}",
                "--set", f"trainer.validate_every_n_steps={steps}"]) == 0
    shutil.rmtree(work / "student")
    shutil.copytree(work / "sft" / "hf", work / "student")


def qwen_shaped(work: Path) -> None:
    """``work/student`` and ``work/teacher``: random Llamas of Qwen2.5-0.5B's shape
    (`benchmarks.real_size_workers.make_inputs`, the tiny tokenizer), drawn from seeds 0
    and 1."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.real_size import QWEN_05B
    from benchmarks.real_size_workers import make_inputs

    make_inputs(work / "qwen", QWEN_05B, 256, "fp32")
    shutil.copytree(work / "qwen" / "model", work / "student")
    shutil.copytree(work / "qwen" / "model", work / "teacher")
    torch.manual_seed(1)
    teacher = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work / "teacher"))
    teacher.save_pretrained(work / "teacher")


def main() -> None:
    a = arguments(__doc__, steps=16, prompts=256, teacher_hidden=384, max_new_tokens=16,
                  lmbda=0.0, head_share=QWEN2_HEAD_SHARE, sft_steps=100, qwen_shape=0)
    if a.child is not None:
        child(a, ours_rate, trl_rate)
        return
    version = require_trl()
    work = a.work = a.work or Path(tempfile.mkdtemp(prefix="distill_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    step_one(work)

    from gangtrain.tiny.pairs import make_tiny_chat_model

    write_data(work / "train.jsonl", a.prompts, seed=0)
    if a.qwen_shape:
        qwen_shaped(work)
        print(f"throughput: trl {version}; student and teacher random Llamas of "
              f"Qwen2.5-0.5B's shape (494M parameters, 151,936 rows); {a.prompts} prompts, "
              f"batch {a.batch}, {a.steps} steps, up to {a.max_new_tokens} new tokens; work "
              f"dir {work}")
    else:
        vocab = padded_vocab(a.hidden, a.layers, a.head_share)  # the student's share
        make_tiny_chat_model(work / "student", hidden_size=a.hidden, num_layers=a.layers,
                             padded_vocab=vocab)
        make_tiny_chat_model(work / "teacher", hidden_size=a.teacher_hidden,
                             num_layers=a.layers, seed=1, padded_vocab=vocab)
        if a.sft_steps:
            warm_start(work, a.sft_steps)
        print(f"throughput: trl {version}; student {a.hidden} x {a.layers} (SFT "
              f"{a.sft_steps} steps), teacher {a.teacher_hidden} x {a.layers}, vocabulary "
              f"{vocab or 320} (the student's head share {a.head_share}); {a.prompts} "
              f"prompts, batch {a.batch}, {a.steps} steps, up to {a.max_new_tokens} new "
              f"tokens; work dir {work}")
    for lmbda in (0.0, 1.0):
        print(f"lmbda {lmbda}:")
        throughput_rounds("benchmarks.distill_trl", a, ("tokens_per_s", "tokens_per_loop_s"),
                          ["--max-new-tokens", str(a.max_new_tokens), "--lmbda", str(lmbda)])


if __name__ == "__main__":
    main()
