"""Vision-language SFT: gangtrain's step against TRL 1.16's `SFTTrainer` on the same tiny
VLM and the same records, alternated fresh processes (needs `pip install trl==1.16.0`, a
benchmark dependency only; `PYTHONPATH=DIR_WITH_TRL` works too).

    python -m benchmarks.vlm_trl [--rounds 3] [--rows 4] [--seq-len 256] [--steps 20]

Both sides get the tiny LLaVA of `gangtrain.tiny.vision` (CLIP tower, 2-layer Llama, random
weights, the same directory), the colour records of `make_colour_data` (TRL's VLM
conversational format: an image part and a question, the colour as the answer, a second
text turn every fifth record; images 28 or 40 px, PNG files named relative to the JSONL),
`--rows` rows a step, AdamW lr 1e-5, fp32, one thread, no activation checkpointing (TRL's
SFTConfig defaults it on: set off), the image decoded and the processor
run when a batch is made (no workers).

- ours: `recipes.sft`'s data path (`posttrain.objectives.sft_images`): records packed whole
  into rows of `--seq-len` tokens, attention per record from the restarting position_ids,
  the loss on the answer tokens; `units.causal_lm.CausalLMUnit` (the recipe's unit).
- TRL: `SFTTrainer` with its `DataCollatorForVisionLanguageModeling`: one record a row,
  padded to the longest of the step (TRL refuses packing and padding-free for images), the
  loss on every token but padding (its labels).

Per run, over the steps after the first (a warm-up), from the end of the first step to the
end of the last (the data path included on both sides): the records' tokens per CPU second
of the process (one thread: a loaded machine's waits for a core do not count) and per wall
second (image, prompt and answer tokens, not padding: the work both sides do for the same
records), the answer tokens per CPU second (the assistant turns' tokens, counted from the
ids alike on both sides), and the process's peak RSS. Each run is a process of its own; a round runs
ours then TRL, the ratios are taken within a round and the medians printed (a shared
machine's slow spells hit both sides of a ratio alike).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-5


def prepare(work: Path, records: int) -> tuple[Path, Path]:
    """(the tiny LLaVA's directory, the training records)."""
    from gangtrain.tiny.vision import make_colour_data, make_tiny_vlm

    model = make_tiny_vlm(work / "llava", "llava")
    return model, make_colour_data(work / "data", n=records, seed=0, name="train.jsonl")


def answer_tokens(ids, assistant: int, end: int) -> int:  # noqa: ANN001
    """Tokens of the assistant turns in rows of ids: after each `<|assistant|>` through its
    `<|end|>` (the tiny template's turn markers)."""
    count = 0
    for row in ids.tolist():
        inside = False
        for token in row:
            if inside:
                count += 1
                inside = token != end
            elif token == assistant:
                inside = True
    return count


class Meter:
    """Tokens and time from the end of the first step to the end of the last."""

    def __init__(self, processor) -> None:  # noqa: ANN001
        tokens = processor.tokenizer.convert_tokens_to_ids
        self.assistant, self.end = tokens("<|assistant|>"), tokens("<|end|>")
        self.pad = processor.tokenizer.pad_token_id
        self.steps, self.tokens, self.answers = 0, 0, 0
        self.started, self.started_cpu = 0.0, 0.0

    def step_done(self, input_ids) -> None:  # noqa: ANN001
        if self.steps == 0:
            self.started, self.started_cpu = time.perf_counter(), time.process_time()
        else:
            self.tokens += int((input_ids != self.pad).sum())
            self.answers += answer_tokens(input_ids, self.assistant, self.end)
        self.steps += 1

    def result(self) -> dict[str, float]:
        seconds = time.perf_counter() - self.started
        cpu = time.process_time() - self.started_cpu
        return {"tokens_per_s": self.tokens / seconds, "answers_per_s": self.answers / seconds,
                "tokens_per_cpu_s": self.tokens / cpu, "answers_per_cpu_s": self.answers / cpu,
                "steps": self.steps - 1, "seconds": seconds}


def ours(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from gangtrain.posttrain.objectives.sft import SFTConfig
    from gangtrain.posttrain.objectives.sft_images import prepare_image_data
    from units.causal_lm import CausalLMUnit
    from units.metrics import MetricBag

    processor = AutoProcessor.from_pretrained(args.model)
    config = SFTConfig.model_validate({"model": {"path": str(args.model)}, "data": {
        "files": [str(args.data)], "valid_files": [str(args.data)], "seq_len": args.seq_len,
        "batch_size": args.rows, "packing": True}})
    reader, *_ = prepare_image_data(config, processor, "llava", train=True)
    model = AutoModelForImageTextToText.from_pretrained(args.model)
    model.train()
    unit = CausalLMUnit(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    meter = Meter(processor)
    while meter.steps <= args.steps:
        for batch in reader:
            loss, num_targets = unit(batch, MetricBag())
            (loss / num_targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            meter.step_done(batch["input_ids"])
            if meter.steps > args.steps:
                break
    return meter.result()


def trl(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    processor = AutoProcessor.from_pretrained(args.model)
    rows = [json.loads(line) for line in args.data.read_text().splitlines()]
    for r in rows:  # paths the processor opens when the batch is made
        r["images"] = [str(args.data.parent / f) for f in r["images"]]
    meter = Meter(processor)
    seen: list = []

    class StepMeter(TrainerCallback):
        def on_step_end(self, *a, **k):
            meter.step_done(seen.pop())

    class Recording(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append(inputs["input_ids"].cpu())
            return super().training_step(model, inputs, num_items_in_batch)

    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(
            output_dir=out, max_steps=args.steps + 1, per_device_train_batch_size=args.rows,
            max_length=args.seq_len, learning_rate=LR, optim="adamw_torch",
            lr_scheduler_type="constant", logging_steps=10_000, save_strategy="no",
            report_to=[], use_cpu=True, dataloader_num_workers=0, bf16=False, fp16=False,
            seed=1, disable_tqdm=True, gradient_checkpointing=False)  # TRL defaults to True
        trainer = Recording(model=AutoModelForImageTextToText.from_pretrained(args.model),
                            args=config, train_dataset=Dataset.from_list(rows),
                            processing_class=processor, callbacks=[StepMeter()])
        torch.set_num_threads(1)
        trainer.train()
    return meter.result()


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    result = (ours if args.worker == "ours" else trl)(args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def run_once(args: argparse.Namespace, framework: str, model: Path, data: Path) -> dict:
    command = [sys.executable, "-m", "benchmarks.vlm_trl", "--worker", framework,
               "--model", str(model), "--data", str(data), "--rows", str(args.rows),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    path = os.pathsep.join(p for p in (f"{ROOT / 'src'}", str(ROOT),
                                       os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": path, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "WANDB_MODE": "offline"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{framework} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def compare(args: argparse.Namespace) -> None:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise SystemExit("benchmarks.vlm_trl needs TRL: pip install trl==1.16.0")
    work = Path(tempfile.mkdtemp(prefix="vlm_trl_"))
    model, data = prepare(work, args.records)
    print(f"against TRL: tiny LLaVA (gangtrain.tiny.vision), {args.records} colour records, "
          f"{args.rows} rows a step (ours packed into rows of {args.seq_len}, TRL one record "
          f"a row padded), {args.steps} timed steps after one warm-up, AdamW, fp32, one "
          f"thread, {args.rounds} alternated rounds")
    ratios: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        results = {name: run_once(args, name, model, data) for name in ("ours", "trl")}
        for name, r in results.items():
            print(f"round {round_ + 1} {name:4s}: {r['tokens_per_cpu_s']:,.0f} record tokens "
                  f"per CPU s ({r['tokens_per_s']:,.0f} per wall s), "
                  f"{r['answers_per_cpu_s']:,.0f} answer tokens per CPU s, peak RSS "
                  f"{r['peak_rss_mib']:,.0f} MiB", flush=True)
        for key, name in (("tokens_per_cpu_s", "record tokens per CPU s"),
                          ("answers_per_cpu_s", "answer tokens per CPU s"),
                          ("tokens_per_s", "record tokens per wall s"),
                          ("peak_rss_mib", "peak RSS")):
            ratios.setdefault(name, []).append(results["ours"][key] / results["trl"][key])
    for name, values in ratios.items():
        print(f"ours / TRL, {name}: median {statistics.median(values):.2f}x (rounds "
              f"{', '.join(f'{v:.2f}' for v in values)})")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vlm_trl")
    parser.add_argument("--worker", choices=("ours", "trl"))
    parser.add_argument("--model", type=Path)
    parser.add_argument("--data", type=Path)
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if args.worker:
        worker(args)
    else:
        compare(args)


if __name__ == "__main__":
    main()
