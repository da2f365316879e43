"""Image records into batches (`gangtrain.data.vision`), on tiny LLaVA, Gemma 3, Idefics3 and
Qwen2-VL / Qwen2.5-VL with their own processors: only answer tokens are targets, the planned length is the encoded one,
packed = padded = a float64 forward of each record alone, freezing and LoRA's targets by
part, and bad records named by file, line and field."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from vlm_reference import answer_nll64, answer_positions, processor_of

from gangtrain.data import vision
from gangtrain.layers.lora import LoraSettings, apply_lora
from gangtrain.models.hf import vision as parts
from gangtrain.models.hf.dummy_image import run_tower_without_images
from gangtrain.tiny.vision import make_colour_data, make_tiny_vlm
from trainer.errors import UserError
from units.causal_lm import lm_loss


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_colour_data(tmp_path_factory.mktemp("vlm_data"), n=6, seed=1)


@pytest.mark.parametrize("family", ["llava", "gemma3", "idefics3", "qwen2_vl", "qwen2_5_vl"])
def test_packed_equals_padded_equals_float64_one_by_one(family, data, tmp_path):
    model_dir = make_tiny_vlm(tmp_path / family, family)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    parts.prepare_for_packed_rows(model)  # Gemma 3's masks, Qwen-VL's M-RoPE per record
    processor = processor_of(model_dir)
    records = vision.read_records(data)
    examples = [vision.encode(processor, r, family) for r in records]
    tokens = processor.tokenizer.convert_tokens_to_ids
    sizes: dict = {}
    for record, example in zip(records, examples, strict=True):
        # Targets: exactly the tokens after each <|assistant|> through its <|end|>.
        ids = example.tokens["input_ids"].tolist()
        expected = answer_positions(ids, tokens("<|assistant|>"), tokens("<|end|>"))
        assert torch.nonzero(example.trained).flatten().tolist() == expected
        assert vision.planned_length(processor, record, sizes) == len(example)
    pad = processor.tokenizer.pad_token_id
    rows = [examples[:3], examples[3:]]
    seq_len = max(sum(len(e) for e in row) for row in rows) + 3  # padding at the tails
    packed = vision.packed_batch(rows, seq_len, pad, family)
    padded = vision.padded_batch(examples, pad, family)
    if family == "gemma3":  # everything the processor returns reaches the model
        assert "token_type_ids" in packed and int(packed["token_type_ids"].sum()) > 0
    if family.startswith("qwen"):
        assert {"mm_token_type_ids", "image_grid_thw"} <= set(packed) and \
            int(packed["mm_token_type_ids"].sum()) > 0
    with torch.no_grad():
        packed_sum, packed_n = lm_loss(model, packed, -100, use_cache_keyword=True)
        padded_sum, padded_n = lm_loss(model, padded, -100, use_cache_keyword=True)
    reference, count = answer_nll64(model_dir, data)
    assert int(packed_n) == int(padded_n) == count
    # float32 against float64: each NLL's relative error is a few eps32 per reduction term
    # (attention over <= seq_len keys, the hidden size 32), then a sum over `count` terms.
    tol = reference * torch.finfo(torch.float32).eps * (4 * seq_len + count)
    print(f"{family}: packed {float(packed_sum):.7f} padded {float(padded_sum):.7f} "
          f"float64 {reference:.9f} (tolerance {tol:.1e})")
    assert abs(float(packed_sum) - reference) <= tol
    assert abs(float(padded_sum) - reference) <= tol


def test_freeze_and_lora_targets_by_part(tmp_path):
    model_dir = make_tiny_vlm(tmp_path / "llava", "llava")
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    found = parts.vlm_parts(model)
    assert found == {"vision": ["model.vision_tower"],
                     "projector": ["model.multi_modal_projector"],
                     "language": ["model.language_model"], "head": ["lm_head"]}
    frozen = parts.freeze(model, ["vision_tower"])
    assert frozen and all(n.startswith("model.vision_tower.") for n in frozen)
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    targets = parts.lora_targets(model)
    assert len(targets) == 4 and all(t.startswith("model.language_model.") for t in targets)
    adapted = apply_lora(model, LoraSettings(r=2, alpha=4, target_modules=targets))
    assert not any("lora" in n for n, _ in adapted.named_parameters()
                   if n.startswith("model.vision_tower."))
    assert "vision 0 trained / " in parts.trained_summary(adapted)
    with pytest.raises(UserError, match="'model.freeze': 'nothing.*' matches no parameter"):
        parts.freeze(model, ["nothing.*"])


def test_qwen_vl_parts_generation_and_missing_mm_token_type_ids(data, tmp_path):
    model_dir = make_tiny_vlm(tmp_path / "qwen2_5_vl", "qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    # The projector (the patch merger) lives inside the tower: its own part.
    assert parts.vlm_parts(model) == {
        "vision": ["model.visual.patch_embed", "model.visual.blocks"],
        "projector": ["model.visual.merger"], "language": ["model.language_model"],
        "head": ["lm_head"]}
    parts.prepare_for_packed_rows(model)
    processor = processor_of(model_dir)
    example = vision.encode(processor, vision.read_records(data)[0], "qwen2_5_vl")
    batch = vision.packed_batch([[example]], None, processor.tokenizer.pad_token_id)
    # Generation (a cache, positions going on from it) is left to the model: the same tokens.
    plain = AutoModelForImageTextToText.from_pretrained(model_dir)
    prompt = processor(text=[processor.apply_chat_template(
        vision.read_records(data)[0].messages[:1], tokenize=False, add_generation_prompt=True)],
        images=[[Image.open(vision.read_records(data)[0].images[0]).convert("RGB")]],
        return_tensors="pt", add_special_tokens=False)
    assert torch.equal(model.generate(**prompt, max_new_tokens=4, do_sample=False),
                       plain.generate(**prompt, max_new_tokens=4, do_sample=False))
    del batch["mm_token_type_ids"]  # Qwen2.5-VL alone would take text positions silently
    with pytest.raises(ValueError, match="no mm_token_type_ids: the M-RoPE positions"):
        lm_loss(model, batch, -100, use_cache_keyword=True)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_records_are_named_by_file_line_and_field(data, tmp_path):
    good = json.loads(data.read_text().splitlines()[1])
    image = str(data.parent / good["images"][0])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    cases = {
        "url": ({**good, "images": ["https://example.com/a.png"]},
                "field 'images[0]' is a URL (https://example.com/a.png)"),
        "missing": ({**good, "images": ["gone.png"]},
                    f"field 'images[0]': cannot read image {tmp_path / 'gone.png'}"),
        "unreadable": ({**good, "images": ["broken.png"]},
                       f"field 'images[0]': cannot read image {tmp_path / 'broken.png'}"),
        "count": ({**good, "images": [image, image]},
                  "field 'images' holds 2 image(s), 'messages' has 1 image part(s)"),
    }
    for name, (record, message) in cases.items():
        path = _write(tmp_path / f"{name}.jsonl", [{**good, "images": [image]}, record])
        with pytest.raises(UserError) as caught:
            vision.read_records(path)
        assert str(caught.value) == f"data file {path}, line 2: {message}" or \
            str(caught.value).startswith(f"data file {path}, line 2: {message}"), name


def test_prompt_completion_trains_the_completion_only(data, tmp_path):
    model_dir = make_tiny_vlm(tmp_path / "llava", "llava")
    processor = AutoProcessor.from_pretrained(model_dir)
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    two_turns = next(r for r in lines if len(r["messages"]) == 4)
    split = {"prompt": two_turns["messages"][:3], "completion": two_turns["messages"][3:],
             "images": [str(data.parent / two_turns["images"][0])]}
    [record] = vision.read_records(_write(tmp_path / "pc.jsonl", [split]))
    example = vision.encode(processor, record, "llava")
    ids = example.tokens["input_ids"].tolist()
    tokens = processor.tokenizer.convert_tokens_to_ids
    answers = answer_positions(ids, tokens("<|assistant|>"), tokens("<|end|>"))
    last = ids.index(tokens("<|assistant|>"), ids.index(tokens("<|assistant|>")) + 1)
    assert torch.nonzero(example.trained).flatten().tolist() == \
        [p for p in answers if p > last]  # the second answer; the first is prompt


def test_over_long_records_are_dropped_and_counted(data, tmp_path):
    from gangtrain.posttrain.objectives.sft import SFTConfig
    from gangtrain.posttrain.objectives.sft_images import prepare_image_data

    model_dir = make_tiny_vlm(tmp_path / "llava", "llava")
    processor = AutoProcessor.from_pretrained(model_dir)
    records = vision.read_records(data)
    lengths = [vision.planned_length(processor, r, {}) for r in records]
    seq_len = sorted(lengths)[len(lengths) // 2]  # about half the records are longer
    config = SFTConfig.model_validate({"model": {"path": str(model_dir)}, "data": {
        "files": [str(data)], "valid_files": [str(data)], "seq_len": seq_len,
        "batch_size": 1}})
    reader, valid, train_bins, valid_bins, summary = prepare_image_data(
        config, processor, "llava")
    longer = sum(n > seq_len for n in lengths)
    assert longer and train_bins.num_dropped == valid_bins.num_dropped == longer
    assert f"0 truncated, {longer} dropped as longer than data.seq_len={seq_len}" in summary[0]
    kept = {i for b in range(len(train_bins)) for i in train_bins.bin(b).tolist()}
    assert kept == {i for i, n in enumerate(lengths) if n <= seq_len}


def _text_only_file(data, tmp_path):
    lines = [json.loads(line) for line in data.read_text().splitlines()]
    text_only = {"messages": [{"role": "user", "content": [{"type": "text", "text": "it"}]},
                              {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
    for r in lines:
        r["images"] = [str(data.parent / name) for name in r["images"]]
    return _write(tmp_path / "mixed.jsonl", [*lines, text_only])


def test_a_text_only_record_makes_a_batch_without_images_on_any_number_of_ranks(data, tmp_path):
    from gangtrain.posttrain.objectives.sft import SFTConfig
    from gangtrain.posttrain.objectives.sft_images import prepare_image_data

    model_dir = make_tiny_vlm(tmp_path / "llava", "llava")
    processor = AutoProcessor.from_pretrained(model_dir)
    path = _text_only_file(data, tmp_path)
    config = SFTConfig.model_validate({"model": {"path": str(model_dir)}, "data": {
        "files": [str(path)], "valid_files": [str(path)], "batch_size": 2,
        "packing": False}})
    for dp_size in (1, 2):  # under DP a rank without an image runs a dummy (models.hf)
        reader = prepare_image_data(config, processor, "llava", 0, dp_size)[0]
        assert len(reader.bins) == 7  # one record a row, the text-only one too
    bare = next(b for b in range(7) if reader.bins.bin(b).tolist() == [6])
    batch = reader.dataset.batch(reader.bins, [bare], processor.tokenizer.pad_token_id)
    assert "pixel_values" not in batch and int((batch["labels"] != -100).sum()) == 2


@pytest.mark.parametrize("family", ["llava", "llava_layer_-2", "gemma3", "idefics3",
                                    "qwen2_vl"])
def test_the_dummy_image_pass_changes_no_loss_or_gradient(family, data, tmp_path):
    """A micro-batch without images: the loss and every gradient are bit for bit those of
    the model without the dummy pass, and the tower and projector get zero gradients where
    they got none: exactly the parameters a batch with an image gives a gradient (LLaVA-1.5's
    `vision_feature_layer=-2` too, whose tower's last layer gets none)."""
    family, _, layer = family.partition("_layer_")
    model_dir = make_tiny_vlm(tmp_path / family, family)
    if layer:
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(
            {**config, "vision_feature_layer": int(layer)}))
    processor = processor_of(model_dir)
    pad = processor.tokenizer.pad_token_id
    bare = vision.padded_batch([vision.encode(processor, r, family) for r in
                                vision.read_records(_text_only_file(data, tmp_path))[-1:]],
                               pad, family)
    with_image = vision.padded_batch([vision.encode(processor, vision.read_records(data)[0],
                                                    family)], pad, family)

    def run(batch, dummy: bool):
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
        if dummy:
            run_tower_without_images(model, processor)
        loss, _ = lm_loss(model, batch, -100, use_cache_keyword=True)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    (plain_loss, plain), (loss, grads) = run(bare, False), run(bare, True)
    assert torch.equal(plain_loss, loss)
    for name, grad in grads.items():
        if plain[name] is not None:
            assert torch.equal(plain[name], grad), name
        elif grad is not None:
            assert not grad.any(), name  # the tower and projector: zero
    _, imaged = run(with_image, False)
    assert {n for n, g in grads.items() if g is None} == \
        {n for n, g in imaged.items() if g is None}


