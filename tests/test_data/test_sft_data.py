"""The SFT data path apart from the recipe: formats and their errors, the tokenised cache,
best-fit packing, mixing, and readers that shard over DP ranks and resume exactly (also on
another DP size, or are refused by name)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoTokenizer

from gangtrain.data.example_packing import best_fit_decreasing
from gangtrain.data.formats import Fields
from gangtrain.data.mixing import hold_out, mix
from gangtrain.data.sft import plan_examples, tokenize_files
from gangtrain.data.token_batches import BinReader, plan_bins
from gangtrain.tiny.chat import make_tiny_chat_model
from trainer.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_chat_model(tmp_path_factory.mktemp("m")))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# -------------------------------------------------------------------------------------------
# Formats


def test_prompt_completion_trains_the_completion_and_end_token_only(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "What is 2 plus 3?", "completion": " 2 plus 3 is 5."},
        {"prompt": "What is 1 plus 1?", "completion": " 1 plus 1 is 2."}])
    t = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "c")
    assert t.format == "prompt_completion"
    row = t.dataset[0]
    prompt = tokenizer("What is 2 plus 3?", add_special_tokens=False)["input_ids"]
    completion = tokenizer(" 2 plus 3 is 5.", add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == prompt + completion + [tokenizer.eos_token_id]
    assert row["trained"] == [0] * len(prompt) + [1] * (len(completion) + 1)
    assert t.num_targets[0] == len(completion) + 1


def test_text_parquet_shards_in_a_directory(tokenizer, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    texts = [f"document {i} says {i * 7}" for i in range(6)]
    for k in range(2):
        pq.write_table(pa.table({"body": texts[3 * k : 3 * k + 3]}), shards / f"{k:03d}.parquet")
    t = tokenize_files([shards], tokenizer, name="tiny", cache_dir=tmp_path / "c",
                       fields=Fields(text="body"))
    assert t.format == "text" and len(t) == 6
    # The tiny tokenizer has no bos: text is `tokens [eos]`, every token trained.
    ids = tokenizer(texts[4], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert t.dataset[4]["input_ids"] == ids and all(t.dataset[4]["trained"])


def test_chat_in_a_json_file_with_tool_turns_and_missing_keys(tokenizer, tmp_path):
    conversation = [{"role": "user", "content": "What is 2 times 3?"},
                    {"role": "assistant", "content": "calc(2 times 3)", "name": None},
                    {"role": "tool", "content": "6"},
                    {"role": "assistant", "content": "2 times 3 is 6."}]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"messages": conversation}, {"messages": conversation[:2]}]))
    t = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "c")
    row = t.dataset[0]
    text = tokenizer.decode(row["input_ids"])
    assert "<|im_start|>tool\n6<|im_end|>" in text  # the tool turn, kept as text
    trained = tokenizer.decode([i for i, m in zip(row["input_ids"], row["trained"]) if m])
    assert trained == "calc(2 times 3)<|im_end|>2 times 3 is 6.<|im_end|>"


def test_a_wrong_field_is_named_with_the_fix(tokenizer, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl",
                       [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(UserError, match="field 'messages' .* holds messages, format text needs "
                                        "text: 'messages' holds conversations, read them with "
                                        "data.format=chat"):
        tokenize_files([chat], tokenizer, name="tiny", cache_dir=tmp_path / "c", fmt="text",
                       fields=Fields(text="messages"))
    other = write_jsonl(tmp_path / "other.jsonl", [{"body": "x"}])
    with pytest.raises(UserError, match=r"records with fields \['body'\] match no format"):
        tokenize_files([other], tokenizer, name="tiny", cache_dir=tmp_path / "c")


def test_tokenising_is_cached_for_the_next_run_and_redone_for_another_template(
        tokenizer, tmp_path):
    records = [{"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                             {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."}]}
               for i in range(3000)]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    start = time.perf_counter()
    cold = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "c")
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    warm = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "c")
    warm_s = time.perf_counter() - start
    assert warm.dataset.cache_files == cold.dataset.cache_files  # the same Arrow file
    assert np.array_equal(warm.lengths, cold.lengths)
    print(f"tokenising 3000 conversations: cold {cold_s:.2f} s, cached {warm_s:.3f} s")
    assert warm_s < cold_s / 3
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    try:
        other = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "c")
    finally:
        tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|> ",
                                                                  "<|im_start|>")
    assert other.dataset.cache_files != cold.dataset.cache_files
    assert other.dataset[0]["input_ids"] != cold.dataset[0]["input_ids"]


# -------------------------------------------------------------------------------------------
# Packing and mixing


def test_best_fit_decreasing_packs_every_example_once_and_counts_over_long():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.0, 0.8, 5000).astype(int) + 1, 3000)
    plan = best_fit_decreasing(lengths, 512, over_long="truncate")
    packed = np.sort(plan.examples)
    assert np.array_equal(packed, np.arange(len(lengths)))  # each example exactly once
    used = [plan.lengths[plan.row(r)].sum() for r in range(plan.num_rows)]
    assert max(used) <= 512
    assert plan.num_truncated == int((lengths > 512).sum()) > 0
    assert plan.efficiency() > 0.95
    dropped = best_fit_decreasing(lengths, 512, over_long="drop")
    assert dropped.num_dropped == plan.num_truncated
    assert len(dropped.examples) == len(lengths) - dropped.num_dropped
    # Packed window by window (bounded planning memory): every example once, as full.
    windowed = best_fit_decreasing(lengths, 512, window=1000)
    assert np.array_equal(np.sort(windowed.examples), np.arange(len(lengths)))
    assert windowed.efficiency() > 0.95
    # Never more rows than first-fit in arrival order would need.
    assert plan.num_rows <= _first_fit_rows(np.minimum(lengths, 512), 512)


def _first_fit_rows(lengths, capacity):
    rooms: list[int] = []
    for n in lengths:
        for i, room in enumerate(rooms):
            if room >= n:
                rooms[i] -= n
                break
        else:
            rooms.append(capacity - n)
    return len(rooms)


def test_mixing_follows_the_weights_and_is_deterministic():
    a, b = np.arange(100), np.arange(100, 400)
    mixed = mix([a, b], [0.75, 0.25], seed=1)
    assert len(mixed) == 400
    assert (mixed < 100).sum() == 300 and (mixed >= 100).sum() == 100  # a upsampled 3x
    assert np.array_equal(mixed, mix([a, b], [0.75, 0.25], seed=1))
    assert set(np.unique(mixed[mixed < 100])) == set(range(100))  # every example of a, 3x
    train, valid = hold_out(100, 0.1, seed=0)
    assert len(valid) == 10 and not set(train) & set(valid) and len(train) + 10 == 100
    with pytest.raises(UserError, match="data.weights' has 1 weights for 2 datasets"):
        mix([a, b], [1.0], seed=0)


# -------------------------------------------------------------------------------------------
# Readers: DP shards, exact resume, another DP size


def fake_dataset(n: int, seed: int = 0):
    """A `datasets.Dataset` of n examples of 3..40 tokens, all trained."""
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, 300, int(rng.integers(3, 41))).tolist() for _ in range(n)]
    return Dataset.from_dict({"input_ids": ids, "trained": [[1] * len(x) for x in ids]}), \
        np.array([len(x) for x in ids])


def rows_of(batch) -> list[tuple[int, ...]]:
    return [tuple(r.tolist()) for r in batch["input_ids"]]


def test_readers_shard_over_ranks_and_resume_exactly_on_another_dp_size():
    dataset, lengths = fake_dataset(300)
    bins = plan_bins(lengths, "packed", 64)
    # Two ranks: disjoint halves of each global batch of 4 rows, whose union is one
    # process's batch.
    one = BinReader(dataset, bins, 4, pad_id=0)
    ranks = [BinReader(dataset, bins, 4, 0, dp_rank=r, dp_size=2) for r in range(2)]
    ones, pairs = iter(one), [iter(r) for r in ranks]
    for _ in range(3):
        a, b = (rows_of(next(p)) for p in pairs)
        assert len(a) == len(b) == 2 and not set(a) & set(b)
        assert a + b == rows_of(next(ones))
    # The position saved by rank 0 of 2 goes on exactly in one process.
    state = ranks[0].state_dict()
    resumed = BinReader(dataset, bins, 4, pad_id=0)
    resumed.load_state_dict(state)
    assert rows_of(next(iter(resumed))) == rows_of(next(ones))
    # A token budget makes a global batch one bin per rank: another DP size is refused.
    budget = plan_bins(lengths, "padding_free", 64, max_tokens=256)
    saved = BinReader(dataset, budget, 2, 0, dp_rank=0, dp_size=2)
    next(iter(saved))
    with pytest.raises(UserError, match="the DP size changed"):
        BinReader(dataset, budget, 1, 0).load_state_dict(saved.state_dict())


def test_layouts_hold_the_same_targets():
    """Packed, padded and padding-free batches of the same examples hold the same targets
    (labels that are not -100), and packed rows restart positions at each example."""
    dataset, lengths = fake_dataset(40, seed=2)
    targets = {}
    for layout, max_tokens in (("packed", None), ("padded", None), ("padding_free", 400)):
        bins = plan_bins(lengths, layout, 64, max_tokens)
        reader = BinReader(dataset, bins, 1, pad_id=0, seed=0)
        labels = [b["labels"][b["labels"] != -100] for b in reader]
        targets[layout] = torch.cat(labels).sort().values
        if layout == "packed":
            batch = next(iter(reader))
            starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
            assert len(starts) >= 2 and batch["labels"][0, starts[1]] == -100
    assert torch.equal(targets["packed"], targets["padded"])
    assert torch.equal(targets["packed"], targets["padding_free"])
    assert len(targets["packed"]) == int((lengths - 1).sum())


def test_plan_leaves_out_examples_without_targets(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a b c", "completion": " d"},
                                               {"prompt": "x", "completion": ""}])
    t = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "c")
    bins, empty = plan_examples(t, np.arange(2), "packed", 32)
    # The empty completion still trains the end token: nothing is left out.
    assert empty == 0 and sorted(bins.examples.tolist()) == [0, 1]
