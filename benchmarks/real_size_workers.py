"""The processes of `benchmarks.real_size`, one run each: making the model and data, the
matmul rate, our recipes (`recipes.sft`, `recipes.preference`) and TRL's trainers on them.

Every run prints one ``RESULT {json}`` line: the CPU time of each step (`step_s`; one
thread, so a loaded machine's waits for a core do not count) and its wall time
(`step_wall_s`), the losses, the peak memory at the end of the last step (`train_peak_gib`:
what training held) and at the end of the process (`peak_gib`), the trainable and total
parameters. Our runs add the checkpoint's save and load times and bytes. The peak memory is
the resident set's (VmHWM) on a CPU, the caching allocator's peak reservation on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
LR = 1e-5
CLIP = 1.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peak_gib() -> float:
    """This process's peak memory so far (GiB): on a GPU what PyTorch's caching allocator
    reserved at most (what an out-of-memory error is measured against), else the peak
    resident set (Linux /proc)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_reserved() / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def gpu_sync() -> None:
    """Wait for the GPU's queued work (a step's end is when its kernels are done), if any."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


CLOCK: dict[str, Any] = {"steps": [], "cpu": [], "peaks": []}
"""What `StepClock` saw in this process (the recipe builds it by import path)."""


class StepClock:
    """Records each step's end and peak memory, the start of training, the end of each save:
    the recipe's real step, timed from outside it (`trainer.callbacks`)."""

    def on_train_start(self, trainer: Any) -> None:
        CLOCK["train_start"] = time.perf_counter()
        CLOCK["train_start_cpu"] = time.process_time()
        CLOCK["start_peak_gib"] = peak_gib()

    def on_step_end(self, trainer: Any) -> None:
        gpu_sync()
        CLOCK["steps"].append(time.perf_counter())
        CLOCK["cpu"].append(time.process_time())
        CLOCK["train_peak_gib"] = peak_gib()
        CLOCK["peaks"].append(CLOCK["train_peak_gib"])

    def on_checkpoint_saved(self, trainer: Any, step_nr: int, path: Any) -> None:
        CLOCK["saved"] = time.perf_counter()
        CLOCK["saved_cpu"] = time.process_time()
        CLOCK["saved_dir"] = str(path)


def make_inputs(work: Path, shape: dict[str, int], seq_len: int, dtype: str) -> None:
    """The model (random init, this shape, saved as safetensors with the tiny ChatML
    tokenizer: only a few hundred of its rows are ever a target, which changes no cost) and
    the data: text records longer than a row (one record a row, every token trained) and
    text pairs, every record the same (so both frameworks' first batches are the same
    tokens, whatever order each draws them in)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from gangtrain.tiny.chat import make_tiny_chat_model

    tiny = make_tiny_chat_model(work / "tokenizer_source")
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json" \
                or f.name == "chat_template.jinja":
            (model_dir / f.name).write_bytes(f.read_bytes())
    tiny_config = json.loads((tiny / "config.json").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max(seq_len, 1024), rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tiny_config["eos_token_id"],
        pad_token_id=tiny_config["pad_token_id"], use_cache=False,
        torch_dtype="bfloat16" if dtype == "bf16" else "float32")
    with torch.device("cpu"):
        model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    words = ("plus", "minus", "times")
    sentences = [f"What is {i % 19} {words[i % 3]} {(7 * i) % 17}? It is {i % 23}."
                 for i in range(seq_len)]  # ~8 tokens each: several rows' worth
    text = " ".join(sentences)
    with open(work / "sft.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": text}) + "\n")
    with open(work / "sft_valid.jsonl", "w") as f:
        f.write(json.dumps({"text": " ".join(sentences[:20])}) + "\n")
    # Pairs of about seq_len / 2 tokens a side (prompt and answer each about a quarter).
    quarter = max(2, seq_len // 32)
    pair = {"prompt": " ".join(sentences[:quarter]) + " Answer:",
            "chosen": " " + " ".join(sentences[quarter:2 * quarter]),
            "rejected": " " + " ".join(sentences[2 * quarter:3 * quarter])}
    for name, n in (("dpo.jsonl", 64), ("dpo_valid.jsonl", 2)):
        with open(work / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps(pair) + "\n")
    print("RESULT " + json.dumps({"parameters": model.num_parameters()}))


def matmul_rate(shape: dict[str, int], tokens: int, dtype: str, device: str) -> dict:
    """FLOP/s of the model's own matmuls (forward shapes of a layer and the head, weighted by
    their FLOPs), best of 3, on this device in the run's dtype; per CPU second on a CPU (one
    thread), per wall second on a GPU."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    import torch
    import torch.nn.functional as F

    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    kv = shape["kv_heads"] * h // shape["heads"]
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    shapes = [*(s for _ in range(shape["layers"]) for s in shapes), (h, v)]
    unique = {s: shapes.count(s) for s in set(shapes)}
    # A GPU's matmul of these shapes takes microseconds: time a run of them, not one launch.
    calls = 50 if device == "cuda" else 1
    total_flops, total_s = 0.0, 0.0
    for (n_in, n_out), count in unique.items():
        x = torch.randn(tokens, n_in, dtype=dt, device=device)
        w = torch.randn(n_out, n_in, dtype=dt, device=device)
        F.linear(x, w)  # warm-up: kernel choice
        best = float("inf")
        for _ in range(3):
            gpu_sync()
            start = clock()
            for _ in range(calls):
                F.linear(x, w)
            gpu_sync()
            best = min(best, (clock() - start) / calls)
        total_flops += 2 * tokens * n_in * n_out * count
        total_s += best * count
    return {"flops_per_s": total_flops / total_s}


