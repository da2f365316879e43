"""`python -m recipes.sft` at the door: every bad input is one `error:` line naming the file,
the 1-based line (or record) and the field, exit 2, no traceback, and nothing written; a
failed command leaves a finished run's directory byte for byte as it was.

Each bad file is a good conversation file (the tiny preset's kind) with one line spoilt, so
the message must find that line among good ones; the commands run in this process through
`recipes.sft.recipe.cli`, the command line's own function (a subprocess each would cost the
interpreter's start-up 30 times over)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from gangtrain.tiny.chat import chat_conversations, make_tiny_chat_model, write_chat_data
from recipes.sft.config import SFTConfig
from recipes.sft.recipe import cli, load_tokenizer

GOOD = chat_conversations(12, seed=5)
USER = {"role": "user", "content": "What is 1 plus 1?"}
ANSWER = {"role": "assistant", "content": "1 plus 1 is 2."}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(model directory, datasets cache)."""
    base = tmp_path_factory.mktemp("sft_inputs")
    return make_tiny_chat_model(base / "model"), base / "cache"


def chat_lines(bad_line: int, bad: object, num: int = 12) -> str:
    """``num`` good conversation lines, line ``bad_line`` (1-based) replaced by ``bad``
    (a record, or raw text when a str)."""
    lines = [json.dumps({"messages": c}) for c in (GOOD * 2)[:num]]
    lines[bad_line - 1] = bad if isinstance(bad, str) else json.dumps(bad)
    return "\n".join(lines) + "\n"


def deep_text_file() -> str:
    lines = [json.dumps({"text": f"document {i}"}) for i in range(20_000)]
    lines[19_998] = json.dumps({"text": None})
    return "\n".join(lines) + "\n"


def json_array(bad_index: int, bad: object) -> str:
    records = [{"messages": c} for c in GOOD[:4]]
    records[bad_index] = bad
    return json.dumps(records)


# (case, file name, file content, what the message names: line/record, field)
BAD_FILES = [
    ("empty file", "data.jsonl", "", "is empty", None),
    ("blank lines only", "data.jsonl", "\n\n  \n", "blank lines only", None),
    ("malformed line 7", "data.jsonl", chat_lines(7, '{"messages": [oops'), "line 7",
     "not valid JSON"),
    ("malformed line 20,000", "data.jsonl",
     "".join(json.dumps({"text": f"d {i}"}) + "\n" for i in range(19_999)) + "{oops\n",
     "line 20000", "not valid JSON"),
    ("not an object", "data.jsonl", chat_lines(3, '"just a string"'), "line 3",
     "not a record"),
    ("no messages", "data.jsonl", chat_lines(7, {"conversation": [USER, ANSWER]}), "line 7",
     "'messages'"),
    ("messages empty", "data.jsonl", chat_lines(4, {"messages": []}), "line 4", "'messages'"),
    ("message not an object", "data.jsonl", chat_lines(5, {"messages": ["hi", ANSWER]}),
     "line 5", "'messages'[0]"),
    ("no role", "data.jsonl", chat_lines(2, {"messages": [{"content": "hi"}, ANSWER]}),
     "line 2", "'role'"),
    ("no content", "data.jsonl", chat_lines(6, {"messages": [{"role": "user"}, ANSWER]}),
     "line 6", "'messages'[0] has no 'content'"),
    ("assistant content null", "data.jsonl",
     chat_lines(8, {"messages": [USER, {"role": "assistant", "content": None}]}), "line 8",
     "'messages'[1] has no 'content'"),
    ("content a number", "data.jsonl",
     chat_lines(9, {"messages": [{"role": "user", "content": 42}, ANSWER]}), "line 9",
     "'messages'[0] 'content' is a number"),
    ("content a list of parts", "data.jsonl",
     chat_lines(10, {"messages": [USER, {"role": "assistant",
                                         "content": [{"type": "text", "text": "2"}]}]}),
     "line 10", "'messages'[1] 'content' is a list"),
    ("content an object", "data.jsonl",
     chat_lines(12, {"messages": [USER, {"role": "assistant", "content": {"text": "2"}}]}),
     "line 12", "'messages'[1] 'content' is an object"),
    ("unknown role", "data.jsonl",
     chat_lines(11, {"messages": [{"role": "robot", "content": "beep"}, ANSWER]}), "line 11",
     "role 'robot'"),
    ("tool calls the template drops", "data.jsonl",
     chat_lines(3, {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "calc", "arguments": "{}"}}]}]}),
     "line 3", "'tool_calls'"),
    ("prompt messages, completion a string", "data.jsonl",
     json.dumps({"prompt": [USER], "completion": [ANSWER]}) + "\n"
     + json.dumps({"prompt": [USER], "completion": "2"}) + "\n", "line 2", "'completion'"),
    ("prompt null", "data.jsonl",
     json.dumps({"prompt": "a", "completion": "b"}) + "\n"
     + json.dumps({"prompt": None, "completion": "b"}) + "\n", "line 2", "'prompt'"),
    ("text null deep in a big file", "data.jsonl", deep_text_file(), "line 19999", "'text'"),
    ("JSON array, a bad record", "data.json",
     json_array(2, {"messages": [{"role": "user", "content": None}, ANSWER]}), "record 3",
     "'content'"),
]


def run(out: Path, tiny, *extra: str) -> int:
    model, cache = tiny
    return cli([str(out), "--preset", "tiny", "--set", f"model.path={model}",
                "--set", f"data.cache_dir={cache}", *extra])


