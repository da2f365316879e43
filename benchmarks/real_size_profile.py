"""Where one full-SFT step's time and memory go at the size users train: the pieces of our
SFT step (the recipe's model loading, unit, fused AdamW, clipping) timed one by one in CPU
seconds, with the resident memory after each, and the step's top operators from
`torch.profiler`.

    .venv/bin/python -m benchmarks.real_size_profile MODEL_DIR [--seq-len 512] [--steps 3]
        [--loss-chunk-size N] [--no-ops]

MODEL_DIR: a HF model directory, e.g. the one `benchmarks.real_size` leaves in its work
directory (`WORK/model`). One thread, fp32, one packed row of `--seq-len` tokens a step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def rss_gib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in GiB."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 2**20
    return values["VmRSS"], values["VmHWM"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_size_profile")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss-chunk-size", type=int, default=None)
    parser.add_argument("--no-ops", action="store_true")
    parser.add_argument("--resume", type=Path, default=None,
                        help="a checkpoints directory: profile loading its newest step instead")
    args = parser.parse_args()

    import torch

    from gangs import FakeGang, setup_gangs
    from gangtrain.models.hf.document_attention import use_document_attention
    from gangtrain.models.hf.layout import load_layout
    from units.causal_lm import CausalLMUnit
    from units.metrics import MetricBag

    torch.set_num_threads(1)
    start = time.process_time()
    gangs = setup_gangs(FakeGang())
    model = load_layout(str(args.model_dir), gangs, data_parallel=None,
                        num_accumulate=1).model
    use_document_attention(model)
    print(f"load: {time.process_time() - start:.2f} CPU s; RSS {rss_gib()[0]:.2f} GiB, "
          f"peak {rss_gib()[1]:.2f}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if args.resume is not None:
        profile_resume(args.resume, model, optimizer, gangs)
        return
    unit = CausalLMUnit(model, loss_chunk_size=args.loss_chunk_size)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (1, args.seq_len), generator=generator)
    batch = {"input_ids": ids, "target_ids": torch.roll(ids, -1, 1).masked_fill(
        torch.arange(args.seq_len) == args.seq_len - 1, -100),
        "position_ids": torch.arange(args.seq_len)[None]}
    params = [p for p in model.parameters() if p.requires_grad]

    def step(report: bool) -> None:
        marks = [("start", time.process_time(), *rss_gib())]
        loss, n = unit(batch, MetricBag())
        marks.append(("forward", time.process_time(), *rss_gib()))
        (loss / n).backward()
        marks.append(("backward", time.process_time(), *rss_gib()))
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        marks.append(("clip", time.process_time(), *rss_gib()))
        optimizer.step()
        marks.append(("optimizer", time.process_time(), *rss_gib()))
        optimizer.zero_grad(set_to_none=True)
        marks.append(("zero_grad", time.process_time(), *rss_gib()))
        if report:
            print(f"loss {float(loss / n):.7f}; " + "; ".join(
                f"{name} {t - t0:.2f} s (RSS {rss:.2f}, peak {peak:.2f} GiB)"
                for (_, t0, _, _), (name, t, rss, peak) in zip(marks, marks[1:], strict=False))
                + f"; step {marks[-1][1] - marks[0][1]:.2f} CPU s")

    for _ in range(args.steps):
        step(report=True)
    if not args.no_ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=False) as prof:
            step(report=False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def profile_resume(checkpoints: Path, model, optimizer, gangs) -> None:  # noqa: ANN001
    """The newest checkpoint of `checkpoints` loaded into the model and optimizer, under
    cProfile (CPU clock): where a resume's time goes."""
    import cProfile
    import pstats

    from trainer.checkpoint.manager import CheckpointManager

    manager = CheckpointManager(checkpoints, gangs)
    profiler = cProfile.Profile(timer=time.process_time)
    wall = time.perf_counter()
    profiler.enable()
    step = manager.find_latest()
    manager.load(step, model, optimizer)
    profiler.disable()
    print(f"load of step {step}: {time.perf_counter() - wall:.2f} wall s; RSS "
          f"{rss_gib()[0]:.2f} GiB, peak {rss_gib()[1]:.2f}")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
