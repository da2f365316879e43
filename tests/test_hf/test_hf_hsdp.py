"""HSDP (`setup_gangs(dp_shard_size=2)` on 4 real Gloo ranks: FSDP2 shards over pairs and
replicates across them) trains HF GPT-2 to the parameters of one process; its checkpoint
(DCP) resumes under DDP on 2 ranks and in one process, and an FSDP2 one resumes under HSDP.
"""

from __future__ import annotations

import shutil
from functools import partial

from hf_models import tiny_gpt2, train
from ranks import run_ranks

# Measured: HSDP 2x2 ends 1.2e-6 from the one-process parameters (DDP and FSDP2: 1.1e-6,
# tests/test_hf/test_hf_data_parallel.py); validation losses within 1e-7.
PARAM_TOL, LOSS_TOL = 3e-6, 1e-6


def assert_close_to(results, reference) -> float:
    ref_loss, ref_params, _ = reference
    gap = 0.0
    for loss, params, _ in results:
        assert abs(loss - ref_loss) < LOSS_TOL
        for name, value in ref_params.items():
            gap = max(gap, (params[name] - value).abs().max().item())
    assert gap < PARAM_TOL
    return gap


def test_hsdp_2x2_matches_one_process():
    reference = train(tiny_gpt2)
    hsdp = run_ranks(partial(train, tiny_gpt2, "fsdp", dp_shard_size=2), world_size=4)
    print(f"HSDP 2x2 parameter gap to one process: {assert_close_to(hsdp, reference):.1e}")


def test_hsdp_checkpoint_resumes_under_ddp_and_one_process(tmp_path):
    reference = train(tiny_gpt2, max_num_steps=4)
    first = tmp_path / "hsdp"
    run_ranks(partial(train, tiny_gpt2, "fsdp", dp_shard_size=2, max_num_steps=2,
                      output_dir=first, checkpoint_every_n_steps=2), world_size=4)
    assert (first / "checkpoints" / "step_2" / "manifest.json").exists()
    ddp_dir, one_dir = tmp_path / "ddp", tmp_path / "one"
    shutil.copytree(first, ddp_dir)
    shutil.copytree(first, one_dir)

    ddp = run_ranks(partial(train, tiny_gpt2, "ddp", output_dir=ddp_dir,
                            checkpoint_every_n_steps=2), world_size=2)
    one = train(tiny_gpt2, output_dir=one_dir, checkpoint_every_n_steps=2)
    assert [run.num_batches for run in [*ddp, one]] == [2, 2, 2]  # steps 3 and 4 only
    print(f"resumed from HSDP: DDP gap {assert_close_to(ddp, reference):.1e}, "
          f"one process gap {assert_close_to([one], reference):.1e}")
    for out in (ddp_dir, one_dir):
        assert (out / "checkpoints" / "step_4" / "manifest.json").exists()


def test_fsdp_checkpoint_resumes_under_hsdp(tmp_path):
    reference = train(tiny_gpt2, max_num_steps=4)
    run_ranks(partial(train, tiny_gpt2, "fsdp", max_num_steps=2, output_dir=tmp_path,
                      checkpoint_every_n_steps=2), world_size=2)
    hsdp = run_ranks(partial(train, tiny_gpt2, "fsdp", dp_shard_size=2, output_dir=tmp_path,
                             checkpoint_every_n_steps=2), world_size=4)
    assert [run.num_batches for run in hsdp] == [2] * 4
    print(f"FSDP2 -> HSDP gap to one process: {assert_close_to(hsdp, reference):.1e}")
