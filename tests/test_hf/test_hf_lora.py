"""LoRA adapters (`layers.lora`) on a pretrained LLaMA loaded by `load_pretrained(lora=...)`
and trained by the real Trainer: FSDP2, DDP, HSDP and TP on 2 Gloo ranks give one process's
losses with the same adapters on every rank; checkpoints hold the adapters and their optimizer
state only and refuse a base whose files changed; the end of a run writes peft's adapter
directory and the merged HF directory, which `PeftModel.from_pretrained` and
`from_pretrained` load to the trained model's logits."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from hf_models import SPECIAL, TRAIN, VALID, SampleReader, tiny_llama
from pretrained_dirs import INPUT_IDS
from ranks import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gangs import setup_gangs, setup_root_gang
from gangtrain.layers.lora import LoraSettings, init_adapter, lora_settings_of
from gangtrain.models.hf import load_pretrained
from gangtrain.parallel import param_groups
from gangtrain.parallel.materialize import seeded_init
from trainer.errors import UserError
from trainer.observe.recorders import JsonlRecorder, read_jsonl
from trainer.trainer import Trainer
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit

STEPS = 50
LORA = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    torch.manual_seed(5)
    directory = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(directory)
    return directory


def train_lora(directory: Path, output_dir: Path, *, tp_size: int = 1,
               data_parallel: str | None = "fsdp", dp_shard_size: int | None = None,
               max_num_steps: int = STEPS, lora: LoraSettings = LORA,
               activation_checkpointing: bool = False, **options):
    """Load `directory` with adapters and train them through the Trainer (validation and a
    checkpoint at the end only: the best checkpoint is the trained model); returns rank 0's
    train losses, this rank's full adapters and the trained model's logits."""
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, dp_shard_size=dp_shard_size)
    load_options = {"activation_checkpointing": True} if activation_checkpointing else {}
    model = load_pretrained(directory, gangs, data_parallel=data_parallel, lora=lora, seed=3,
                            **load_options)
    optimizer = torch.optim.AdamW(param_groups(model), lr=2e-2, eps=1e-6)
    rank, size = gangs.dp.rank, gangs.dp.size
    Trainer(
        CausalLMUnit(model), SampleReader(TRAIN, 8, rank, size), optimizer,
        output_dir=output_dir, gangs=gangs, max_num_steps=max_num_steps,
        valid_units=[CausalLMEvalUnit(model)],
        valid_data_readers=[SampleReader(VALID, 8, rank, size, shuffle=False)],
        score_metric="valid/loss", validate_every_n_steps=max_num_steps,
        checkpoint_every_n_steps=max_num_steps, publish_metrics_every_n_steps=1,
        recorders=[JsonlRecorder(output_dir)], progress=False, **options,
    ).run()
    adapters = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in getattr(model, "module", model).named_parameters()  # DDP's
                if p.requires_grad}
    with torch.no_grad():
        logits = model.eval()(INPUT_IDS).logits
    losses = [r["loss"] for r in read_jsonl(output_dir / "metrics" / "train.jsonl")] \
        if gangs.root.rank == 0 else []
    return losses, adapters, logits


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the ranks have: two OpenMP threads make the tiny ops of
    this model many times slower on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return out, *train_lora(llama_dir, out, data_parallel=None)
    finally:
        torch.set_num_threads(threads)


def test_only_adapters_train_from_peft_init(llama_dir, one_process):
    """The base is frozen and the adapters start as peft starts them (B zero, A Kaiming from
    the seed), so the first loss is the base model's; training moves it."""
    _, losses, adapters, _ = one_process
    assert sorted({name.rsplit(".", 3)[-3] for name in adapters}) == sorted(LORA.target_modules)
    assert len(adapters) == 2 * 2 * len(LORA.target_modules)  # 2 layers, A and B each
    gangs = setup_gangs(setup_root_gang())
    fresh = load_pretrained(llama_dir, gangs, data_parallel=None, lora=LORA, seed=3)
    assert lora_settings_of(fresh) == LORA
    init = seeded_init(3, init_adapter)
    for name, p in fresh.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, init(name, p)), name
            if "lora_A" in name:  # Kaiming-uniform: bound sqrt(6 / ((1 + 5) fan_in))
                assert 0.9 < p.abs().max() * p.shape[1] ** 0.5 <= 1, name
            else:
                assert not p.any(), name
    base = AutoModelForCausalLM.from_pretrained(llama_dir)
    with torch.no_grad():
        assert torch.equal(fresh(INPUT_IDS).logits, base(INPUT_IDS).logits)
    assert losses[-1] < losses[0] - 0.1, losses  # measured 4.58 -> 4.45


