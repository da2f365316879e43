"""Every family's one-process step-1 gradient through our real path equals a float64 autograd
reference of the unmodified transformers model.

Ours: the model directory loaded as `recipes.sft` loads it (`load_layout`, then per-document
attention for packed rows), so with every gradient-path shortcut it installs (the tied
embedding's rows added in place, the recomputed gated MLP, the head at trained positions
only), and the stock unit's summed loss divided by its target count, as the Trainer divides.
The reference: `AutoModelForCausalLM.from_config` in float64 with the same weights, a plain
cross-entropy summed over the trained targets, divided by their count. A shortcut that does
not hold for a family (Gemma's scaled embedding) shows here as a gradient off by far more
than float32 rounding; each family with a tied and an untied head, on packed and padded
batches as `gangtrain.data.collate` makes them.

Tolerance: float32 forward and backward against float64, so each gradient element carries
rounding of about eps32 x sqrt(n) for its reductions of length n (at most 128 here: the
vocabulary, the 64 tokens, the intermediate width), a few times over through 4 layers.
Measured 2.2e-7 to 8.1e-7 (Gemma 3; the plain families 2.2e-7 to 3.7e-7, with or without the
chunked head); Gemma's tied embedding without its `embed_scale` was 3.3e-1 to 4.0e-1 off.

Then each shortcut refuses by name (a log line, or the chunked head's error) what it cannot
prove equal, and the tied Gemma 2 of issue 66 through `python -m recipes.sft` gives one
step-1 gradient norm on one process, DDP2 and CP2.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from model_families import FAMILIES, VOCAB, save_tokenizer, tiny_model
from recipe_runs import describe, run_all
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP

from gangs import FakeGang, setup_gangs
from gangtrain.data.collate import IGNORE_INDEX, packed_batch, padded_batch
from gangtrain.models.hf import hf_model_of, load_pretrained
from gangtrain.models.hf.document_attention import use_document_attention
from gangtrain.models.hf.gated_mlp import recompute_gated_activations
from gangtrain.models.hf.layout import load_layout
from trainer.observe.recorders import read_jsonl
from units.causal_lm import CausalLMUnit, output_logits
from units.metrics import MetricBag

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

EPS32 = torch.finfo(torch.float32).eps
LONGEST_REDUCTION = 128  # the vocabulary's log-sum-exp; the tokens (64) and widths are shorter
# float32 rounding grows as the square root of a sum's length (independent roundings); a few
# times that for the 4 layers and softmaxes the gradient passes through (module docstring).
TOLERANCE = 4 * EPS32 * LONGEST_REDUCTION ** 0.5  # 5.4e-6


def _examples(count: int, seed: int, shortest: int = 6) -> list[tuple[list[int], list[int]]]:
    """Chat-like examples of `shortest` to 14 tokens: a prompt (not trained) then an answer
    (trained)."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        length = int(torch.randint(shortest, 15, (), generator=g))
        prompt = int(torch.randint(2, length - 2, (), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        examples.append((ids, [0] * prompt + [1] * (length - prompt)))
    return examples


BATCHES = {
    # 2 rows of 32, several examples a row, the rest padding (positions restarting)
    "packed": packed_batch([_examples(3, 1), _examples(2, 2)], seq_len=32, pad_id=0),
    # At most 3 padding tokens a row: with more, a padding query in Gemma 2's window of 4
    # sees no key, and transformers' eager softmax (float32 whatever the dtype) turns the
    # float64 reference's mask into -inf there: NaN (the float32 model's mask stays finite).
    "padded": padded_batch(_examples(4, 3, shortest=11), pad_id=0),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """Each family's directory as `save_pretrained` writes it, with an untied and a tied
    head (every family here can tie)."""
    base = tmp_path_factory.mktemp("gradients")
    dirs = {}
    for family in FAMILIES:
        for tied in (False, True):
            config = tiny_model(family).config
            config.tie_word_embeddings = tied
            torch.manual_seed(0)
            model = type(tiny_model(family))(config)
            directory = base / f"{family}_{'tied' if tied else 'untied'}"
            model.save_pretrained(directory)
            dirs[family, tied] = directory
    return dirs


def ours(directory: Path, batch: dict[str, torch.Tensor], **unit_options) -> nn.Module:
    """The model as `recipes.sft` builds it on one process, after one backward of the
    stock unit's loss over its target count."""
    layout = load_layout(str(directory), setup_gangs(FakeGang()), data_parallel=None,
                         num_accumulate=1)
    use_document_attention(hf_model_of(layout.model))  # as the recipe does for packed rows
    loss, num_targets = CausalLMUnit(layout.model, **unit_options)(batch, MetricBag())
    (loss / num_targets).backward()
    return layout.model


def reference(directory: Path, weights: nn.Module, batch: dict[str, torch.Tensor]) -> nn.Module:
    """transformers' own model in float64 with `weights`' values, after one backward of
    the mean cross-entropy over the trained targets."""
    from transformers import AutoConfig, AutoModelForCausalLM

    # experts: transformers' loop over experts, whose grouped matmul takes no float64
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory),
                                             dtype=torch.float64, experts_implementation="eager")
    model.load_state_dict(weights.state_dict())
    model.train()
    keywords = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    logits = output_logits(model(batch["input_ids"], **keywords, use_cache=False))[:, :-1]
    targets = batch["labels"][:, 1:]
    if "attention_mask" in batch:
        targets = targets.masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE_INDEX)
    trained = targets != IGNORE_INDEX
    loss = nn.functional.cross_entropy(logits[trained], targets[trained], reduction="sum")
    (loss / trained.sum()).backward()
    return model