def ours(kind: str, work: Path, args: Any) -> dict:
    """Our recipe on the work dir's model and data: `kind` sft, lora or dpo; `resume`: the sft
    run again, one step further (it resumes from the checkpoint the sft run left)."""
    out = work / f"ours_{'sft' if kind == 'resume' else kind}"
    common = [
        "--set", f"model.path={work / 'model'}", "--set", f"data.cache_dir={work / 'cache'}",
        "--set", f"data.seq_len={args.seq_len}", "--set", f"optimizer.lr={LR}",
        "--set", "optimizer.betas=[0.9,0.999]", "--set", "optimizer.weight_decay=0.0",
        "--set", "lr_scheduler.warmup_steps=0", "--set", "lr_scheduler.final_lr_scale=1.0",
        "--set", f"trainer.max_gradient_norm={CLIP}", "--set", f"trainer.dtype={args.dtype}",
        "--set", "trainer.num_threads=1", "--set", "trainer.progress=false",
        "--set", "trainer.publish_metrics_every_n_steps=1", "--set", "trainer.seed=0",
        "--set", "trainer.validate_at_end=false", "--set", "trainer.max_num_valid_batches=1",
        "--set", "trainer.keep_last_n_checkpoints=1", "--set", "trainer.keep_best_n_checkpoints=null",
        "--set", "trainer.callbacks=[{name: 'benchmarks.real_size_workers:StepClock'}]"]
    steps = args.steps + (1 if kind == "resume" else 0)
    common += ["--set", f"trainer.max_num_steps={steps}",
               "--set", f"trainer.validate_every_n_steps={10 * steps}",
               # only the sft run saves (at its last step), for the checkpoint figures
               "--set", "trainer.checkpoint_every_n_steps="
               + (str(args.steps) if kind in ("sft", "resume") else str(10 * steps))]
    if kind in ("sft", "lora", "resume"):
        from recipes.sft.recipe import cli

        argv = [str(out), "--set", f"data.files=[{work / 'sft.jsonl'}]",
                "--set", f"data.valid_files=[{work / 'sft_valid.jsonl'}]",
                "--set", "data.batch_size=1", "--set", "data.valid_batch_size=1", *common]
        if kind == "lora":
            argv += ["--set", "lora.r=16", "--set", "lora.alpha=32",
                     "--set", f"lora.target_modules={json.dumps(LORA_TARGETS)}"]
    else:
        from recipes.preference.recipe import cli

        argv = [str(out), "--set", f"data.files=[{work / 'dpo.jsonl'}]",
                "--set", f"data.valid_files=[{work / 'dpo_valid.jsonl'}]",
                "--set", f"data.batch_size={args.pairs}", "--set", "data.valid_batch_size=1",
                "--set", "loss.kind=dpo", "--set", "loss.beta=0.1", *common]
    if kind != "resume":
        argv.append("--overwrite")
    load_timer = _time_checkpoint_load()
    code = cli(argv)
    if code != 0:
        raise SystemExit(f"our {kind} recipe exited {code}")
    train = [json.loads(line) for line in open(out / "metrics" / "train.jsonl")]
    steps_at, cpu_at = CLOCK["steps"], CLOCK["cpu"]
    result = {"step_s": intervals(CLOCK["train_start_cpu"], cpu_at),
              "step_wall_s": intervals(CLOCK["train_start"], steps_at),
              "losses": [r["loss"] for r in train], "train_peak_gib": CLOCK["train_peak_gib"],
              "step_peaks_gib": CLOCK["peaks"], "start_peak_gib": CLOCK["start_peak_gib"],
              "first_step_end_s": steps_at[0] - START,
              "train_start_s": CLOCK["train_start"] - START,
              "train_start_cpu_s": CLOCK["train_start_cpu"]}
    if "saved" in CLOCK and kind == "sft":
        step_dir = Path(CLOCK["saved_dir"])
        result["save_s"] = CLOCK["saved"] - steps_at[-1]
        result["save_cpu_s"] = CLOCK["saved_cpu"] - cpu_at[-1]
        result["checkpoint_bytes"] = sum(f.stat().st_size for f in step_dir.rglob("*")
                                         if f.is_file())
        result["checkpoint_dir"] = str(step_dir)
    if load_timer:
        result["load_s"] = sum(load_timer)
    return result


