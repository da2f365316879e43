"""KTO here (`recipes.preference`, loss.kind=kto) against TRL's `KTOTrainer` (trl 1.16):
steps 1 and 2 equal, then throughput.

    PYTHONPATH=DIR_WITH_TRL .venv/bin/python -m benchmarks.kto_trl [--rounds 4]
        [--steps 24] [--batch 8] [--examples 256] [--hidden 256] [--layers 4]
        [--head-share 0.275] [--work DIR]

Steps 1 and 2: the tiny chat model (`gangtrain.tiny.chat`), 16 unpaired examples in TRL's
text form (`gangtrain.tiny.pairs.unpaired_examples(form="text")`: with it both sides score
the same tokens, the completion and its end token; conversational examples differ by the
newline TRL's template renders after `<|im_end|>`, which it scores and we do not), beta 0.1,
undesirable_weight 1.33, 8 examples a step in one micro-batch, AdamW at a constant 1e-3, no
clipping. TRL reads its dataset in order (KTO requires `train_sampling_strategy`
sequential), so it is given the examples in the order our reader draws them: the same
examples a step and the same mismatched partners (each prompt with the previous example's
completion, TRL's rotation by one). Printed: both steps' loss, gradient norm and KL estimate.
Step 1 (the policy is the reference) has KL 0 and the loss is the mean weight x 1/2 on both;
its gradient norm is not trivial. Step 2 compares the whole path (the AdamW step, the
estimate from the moved policy). The definitions agree at one process and one micro-batch a
step; TRL estimates the KL per micro-batch on each device (the mean of the devices' means),
ours over the optimizer step's examples on all devices, so they part under gradient
accumulation or unequal device batches.

Throughput: a tiny ChatML Llama of ``--hidden`` x ``--layers`` (its vocabulary the
tokenizer's 320 tokens padded to the rows at which its head holds ``--head-share`` of its
matmul parameters: Qwen2-0.5B's by default, 3,520 rows; 0: 320, a head of 3%;
`benchmarks.trl_common.padded_vocab`), ``--examples``
conversational examples, ``--batch`` a step in one micro-batch, float32 on the CPU, one
intra-op thread, AdamW at a constant 1e-4, no clipping, max_length 128, TRL's gradient
checkpointing and bf16 off, the reference a frozen copy on both; each run its own process,
alternated (`benchmarks.trl_common`): examples per CPU second of the step (median after the
first 4 steps) and peak RSS, medians over rounds, ours over TRL. Ours is always the whole
loop's (our published ``steps_per_s``: the batch's fetch, the step, publishing); TRL's
``examples_per_s`` times its step alone (callback begin to end), ``examples_per_loop_s``
its whole loop as ours (step end to step end).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks import trl_common
from benchmarks.trl_common import (
    QWEN2_HEAD_SHARE,
    our_step_s,
    our_train_records,
    padded_vocab,
    print_gaps,
    step_timer,
)

BETA, UNDESIRABLE = 0.1, 1.33
MAX_LENGTH = 128
WARMUP = 4


def our_args(out: Path, model: Path, train: Path, valid: Path, cache: Path, batch: int,
             steps: int, lr: float, clip: float | None) -> list[str]:
    return [str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={model}",
            "--set", "loss.kind=kto", "--set", f"loss.beta={BETA}",
            "--set", f"loss.undesirable_weight={UNDESIRABLE}",
            "--set", f"data.files=[{train}]", "--set", f"data.valid_files=[{valid}]",
            "--set", f"data.cache_dir={cache}", "--set", f"data.seq_len={MAX_LENGTH}",
            "--set", f"data.batch_size={batch}", "--set", f"optimizer.lr={lr}",
            "--set", "optimizer.betas=[0.9,0.999]", "--set", "lr_scheduler.warmup_steps=0",
            "--set", "lr_scheduler.final_lr_scale=1.0",
            "--set", f"trainer.max_gradient_norm={'null' if clip is None else clip}",
            "--set", f"trainer.max_num_steps={steps}",
            "--set", f"trainer.validate_every_n_steps={steps}",
            "--set", f"trainer.checkpoint_every_n_steps={steps}",
            "--set", "trainer.publish_metrics_every_n_steps=1"]


def trl_trainer(model: Path, records: list[dict], out: Path, batch: int, steps: int,
                lr: float, clip: float, callbacks: list) -> object:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    config = KTOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=batch,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=clip,
        beta=BETA, undesirable_weight=UNDESIRABLE, max_length=MAX_LENGTH, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True, seed=0)
    return KTOTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                      ref_model=AutoModelForCausalLM.from_pretrained(model), args=config,
                      train_dataset=Dataset.from_list(records),
                      processing_class=AutoTokenizer.from_pretrained(model),
                      callbacks=callbacks)


def reader_order(model: Path, train: Path, valid: Path, cache: Path, batch: int) -> list[dict]:
    """The records of `train` in the order our reader draws them in epoch 0 (the
    `GlobalBatchReader`'s documented order: randperm seeded ``shuffle_seed + epoch``)."""
    import torch
    from transformers import AutoTokenizer

    from gangtrain.posttrain.objectives.preference import PreferenceConfig, prepare_unpaired

    config = PreferenceConfig.model_validate({
        "model": {"path": str(model)}, "loss": {"kind": "kto"},
        "data": {"files": [str(train)], "valid_files": [str(valid)], "batch_size": batch,
                 "cache_dir": str(cache)}})
    reader = prepare_unpaired(config, AutoTokenizer.from_pretrained(model)).train
    records = [json.loads(line) for line in train.read_text().splitlines()]
    order = torch.randperm(len(reader.bins), generator=torch.Generator().manual_seed(0))
    return [records[int(reader.bins.bin(b)[0])] for b in order.tolist()]


def two_steps(work: Path) -> None:
    from gangtrain.tiny.pairs import make_tiny_chat_model, write_unpaired_data
    from recipes.preference.recipe import cli

    model = make_tiny_chat_model(work / "model")
    train = write_unpaired_data(work / "sixteen.jsonl", 16, seed=3, form="text")
    valid = write_unpaired_data(work / "valid8.jsonl", 8, seed=1, form="text")
    assert cli(our_args(work / "ours", model, train, valid, work / "cache", 8, 2, 1e-3,
                        None)) == 0
    ours = our_train_records(work / "ours")
    trainer = trl_trainer(model, reader_order(model, train, valid, work / "cache", 8),
                          work / "trl", 8, 2, 1e-3, 1e9, [])
    trainer.train()
    theirs = [r for r in trainer.state.log_history if "loss" in r]
    for step in (0, 1):
        print_gaps({k: ours[step][k] for k in ("loss", "grad_norm", "kl")},
                   {k: theirs[step][k] for k in ("loss", "grad_norm", "kl")},
                   what=f"step {step + 1}")


def ours_rate(a: argparse.Namespace) -> dict[str, float]:
    from recipes.preference.recipe import cli

    out = a.work / "ours_rate"
    assert cli(our_args(out, a.work / "rate_model", a.work / "train.jsonl",
                        a.work / "valid.jsonl", a.work / "cache", a.batch, a.steps, 1e-4,
                        None)) == 0
    rate = a.batch / our_step_s(out, WARMUP)
    return {"examples_per_s": rate, "examples_per_loop_s": rate}  # (ours counts the loop)


def trl_rate(a: argparse.Namespace) -> dict[str, float]:
    callback, times = step_timer()
    records = [json.loads(line) for line in (a.work / "train.jsonl").read_text().splitlines()]
    trl_trainer(a.work / "rate_model", records, a.work / "trl_rate", a.batch, a.steps, 1e-4,
                1e9, [callback]).train()
    return {"examples_per_s": a.batch / statistics.median(times[WARMUP:]),
            "examples_per_loop_s": a.batch / statistics.median(callback.loop_times[WARMUP:])}


def prepare(a: argparse.Namespace, version: str) -> None:
    """The equal-step check, then the rate runs' model and data in ``a.work``."""
    work = a.work
    two_steps(work)

    from gangtrain.tiny.pairs import make_tiny_chat_model, write_unpaired_data

    vocab = padded_vocab(a.hidden, a.layers, a.head_share)
    make_tiny_chat_model(work / "rate_model", hidden_size=a.hidden, num_layers=a.layers,
                         padded_vocab=vocab)
    write_unpaired_data(work / "train.jsonl", a.examples)
    write_unpaired_data(work / "valid.jsonl", 16, seed=1)
    print(f"throughput: trl {version}; model {a.hidden} x {a.layers}, vocabulary "
          f"{vocab or 320} (head share {a.head_share}); {a.examples} examples, "
          f"batch {a.batch}, {a.steps} steps; work dir {work}")


def main() -> None:
    trl_common.main(__doc__, "benchmarks.kto_trl", ("examples_per_s", "examples_per_loop_s"),
                    ours_rate, trl_rate, prepare, examples=256,
                    head_share=QWEN2_HEAD_SHARE)


if __name__ == "__main__":
    main()