def gradient_error(model: nn.Module, expected: nn.Module) -> float:
    """|g - g_ref| / |g_ref| over every parameter's gradient at once."""
    grads = dict(model.named_parameters())
    diff = total = 0.0
    for name, p in expected.named_parameters():
        ours_grad = grads[name].grad
        assert ours_grad is not None, f"{name}: no gradient on our path"
        diff += (ours_grad.double() - p.grad).square().sum().item()
        total += p.grad.square().sum().item()
    return (diff / total) ** 0.5


@pytest.mark.parametrize("form", sorted(BATCHES))
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_step_one_gradient_equals_the_float64_reference(model_dirs, family, tied, form):
    batch = BATCHES[form]
    directory = model_dirs[family, tied]
    model = ours(directory, batch)
    error = gradient_error(model, reference(directory, model, batch))
    print(f"{family} {'tied' if tied else 'untied'} {form}: relative error {error:.1e}")
    assert error < TOLERANCE, (family, tied, form, error)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_chunked_head_gives_the_reference_or_is_refused(model_dirs, family, tied):
    """An explicit `loss_chunk_size` (below the rows' targets: several chunks): the same
    gradient, or refused by name where the model changes its logits after its head."""
    batch = BATCHES["packed"]
    directory = model_dirs[family, tied]
    try:
        model = ours(directory, batch, loss_chunk_size=16)
    except ValueError as refusal:
        assert family == "gemma2" and "final_logit_softcapping" in str(refusal), refusal
        return
    error = gradient_error(model, reference(directory, model, batch))
    print(f"{family} {'tied' if tied else 'untied'} chunked: relative error {error:.1e}")
    assert error < TOLERANCE, (family, tied, error)


# -------------------------------------------------------------------------------------------
# Each shortcut refuses by name what it cannot prove equal, and the plain path then gives
# the reference's gradient.


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_scaled_tied_embedding_keeps_autograds_gradient_and_says_why(model_dirs, family,
                                                                        caplog):
    with caplog.at_level(logging.INFO, logger="gangtrain"):
        model = load_pretrained(model_dirs[family, True], setup_gangs(FakeGang()),
                                data_parallel=None)
    embedding = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is embedding.weight  # tied
    assert not getattr(embedding, "adds_rows_into_gradient", False)
    assert f"tied embedding {type(embedding).__name__}: its gradient stays" in caplog.text