def assert_one_error(capsys, *named: str | None) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for part in named:
        assert part is None or part in lines[0], (part, lines[0])
    return lines[0]


@pytest.mark.parametrize("case, name, content, where, field", BAD_FILES,
                         ids=[c[0] for c in BAD_FILES])
def test_a_bad_data_file_is_one_message_naming_file_line_and_field(
        tiny, tmp_path, capsys, case, name, content, where, field):
    path = tmp_path / name
    path.write_text(content)
    out = tmp_path / "out"
    assert run(out, tiny, "--set", f"data.files=[{path}]") == 2
    assert_one_error(capsys, str(path), where, field)
    assert not (out / "config.yaml").exists()  # checked before anything is written


def test_bad_validation_file_and_model_directories_are_named(tiny, tmp_path, capsys):
    model, _ = tiny
    good = write_chat_data(tmp_path / "good.jsonl", 40)
    bad = tmp_path / "valid.jsonl"
    bad.write_text(chat_lines(5, {"messages": [USER, {"role": "bot", "content": "x"}]}))
    cases = {
        "valid file": (["--set", f"data.valid_files=[{bad}]"], [str(bad), "line 5", "'bot'"]),
        "missing valid file": (["--set", f"data.valid_files=[{tmp_path / 'no.jsonl'}]"],
                               ["data.valid_files", "no.jsonl"]),
    }
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(model, no_tokenizer,
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "vocab*",
                                                  "merges*"))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    cases["no tokenizer"] = ([f"--set=model.path={no_tokenizer}"],
                             [str(no_tokenizer), "tokenizer files"])
    cases["no weights"] = ([f"--set=model.path={no_weights}"],
                           [str(no_weights), "model.safetensors"])
    cases["template file missing"] = (["--set", "data.chat_template=chat.jinja"],
                                      ["data.chat_template", "chat.jinja"])
    cases["eos token not in the vocabulary"] = (["--set", "data.eos_token=<|eot|>"],
                                                ["data.eos_token", "<|eot|>"])
    for case, (extra, named) in cases.items():
        out = tmp_path / case.replace(" ", "_")
        assert run(out, tiny, "--set", f"data.files=[{good}]", *extra) == 2, case
        assert_one_error(capsys, *named)
        assert not (out / "config.yaml").exists(), case


def test_chatml_by_name_and_mixed_formats_are_accepted(tiny, tmp_path):
    from gangtrain.posttrain.objectives.sft import prepare_data

    model, cache = tiny
    chat = write_chat_data(tmp_path / "chat.jsonl", 30)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {i} plus 1?",
                                         "completion": f" {i + 1}."}) + "\n"
                             for i in range(30)))
    config = SFTConfig.model_validate({
        "model": {"path": str(model)},
        "data": {"files": [str(chat), str(pairs)], "chat_template": "chatml",
                 "cache_dir": str(cache), "seq_len": 256, "batch_size": 4}})
    tokenizer = load_tokenizer(config)
    assert tokenizer.chat_template.startswith("{% for message in messages %}")
    data = prepare_data(config, tokenizer)
    assert "examples (chat, prompt_completion)" in data.summary[0], data.summary


# -------------------------------------------------------------------------------------------
# A failed command changes nothing


def digests(directory: Path) -> dict[str, str]:
    """sha256 of every file (and each symlink's target) under ``directory``, the lock file
    aside."""
    found = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            found[name] = f"-> {path.readlink()}"
        elif path.is_file() and not path.name.endswith(".lock"):
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            found[name] = "dir"
    return found


def test_failed_commands_leave_a_finished_run_byte_identical(tiny, tmp_path, capsys):
    model, _ = tiny
    chat = write_chat_data(tmp_path / "chat.jsonl", 80)
    out = tmp_path / "run"
    steps = ["--set", "trainer.max_num_steps=4", "--set", "trainer.validate_every_n_steps=2",
             "--set", "trainer.checkpoint_every_n_steps=2"]
    assert run(out, tiny, "--set", f"data.files=[{chat}]", *steps) == 0
    capsys.readouterr()
    before = digests(out)
    assert {"config.yaml", "hf", "checkpoints", "metrics"} <= set(before)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat_lines(4, '{"messages": [oops'))
    broken_model = tmp_path / "broken_model"
    shutil.copytree(model, broken_model)
    (broken_model / "config.json").write_text("{not json")
    failing = {
        "missing valid file": ["--set", f"data.files=[{chat}]",
                               "--set", f"data.valid_files=[{tmp_path / 'missing.jsonl'}]"],
        "bad data with --overwrite": ["--set", f"data.files=[{bad}]", "--overwrite"],
        "bad data, resumed": ["--set", f"data.files=[{chat}]",
                              "--set", f"data.valid_files=[{bad}]", "--resume"],
        "bad model directory": ["--set", f"data.files=[{chat}]",
                                "--set", f"model.path={broken_model}", "--overwrite"],
        "bad config": ["--set", f"data.files=[{chat}]", "--set", "data.seq_len=-3",
                       "--overwrite"],
        "a schedule without a length": ["--set", f"data.files=[{chat}]", "--overwrite",
                                        "--set", "trainer.max_num_steps=null"],
    }
    for case, extra in failing.items():
        assert run(out, tiny, *extra) == 2, case
        assert_one_error(capsys)
        assert digests(out) == before, case
