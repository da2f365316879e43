"""HSDP (`setup_gangs(dp_shard_size=2)` on 4 real Gloo ranks: FSDP2 shards over pairs and
replicates across them) trains HF GPT-2 to the parameters of one process; its checkpoint
(DCP) resumes under DDP on 2 ranks and in one process, and an FSDP2 one resumes under HSDP.
"""

from __future__ import annotations

import shutil
from functools import partial

from hf_models import sgd_gaps, start_parameters, tiny_gpt2, train
from ranks import run_ranks

# Trained under SGD with momentum (`train(sgd=True)`): AdamW's weights after steps are no
# float32 claim (tests/tolerances.py); gaps as fractions of what float32 allows, <= 1.


def assert_close_to(results, reference) -> float:
    loss_gap, param_gap = sgd_gaps(results, reference, start_parameters(tiny_gpt2))
    assert loss_gap <= 1 and param_gap <= 1, (loss_gap, param_gap)
    return param_gap


def test_hsdp_2x2_matches_one_process():
    reference = train(tiny_gpt2, sgd=True)
    hsdp = run_ranks(partial(train, tiny_gpt2, "fsdp", dp_shard_size=2, sgd=True), world_size=4)
    print(f"HSDP 2x2 parameter gap to one process (of float32's allowance): {assert_close_to(hsdp, reference):.2f}")


def test_hsdp_checkpoint_resumes_under_ddp_and_one_process(tmp_path):
    reference = train(tiny_gpt2, max_num_steps=4, sgd=True)
    first = tmp_path / "hsdp"
    run_ranks(partial(train, tiny_gpt2, "fsdp", dp_shard_size=2, max_num_steps=2,
                      output_dir=first, checkpoint_every_n_steps=2, sgd=True), world_size=4)
    assert (first / "checkpoints" / "step_2" / "manifest.json").exists()
    ddp_dir, one_dir = tmp_path / "ddp", tmp_path / "one"
    shutil.copytree(first, ddp_dir)
    shutil.copytree(first, one_dir)

    ddp = run_ranks(partial(train, tiny_gpt2, "ddp", output_dir=ddp_dir,
                            checkpoint_every_n_steps=2, sgd=True), world_size=2)
    one = train(tiny_gpt2, output_dir=one_dir, checkpoint_every_n_steps=2, sgd=True)
    assert [run.num_batches for run in [*ddp, one]] == [2, 2, 2]  # steps 3 and 4 only
    print(f"resumed from HSDP: DDP gap {assert_close_to(ddp, reference):.1e}, "
          f"one process gap {assert_close_to([one], reference):.1e}")
    for out in (ddp_dir, one_dir):
        assert (out / "checkpoints" / "step_4" / "manifest.json").exists()


def test_fsdp_checkpoint_resumes_under_hsdp(tmp_path):
    reference = train(tiny_gpt2, max_num_steps=4, sgd=True)
    run_ranks(partial(train, tiny_gpt2, "fsdp", max_num_steps=2, output_dir=tmp_path,
                      checkpoint_every_n_steps=2, sgd=True), world_size=2)
    hsdp = run_ranks(partial(train, tiny_gpt2, "fsdp", dp_shard_size=2, output_dir=tmp_path,
                             checkpoint_every_n_steps=2, sgd=True), world_size=4)
    assert [run.num_batches for run in hsdp] == [2] * 4
    print(f"FSDP2 -> HSDP gap to one process: {assert_close_to(hsdp, reference):.1e}")