@pytest.mark.parametrize(("kind", "options"), [
    ("fsdp2_recompute", {"activation_checkpointing": True}),
    ("ddp2", {"data_parallel": "ddp"}),
    ("hsdp_1x2", {"dp_shard_size": 1}),
    ("tp2", {"tp_size": 2, "data_parallel": None}),
])
def test_layouts_match_one_process(llama_dir, one_process, tmp_path, kind, options):
    """50 steps on 2 ranks: every train loss within 1e-5 relative of one process's, the
    adapters the same on both ranks (bit for bit) and within float error of one process's
    (FSDP2 with each block recomputed in backward)."""
    _, reference, ref_adapters, ref_logits = one_process
    results = run_ranks(partial(train_lora, llama_dir, tmp_path / kind, **options),
                        world_size=2, timeout=300)
    losses = results[0][0]
    assert len(losses) == STEPS
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    adapter_gap = max(((results[0][1][k] - v).abs().max() / v.abs().max()).item()
                      for k, v in ref_adapters.items())
    print(f"{kind}: loss gap {gap:.1e}, adapter gap {adapter_gap:.1e} (of its largest value)")
    # Measured: losses 1.8-3.2e-7 relative, adapters 1.1-2.6e-5 of their largest value (sums in
    # another order; Adam's first steps turn near-zero gradients into whole steps).
    assert gap < 1e-5
    assert adapter_gap < 1e-4
    for name, value in results[0][1].items():
        assert torch.equal(value, results[1][1][name]), name
    assert (results[0][2] - ref_logits).abs().max() < 1e-4


def test_checkpoint_holds_adapters_and_their_optimizer_state_only(one_process, tmp_path):
    """A whole checkpoint directory is within 2x of the adapters plus their AdamW moments
    (rank r=16 on q_proj and v_proj of a LLaMA of width 256, whose 5 MB base is referenced
    by its path and its files' digests, not copied)."""
    torch.manual_seed(0)
    base = tmp_path / "llama256"
    config = LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=16, use_cache=False, **SPECIAL)
    LlamaForCausalLM(config).save_pretrained(base)
    out = tmp_path / "out"
    lora = LoraSettings(r=16, target_modules=("q_proj", "v_proj"))
    _, adapters, _ = train_lora(base, out, data_parallel=None, max_num_steps=2, lora=lora)
    trained = 3 * sum(v.numel() * v.element_size() for v in adapters.values())  # + 2 moments
    step_dir = out / "checkpoints" / "step_2"
    saved = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    base_size = (base / "model.safetensors").stat().st_size
    print(f"adapters + moments {trained:,} B, checkpoint {saved:,} B, base {base_size:,} B")
    assert saved < 2 * trained < base_size / 5  # measured: 441,082 B, 1.28x
    reference = json.loads((step_dir / "hf" / "lora_base.json").read_text())
    assert reference["path"] == str(base.resolve())
    assert list(reference["files"]) == ["model.safetensors"]
    assert reference["files"]["model.safetensors"]["size"] == base_size