def intervals(start: float, ends: list[float]) -> list[float]:
    return [b - a for a, b in zip([start, *ends], ends, strict=False)]


def _time_checkpoint_load() -> list[float]:
    """Times the resume's read of the checkpoint in this process: the checksums verified and
    the state loaded (`CheckpointManager.load_latest`, `find_latest` and `load`, the
    outermost call of each nest)."""
    from trainer.checkpoint.manager import CheckpointManager

    took: list[float] = []
    depth = [0]

    def timed(method: Any) -> Any:
        def wrapper(self: Any, *a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            depth[0] += 1
            try:
                return method(self, *a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    took.append(time.perf_counter() - start)
        return wrapper

    for name in ("load_latest", "find_latest", "load"):
        setattr(CheckpointManager, name, timed(getattr(CheckpointManager, name)))
    return took


def trl(kind: str, work: Path, args: Any) -> dict:
    """TRL's SFTTrainer (sft, lora: peft's LoRA on the same projections) or DPOTrainer (dpo,
    a frozen copy as the reference) on the same model, data and settings."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    times: list[float] = []
    cpu: list[float] = []
    peaks: list[float] = []
    start_box: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            start_box[:] = [time.perf_counter(), time.process_time()]

        def on_step_end(self, *a: Any, **k: Any) -> None:
            gpu_sync()
            times.append(time.perf_counter())
            cpu.append(time.process_time())
            peaks.append(peak_gib())

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    data_file = "sft.jsonl" if kind in ("sft", "lora") else "dpo.jsonl"
    train = datasets.load_dataset("json", data_files=str(work / data_file), split="train",
                                  cache_dir=str(work / "trl_cache"))
    common = dict(output_dir=tempfile.mkdtemp(dir=work), max_steps=args.steps,
                  learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                  max_grad_norm=CLIP, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                  optim="adamw_torch_fused", logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=args.device == "cpu", bf16=args.dtype == "bf16",
                  fp16=False, dataloader_num_workers=0, seed=0, disable_tqdm=True,
                  max_length=args.seq_len)
    peft_config = None
    if kind == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    if kind in ("sft", "lora"):
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, per_device_train_batch_size=1, packing=True,
                           packing_strategy="bfd", dataset_text_field="text")
        trainer = SFTTrainer(model=model, args=config, train_dataset=train,
                             processing_class=tokenizer, peft_config=peft_config,
                             callbacks=[StepTimes()])
    else:
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**common, per_device_train_batch_size=args.pairs, beta=0.1,
                           disable_dropout=True)
        trainer = DPOTrainer(model=model, args=config, train_dataset=train,
                             processing_class=tokenizer, callbacks=[StepTimes()])
    torch.set_num_threads(1)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return {"step_s": intervals(start_box[1], cpu), "step_wall_s": intervals(start_box[0], times),
            "losses": losses, "train_peak_gib": peaks[-1], "step_peaks_gib": peaks,
            "first_step_end_s": times[0] - START,
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}


def worker(role: str, work: Path, args: Any) -> None:
    import torch

    torch.set_num_threads(1)
    if role == "make":
        make_inputs(work, args.shape, args.seq_len, args.dtype)
        return
    if role == "matmul":
        result = matmul_rate(args.shape, args.seq_len, args.dtype, args.device)
    else:
        framework, kind = role.split(":")
        result = (ours if framework == "ours" else trl)(kind, work, args)
    result["peak_gib"] = peak_gib()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no teardown of a 10 GB process to wait for
