"""Tokenising runs in several processes by default where there are cores and records enough
(`data.sft.tokenizing_processes`), and gives the table one process gives."""

from __future__ import annotations

import json
import os

import pytest
from transformers import AutoTokenizer

from gangtrain.data.sft import RECORDS_PER_PROCESS, tokenize_files, tokenizing_processes
from gangtrain.tiny.chat import chat_conversations, make_tiny_chat_model


def test_default_processes_follow_cores_and_records():
    cores = len(os.sched_getaffinity(0))
    assert tokenizing_processes(RECORDS_PER_PROCESS - 1) is None
    expected = min(cores, 8, 2)
    assert tokenizing_processes(2 * RECORDS_PER_PROCESS) == (expected if expected > 1 else None)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one process")
def test_several_processes_give_one_processs_table(tmp_path, monkeypatch):
    monkeypatch.setattr("data.sft.RECORDS_PER_PROCESS", 60)  # a short file still splits
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_chat_model(tmp_path / "model"))
    path = tmp_path / "chat.jsonl"
    num = 120
    path.write_text("".join(json.dumps({"messages": m}) + "\n"
                            for m in chat_conversations(num, seed=3)))
    default = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "a")
    one = tokenize_files([path], tokenizer, name="tiny", cache_dir=tmp_path / "b", num_proc=1)
    assert default.dataset.cache_files and len(default.dataset.cache_files) == 2  # 2 shards
    assert default.dataset["input_ids"] == one.dataset["input_ids"]
    assert default.dataset["trained"] == one.dataset["trained"]