def test_exports_load_with_peft_and_from_pretrained(one_process, llama_dir):
    """OUT/adapter through `PeftModel.from_pretrained(base)` and the merged OUT/hf through
    `from_pretrained` give the trained model's logits; OUT/hf holds no adapter files (which
    would make transformers load it as an adapter)."""
    from peft import PeftModel

    out, _, _, trained = one_process
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir),
                                           out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        gaps = [(model(INPUT_IDS).logits - trained).abs().max().item()
                for model in (peft_model, merged)]
    print(f"|logits - trained|: peft {gaps[0]:.1e}, merged {gaps[1]:.1e}")
    assert max(gaps) < 1e-5
    assert sorted(p.name for p in (out / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    assert not (out / "hf" / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(llama_dir)
    with torch.no_grad():  # the adapters changed the model
        assert (base(INPUT_IDS).logits - trained).abs().max() > 1e-2


def test_resume_refuses_a_changed_base(llama_dir, tmp_path):
    """A base rewritten in place (same path, one weight changed) is refused by name when a
    run resumes from adapters trained on the old one; the unchanged base resumes."""
    base = tmp_path / "base"
    LlamaForCausalLM.from_pretrained(llama_dir).save_pretrained(base)
    out = tmp_path / "out"
    train_lora(base, out, data_parallel=None, max_num_steps=2)
    train_lora(base, out, data_parallel=None, max_num_steps=4)  # resumes from step 2
    model = LlamaForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.norm.weight[0] += 1.0
    model.save_pretrained(base)
    with pytest.raises(UserError, match=r"base model changed .*model\.safetensors has"):
        train_lora(base, out, data_parallel=None, max_num_steps=6)


def test_tp_with_adapter_dropout_and_unknown_targets_are_refused(llama_dir):
    gangs = setup_gangs(setup_root_gang())
    with pytest.raises(UserError, match="lora.target_modules: no layer .* named 'qkv'"):
        load_pretrained(llama_dir, gangs, lora=LoraSettings(target_modules=("q_proj", "qkv")))
    with pytest.raises(UserError, match="'model.embed_tokens' is a Embedding"):
        load_pretrained(llama_dir, gangs, lora=LoraSettings(target_modules=("embed_tokens",)))

    def tp_with_dropout():
        tp = setup_gangs(setup_root_gang(), tp_size=2)
        with pytest.raises(UserError, match="lora.dropout > 0 under tensor parallelism"):
            load_pretrained(llama_dir, tp, lora=LoraSettings(dropout=0.1))

    run_ranks(tp_with_dropout, world_size=2)


def test_frozen_bf16_base_trains_fp32_adapters(llama_dir, tmp_path):
    """dtype=bf16 keeps the frozen base in bf16 (half its memory) while the adapters, their
    gradients and AdamW's moments are float32."""
    gangs = setup_gangs(setup_root_gang())
    model = load_pretrained(llama_dir, gangs, data_parallel=None, dtype=torch.bfloat16,
                            lora=LORA)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    optimizer = torch.optim.AdamW(param_groups(model), lr=1e-2)
    loss = model(INPUT_IDS, labels=INPUT_IDS).loss
    loss.backward()
    optimizer.step()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    states = list(optimizer.state.values())
    assert len(states) == 2 * 2 * len(LORA.target_modules)
    assert all(s["exp_avg"].dtype == torch.float32 for s in states)



def test_same_start_check_covers_the_adapters(llama_dir, tmp_path):
    """An adapter changed on one DP rank after loading is refused by name when the Trainer
    is built, as any replicated parameter is (HSDP: 2 replicas of 1 shard)."""

    def build_trainer():
        gangs = setup_gangs(setup_root_gang(), dp_shard_size=1)
        model = load_pretrained(llama_dir, gangs, lora=LORA)
        if gangs.root.rank == 1:
            with torch.no_grad():
                model.model.layers[1].mlp.down_proj.lora_A.weight.to_local()[0, 0] += 1e-3
        optimizer = torch.optim.AdamW(param_groups(model))
        with pytest.raises(UserError, match=r"'model\.layers\.1\.mlp\.down_proj\.lora_A\."
                                            r"weight' differs between the data-parallel"):
            Trainer(CausalLMUnit(model), [], optimizer, output_dir=tmp_path / "o",
                    gangs=gangs, max_num_steps=1, progress=False)

    run_ranks(build_trainer, world_size=2)


@pytest.mark.parametrize("alpha", [8.0, 6.0])
def test_adapters_compute_what_peft_computes(llama_dir, alpha):
    """With the same weights, a model adapted here and peft's `get_peft_model` give the same
    logits and the same gradients of the adapters and of the embedding's output (same
    scaling, same layers, same names up to peft's adapter name), as close to peft's model in
    float64 as peft's own: ours scales the adapter's [tokens, r] input and adds the update
    inside the matmul, peft scales the update and adds it after (bit for bit on the machines
    measured when the scaling is a power of two, alpha 8 and r 4; where the sum is rounded
    is the BLAS's choice)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraSettings(r=LORA.r, alpha=alpha, target_modules=LORA.target_modules)
    gangs = setup_gangs(setup_root_gang())
    ours = load_pretrained(llama_dir, gangs, data_parallel=None, lora=lora)
    with torch.no_grad():  # B is zero at the start: give it values
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    theirs = get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir), LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules)))
    peft_name = {name: name.replace(".lora_A.", ".lora_A.default.").replace(
        ".lora_B.", ".lora_B.default.") for name, p in ours.named_parameters()
        if p.requires_grad}
    adapters = {peft_name[name]: p for name, p in ours.named_parameters() if p.requires_grad}
    missing, unexpected = theirs.base_model.model.load_state_dict(adapters, strict=False)
    assert unexpected == [] and not [k for k in missing if "lora_" in k]

    def outputs(model, named, dtype=torch.float32):
        """The logits, the gradients of the embedding's output and of each adapter (by
        peft's name) of `logsumexp(logits).sum()`."""
        embedded = model.get_input_embeddings()(INPUT_IDS).to(dtype).detach().requires_grad_()
        logits = model(inputs_embeds=embedded).logits
        logits.logsumexp(-1).sum().backward()
        grads = {peft_name.get(name, name): p.grad for name, p in named if p.requires_grad}
        return [logits.detach(), embedded.grad, *(grads[k] for k in sorted(grads))]

    mine = outputs(ours, ours.named_parameters())
    peft = outputs(theirs, theirs.base_model.model.named_parameters())
    equal = all(torch.equal(x, y) for x, y in zip(mine, peft, strict=True))
    theirs.zero_grad()
    exact = outputs(theirs.double(), theirs.base_model.model.named_parameters(), torch.float64)

    def error(xs):  # float32's error in each tensor (root mean square, relative), averaged
        return sum((torch.linalg.vector_norm(x - y) / torch.linalg.vector_norm(y)).item()
                   for x, y in zip(xs, exact, strict=True)) / len(exact)

    print(f"alpha {alpha}: error against float64, ours {error(mine):.2e}, peft's "
          f"{error(peft):.2e}; bit for bit: {equal}")
    # measured: alpha 8 bit for bit; alpha 6 ours 0.97x peft's (the same sums rounded in
    # another order)
    assert 0.0 < error(mine) < 1.25 * error(peft)


def test_adapter_update_adds_into_the_output_without_update_sized_tensors():
    """An adapted layer (plain weights) adds its update inside the matmul that makes the
    output: of the [tokens, out] tensors a step makes, only the base's output and the sum in
    forward, none in backward (the update and its scaled copy, one each way, were a
    quarter of a 0.5B LoRA step's fresh memory)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gangtrain.layers.lora import apply_lora

    tokens, width = 32, 256
    model = apply_lora(nn.Sequential(nn.Linear(64, width)),
                       LoraSettings(r=4, alpha=6, target_modules=("0",)))
    nn.init.normal_(model[0].lora_B.weight)
    x = torch.randn(tokens, 64, requires_grad=True)

    class OutputsOfUpdateSize(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor)}
            if isinstance(out, torch.Tensor) and out.numel() == tokens * width \
                    and out.untyped_storage().data_ptr() not in inputs:  # new, not a view
                self.count += 1
            return out

    gradient = torch.ones(tokens, width)
    with OutputsOfUpdateSize() as forward:
        y = model(x)
    with OutputsOfUpdateSize() as backward:
        y.backward(gradient)
    assert (forward.count, backward.count) == (2, 0)
    base = model[0]
    scaled_down = (x.detach() @ base.lora_A.weight.T) * 1.5
    expected = x.detach() @ base.weight.T + base.bias + scaled_down @ base.lora_B.weight.T
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-5)