def _plain_gated_grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model(ids).logits.square().mean().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_the_gated_mlp_is_recomputed_only_where_its_forward_is_the_plain_line(monkeypatch,
                                                                              caplog):
    """A hook on one activation, and then a class whose forward is another line: each
    refused by name, and the gradients stay the module's own."""
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))

    def doubled(module, args, output):
        return output * 2

    plain, recomputed = tiny_model("llama"), tiny_model("llama")
    for model in (plain, recomputed):
        model.model.layers[0].mlp.act_fn.register_forward_hook(doubled)
    with caplog.at_level(logging.INFO, logger="gangtrain"):
        assert recompute_gated_activations(recomputed) == 3  # the hooked layer keeps its own
    assert "gated MLP LlamaMLP: its activation is not recomputed (hooks on" in caplog.text
    expected, grads = _plain_gated_grads(plain, ids), _plain_gated_grads(recomputed, ids)
    assert all(torch.equal(expected[n], grads[n]) for n in expected)

    def scaled(self, x):  # not the plain line: a factor the recomputation would skip
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)

    monkeypatch.setattr(LlamaMLP, "forward", scaled)
    plain, recomputed = tiny_model("llama"), tiny_model("llama")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gangtrain"):
        assert recompute_gated_activations(recomputed) == 0
    assert "its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))" in caplog.text
    expected, grads = _plain_gated_grads(plain, ids), _plain_gated_grads(recomputed, ids)
    assert all(torch.equal(expected[n], grads[n]) for n in expected)


def _scale_head_output(module, args, output):  # a logit scale the chunked head cannot see
    return output * 0.5


def _scale_head_input(module, args):  # the same, on the head's input
    return (args[0] * 0.5,)


def _scale_logits_in_place(module, args, output):  # the same, written over the head's output
    output.logits.mul_(0.5)


@pytest.mark.parametrize(("hooked", "hook", "named"), [
    ("head", _scale_head_output, "changes its logits after its head"),
    ("head_input", _scale_head_input, "changes its logits after its head"),
    ("model", _scale_logits_in_place, "changes its logits after its head"),
])
def test_the_chunked_head_refuses_logits_changed_where_it_cannot_see(model_dirs, hooked, hook,
                                                                     named):
    """A hook that scales the head's output or input, or writes over the logits in place
    (the empty output the chunked head leaves: the same tensor, so only its version shows
    it). A hook that only looks (tests/test_units/test_trained_positions.py) is no change."""
    layout = load_layout(str(model_dirs["llama", False]), setup_gangs(FakeGang()),
                         data_parallel=None, num_accumulate=1)
    model = layout.model
    if hooked == "head_input":
        model.get_output_embeddings().register_forward_pre_hook(hook)
    else:
        (model.get_output_embeddings() if hooked == "head" else model).register_forward_hook(hook)
    with pytest.raises(ValueError, match="loss_chunk_size") as refusal:
        CausalLMUnit(model, loss_chunk_size=16)(BATCHES["packed"], MetricBag())
    assert named in str(refusal.value)


# -------------------------------------------------------------------------------------------
# The Gemma 2 run of the issue, through `recipes.sft` on three layouts.


def _chat_lines(path: Path, count: int) -> Path:
    """TRL `messages` conversations in the words of `save_tokenizer`'s vocabulary."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 40, (n,), generator=g))

    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": words(6)}, {"role": "assistant", "content": words(5)}]})
        + "\n" for _ in range(count)))
    return path


def test_tied_gemma2_sft_has_one_step_one_gradient_norm_on_one_process_ddp2_and_cp2(
        model_dirs, tmp_path):
    model = save_tokenizer(model_dirs["gemma2", True])
    args = ["--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{_chat_lines(tmp_path / 'chat.jsonl', 40)}]",
            "--set", "data.seq_len=64", "--set", "trainer.max_num_steps=1",
            "--set", "trainer.publish_metrics_every_n_steps=1", "--set", "gangs.timeout_s=60"]
    two = ["torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "recipes.sft"]
    procs = run_all({
        "one": ["recipes.sft", tmp_path / "one", *args],
        "ddp2": [*two, tmp_path / "ddp2", *args, "--set", "trainer.data_parallel=ddp"],
        "cp2": [*two, tmp_path / "cp2", *args, "--set", "gangs.cp_size=2"],
    })
    norms = {}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        norms[name] = read_jsonl(tmp_path / name / "metrics" / "train.jsonl")[0]["grad_norm"]
    print(f"step-1 gradient norms: {norms}")
    # The same float32 gradient summed in another order (over ranks, over cp's halves):
    # ~1e-7 relative (measured 1.0e-7); the missing embed_scale was 1.1e-1.
    for name in ("ddp2", "cp2"):
        assert norms[name] == pytest.approx(norms["one"], rel=1e-5), norms