def test_loader_workers_make_the_same_batches_outside_the_training_process(tmp_path,
                                                                         monkeypatch):
    import os

    from gangtrain.posttrain.objectives.sft import SFTConfig
    from gangtrain.posttrain.objectives.sft_images import prepare_image_data

    model_dir = make_tiny_vlm(tmp_path / "qwen2_vl", "qwen2_vl")
    processor = processor_of(model_dir)
    data = make_colour_data(tmp_path / "data", n=32, seed=3)
    pids = tmp_path / "pids"
    encode = vision.encode

    def encode_noting_the_process(*args, **kwargs):
        with pids.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return encode(*args, **kwargs)

    monkeypatch.setattr(vision, "encode", encode_noting_the_process)
    made = {}
    for workers in (None, 2):
        config = SFTConfig.model_validate({"model": {"path": str(model_dir)}, "data": {
            "files": [str(data)], "valid_files": [str(data)], "batch_size": 2,
            "seq_len": 64, "num_workers": workers}})
        reader, valid = prepare_image_data(config, processor, "qwen2_vl")[:2]
        pids.write_text("")
        first = iter(reader)
        batches = [next(first), next(first), next(first)]
        position = reader.state_dict()
        # A position loaded mid-epoch (as at a resume) takes effect at the next batch: the
        # workers' batches made ahead are dropped.
        reader.load_state_dict({**position, "batch_index": 1})
        batches += [*first, *reader, *valid]  # the epoch's rest, the next epoch, validation
        made[workers] = batches, position, reader.state_dict()
        in_process = [int(p) == os.getpid() for p in pids.read_text().split()]
        assert in_process and (all(in_process) if workers is None else not any(in_process))
    (plain, *plain_state), (loaded, *loaded_state) = made[None], made[2]
    assert plain_state == loaded_state
    assert len(plain) == len(loaded) > 4
    for a, b in zip(plain, loaded, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_part_lr_steps_each_part_at_its_own_rate(data, tmp_path):
    from gangtrain.posttrain.objectives.sft import SFTConfig

    model_dir = make_tiny_vlm(tmp_path / "llava", "llava")
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    processor = AutoProcessor.from_pretrained(model_dir)
    batch = vision.padded_batch([vision.encode(processor, r, "llava")
                                 for r in vision.read_records(data)],
                                processor.tokenizer.pad_token_id, "llava")
    config = SFTConfig.model_validate({"optimizer": {
        "name": "SGD", "lr": 0.1, "part_lr": {"projector": 0.0, "vision_tower": 0.01}}})
    optimizer = config.optimizer.build(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, _ = lm_loss(model, batch, -100, use_cache_keyword=True)
    loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        lr = 0.0 if "multi_modal_projector" in name else 0.01 if "vision_tower" in name \
            else 0.1
        # SGD: p - lr * grad, one float32 multiply and subtract per element (exact for lr 0).
        # (A parameter the forward does not use, CLIP's post_layernorm, has no gradient.)
        expected = before[name] if p.grad is None else before[name] - lr * p.grad
        assert torch.allclose(p.detach(), expected, rtol=0, atol=1e-7), name
        if lr == 0.0:
            assert torch.equal(p.detach(), before[name]), name
