"""Build on meta, parallelise, materialise (`parallel.materialize`): the LM recipe's
initial parameters are bitwise those of one process on every layout, drawn by the model's
own rule, with ties, parameter markers and buffers intact."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.parallelize import parallelize_gpt
from gangtrain.parallel.materialize import local_slices, materialize, seeded_init
from recipes.lm.recipe import build_model

# vocab 37 and hidden 104 split unevenly over 4 FSDP ranks (19/18 rows over 2, 10/10/10/7).
CONFIG = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4, vocab_size=37,
                   mlp_ratio=3.25)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)  # DDP
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in inner.named_parameters()}


INPUT_IDS = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len),
                          generator=torch.Generator().manual_seed(0))


def build_on_ranks(tp_size: int = 1, dp_shard_size: int | None = None,
                   data_parallel: str = "fsdp") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The full initial parameters, and the logits of the parallel model (which use what
    FSDP2 / TP hold after materialising, not only what a gather returns)."""
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, dp_shard_size=dp_shard_size)
    model = build_model(CONFIG, gangs, data_parallel, seed=5)
    inner = getattr(model, "module", model)
    assert inner.output.weight is inner.tok_embeddings.weight  # still tied
    params = full_parameters(model)
    with torch.no_grad():
        return params, model(INPUT_IDS)


@pytest.fixture(scope="module")
def one_process() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return build_on_ranks()


@pytest.mark.parametrize("layout", [
    {"data_parallel": "fsdp"},                      # FSDP2 over 4 ranks
    {"data_parallel": "fsdp", "dp_shard_size": 2},  # HSDP 2 x 2
    {"data_parallel": "fsdp", "tp_size": 2},        # DP 2 x TP 2
    {"data_parallel": "ddp"},                       # DDP over 4 ranks
], ids=["fsdp", "hsdp2x2", "dp2xtp2", "ddp"])
def test_initial_parameters_are_bitwise_those_of_one_process(one_process, layout):
    ref_params, ref_logits = one_process
    for rank, (params, logits) in enumerate(run_ranks(lambda: build_on_ranks(**layout), 4)):
        assert params.keys() == ref_params.keys()
        for name, value in ref_params.items():
            assert torch.equal(params[name], value), f"rank {rank}: {name}"
        # TP sums its row-wise matmuls in another order: measured 1.2e-7 (0 otherwise).
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=5e-7)


def test_the_seed_changes_every_parameter_drawn(one_process):
    other = full_parameters(build_model(CONFIG, setup_gangs(setup_root_gang()), seed=6))
    for name, value in one_process[0].items():
        drawn = value.std() > 0  # norms are ones and zeros whatever the seed
        assert torch.equal(other[name], value) != drawn, name


def test_seeded_init_keeps_the_models_own_distributions():
    """Per parameter, the same distribution as `GPT.init_weights` (the model built eagerly):
    N(0, 0.02), N(0, 0.02/sqrt(2L)) for wo and w2, ones and zeros for the norms."""
    config = GPTConfig(seq_len=64, dim=128, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    eager = dict(GPT(config).named_parameters())
    with torch.device("meta"):
        model = GPT(config)
    materialize(model, "cpu", seeded_init(0, model.init_parameter))
    for name, p in model.named_parameters():
        reference = eager[name].detach()
        if reference.std() == 0:
            assert torch.equal(p, reference), name
            continue
        # >= 8k draws each: the standard deviation is within 3% (measured <= 1.8%).
        assert p.std().item() == pytest.approx(reference.std().item(), rel=0.03), name
        assert abs(p.mean().item()) < 0.05 * reference.std().item(), name  # measured 0.014


def test_mixture_of_experts_keeps_markers_ties_and_zeroed_buffers():
    config = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4, num_experts=4)
    with torch.device("meta"):
        model = GPT(config)
    materialize(model, "cpu", seeded_init(1, model.init_parameter))
    moe = model.layers[0].feed_forward
    assert moe.experts.w1.is_expert_param and moe.experts.w2.is_expert_param
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.equal(moe.tokens_per_expert, torch.zeros(4, dtype=torch.int64))
    assert moe.experts.w2.std() < moe.experts.w1.std()  # the residual projection's scale
    model(torch.randint(0, 256, (2, 16))).sum().backward()  # a usable model


class Rotary(nn.Module):
    """A parameter and a buffer the module computes itself (like a rotary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4))


def test_buffers_built_on_a_real_device_keep_their_values():
    with torch.device("meta"):
        model = Rotary()
    model.register_buffer("inv_freq", Rotary().inv_freq)  # computed on the host
    asked = []

    def source(name: str, like: torch.Tensor) -> torch.Tensor:
        asked.append(name)
        return torch.full(like.shape, 3.0)

    materialize(model, "cpu", source)
    assert asked == ["weight"]
    assert torch.equal(model.inv_freq, Rotary().inv_freq)
    assert torch.equal(model.weight, torch.full((4, 4), 3.0))


def test_a_source_of_the_wrong_shape_is_refused_naming_the_parameter():
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(ValueError, match=r"'weight' has shape \(4, 3\).*\(4, 4\)"):
        materialize(model, "cpu", lambda name, like: torch.zeros(4, 3))


def test_a_ddp_model_is_refused():
    def refused() -> str:
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(ValueError, match="before wrapping it with DDP") as error:
            materialize(model, "cpu", lambda name, like: torch.zeros(like.shape))
        return str(error.value)

    assert "materialize the model before" in run_ranks(refused, 1)[0]


MOE = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4, vocab_size=37, num_experts=4)


def moe_on_ranks(ep_size: int = 1, data_parallel: str = "ddp") -> dict[str, torch.Tensor]:
    gangs = setup_gangs(setup_root_gang(), ep_size=ep_size)
    model = build_model(MOE, gangs, data_parallel, seed=2)
    inner = getattr(model, "module", model)
    assert all(getattr(p, "is_expert_param", False) == ("experts" in name)
               for name, p in inner.named_parameters())
    return full_parameters(model)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_experts_split_over_ep_ranks_start_as_in_one_process(data_parallel):
    reference = moe_on_ranks()
    for rank, params in enumerate(run_ranks(lambda: moe_on_ranks(2, data_parallel), 2)):
        for name, value in reference.items():
            assert torch.equal(params[name], value), f"rank {rank}: {name}"


def sliced_on_ranks() -> tuple[dict[str, torch.Tensor], list[tuple[int, ...]]]:
    """A source that reads only this rank's slice of each full value (as a checkpoint reader
    does with `local_slices`) gives the model a full-value source gives."""
    gangs = setup_gangs(setup_root_gang(), tp_size=2)
    with torch.device("meta"):
        model = GPT(CONFIG)
    model = parallelize_gpt(model, gangs, data_parallel="fsdp")
    full_values = seeded_init(5, model.init_parameter)
    read: list[tuple[int, ...]] = []

    def read_slice(name: str, like: torch.Tensor) -> torch.Tensor:
        part = full_values(name, like)[local_slices(like)].clone()
        read.append(tuple(part.shape))
        return part

    materialize(model, gangs.device, read_slice, sliced=True)
    return full_parameters(model), read


def test_a_source_of_local_slices_builds_the_same_model(one_process):
    for params, read in run_ranks(sliced_on_ranks, 4):
        for name, value in one_process[0].items():
            assert torch.equal(params[name], value), name
        assert (8, 32) in read  # wq's quarter: 32 rows over TP 2 x FSDP 2
