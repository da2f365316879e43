"""Stock units for causal language models: summed NLL over the non-padding targets.

The model returns logits, or a Hugging Face output with `.logits` (its own `.loss` is a
mean, so it is not used: the unit sums, the trainer divides by the global target count).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gangtrain.data.collate import IGNORE_INDEX
from gangtrain.layers.moe import moe_layers
from gangtrain.layers.wrappers import unwrapped
from units.linear_cross_entropy import captured_head, linear_cross_entropy
from units.metrics import MetricBag
from units.router_aux_loss import ExpertLayersAuxLoss, RouterAuxLoss
from units.unit import EvalUnit, TrainUnit

log = logging.getLogger("gangtrain")

LMBatch = Mapping[str, Tensor]
"""One of two forms, both [b, t]:

- `{"input_ids", "target_ids"}`: targets already shifted (`target_ids[:, i]` follows
  `input_ids[:, i]`), padding marked with the ignore index;
- Hugging Face style `{"input_ids", "attention_mask"?, "labels"?}`: `labels` (default: the
  input ids) are shifted here, as HF models do; positions whose attention mask is 0 and
  labels equal to the ignore index (-100 by default) are not targets.

Every other key is a model keyword and is handed to the model as it is
(`model(input_ids, attention_mask=..., position_ids=..., ...)`): `position_ids` restarting at
0 for each example of a packed row is what confines attention to each example (Hugging Face
models find the examples from them; so does the LM recipe's GPT). A model whose `forward`
takes `use_cache` is called with `use_cache=False`: training never reuses a KV cache, and
transformers looks for packed examples in `position_ids` only without one.
"""

_TARGET_KEYS = ("target_ids", "labels")
"""Batch keys that are targets, not model inputs."""


def output_logits(output: Any) -> Tensor:
    """The logits of a model's output: the tensor itself, or a Hugging Face output's
    `.logits` (e.g. `CausalLMOutputWithPast`)."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise TypeError(
        f"the model returned a {type(output).__name__}: a causal LM unit needs logits, "
        "a tensor or an output with a `.logits` tensor (Hugging Face models)"
    )


def lm_targets(batch: LMBatch, pad_idx: int) -> tuple[Tensor, bool]:
    """(targets aligned with the logits to score, whether the logits' last position must be
    dropped: True for an HF-style batch, whose labels are shifted here)."""
    if "target_ids" in batch:
        return batch["target_ids"], False
    labels = batch.get("labels", batch["input_ids"])
    mask = batch.get("attention_mask")
    if mask is not None:
        labels = labels.masked_fill(mask == 0, pad_idx)
    return labels[:, 1:], True


def sequence_batch(batch: LMBatch, pad_idx: int = IGNORE_INDEX) -> dict[str, Tensor]:
    """The batch as ``{"input_ids", "target_ids", "position_ids", ...}`` (every value
    ``[b, t]``), ready to be cut along the sequence: an HF-style batch is pre-shifted
    (`target_ids`, the last position unscored), because shifting after the cut would lose
    the target at each slice boundary; `position_ids` (0..t-1) are added when missing, since
    a slice must know where it starts; an `attention_mask` is folded into the targets and
    dropped (padding must be on the right, where causal attention keeps it from every real
    token)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError("context parallelism takes causal-LM batches: a mapping with "
                         f"'input_ids'; got {type(batch).__name__}")
    out = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask")}
    ids = batch["input_ids"]
    if "target_ids" not in batch:
        labels = batch.get("labels", ids)
        mask = batch.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, pad_idx)
        out["target_ids"] = F.pad(labels[:, 1:], (0, 1), value=pad_idx)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return out


def takes_keyword(model: nn.Module, name: str) -> bool:
    """Whether the model under any DDP / `torch.compile` wrappers has a `forward` that takes
    keyword `name`."""
    try:
        return name in inspect.signature(unwrapped(model).forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: pass nothing extra
        return False


def takes_use_cache(model: nn.Module) -> bool:
    """Whether the model's `forward` takes `use_cache` (Hugging Face causal LMs), by name or
    through `**kwargs` handed to a language model whose config has it (transformers' LLaVA:
    without `use_cache=False` its decoder keeps a cache and attends across packed examples)."""
    if takes_keyword(model, "use_cache"):
        return True
    config = getattr(unwrapped(model), "config", None)
    text_config = getattr(config, "get_text_config", None)
    return callable(text_config) and getattr(text_config(), "use_cache", None) is not None \
        and takes_keyword(model, "kwargs")


def keeps_trained_logits(model: nn.Module) -> bool:
    """Whether the model can compute its head only where asked: its `forward` takes
    `logits_to_keep` as a boolean [b, t] mask and then returns logits [kept, vocab] (the
    hidden states gathered before the head). transformers causal LMs do (5.x), as does the
    LM recipe's GPT. A compiled model is left on the plain path (a mask of another shape
    each step would recompile it)."""
    return takes_keyword(model, "logits_to_keep") and not compiled(model)


def compiled(model: nn.Module) -> bool:
    """Whether `torch.compile` wraps the model under any DDP wrappers."""
    seen = model
    for _ in range(4):  # as `unwrapped`
        if hasattr(seen, "_orig_mod"):
            return True
        inner = getattr(seen, "module", None)
        if not isinstance(inner, nn.Module):
            return False
        seen = inner
    return False


def model_keywords(batch: LMBatch, use_cache_keyword: bool) -> dict[str, Any]:
    """Every key of the batch but the inputs and targets, plus `use_cache=False` when asked."""
    if "input_ids" not in batch:
        raise ValueError(f"a causal LM batch needs 'input_ids'; this one has {sorted(batch)}")
    keywords = {k: v for k, v in batch.items() if k != "input_ids" and k not in _TARGET_KEYS}
    if use_cache_keyword:
        keywords["use_cache"] = False
    return keywords


def trained_mask(targets: Tensor, shift: bool, pad_idx: int) -> tuple[Tensor, Tensor]:
    """(the trained positions of the targets [b, t'], the same over the model's positions
    [b, t]: for shifted labels, the last position predicts nothing)."""
    trained = targets != pad_idx
    return trained, F.pad(trained, (0, 1), value=False) if shift else trained


def lm_logits(model: nn.Module, batch: LMBatch, pad_idx: int,
              use_cache_keyword: bool = False,
              trained_only: bool = False) -> tuple[Tensor, Tensor]:
    """(logits [b, t', vocab], their targets [b, t']) of a batch (see `LMBatch` for the two
    forms): every key but the targets goes to the model; `use_cache_keyword` adds
    `use_cache=False`. `trained_only` (for a model that `keeps_trained_logits`): the head
    runs at the trained positions only, and the result is (logits [n, vocab], targets [n])
    of the n targets that are not `pad_idx`."""
    keywords = model_keywords(batch, use_cache_keyword)
    targets, shift = lm_targets(batch, pad_idx)
    if trained_only and "logits_to_keep" not in keywords:
        trained, keep = trained_mask(targets, shift, pad_idx)
        logits = output_logits(model(batch["input_ids"], **keywords, logits_to_keep=keep))
        if logits.ndim != 2 or logits.shape[0] != int(keep.sum()):
            raise ValueError(
                f"{type(unwrapped(model)).__name__} returned logits {tuple(logits.shape)} for "
                f"a boolean `logits_to_keep` of {int(keep.sum())} positions: it does not "
                "take a mask there; pass trained_positions_only=False to the unit")
        return logits, targets[trained]
    logits = output_logits(model(batch["input_ids"], **keywords))
    if shift:
        logits = logits[:, :-1]
    return logits, targets


def kept_logits(model: nn.Module, input_ids: Tensor, keep: Tensor, **keywords: Any) -> Tensor:
    """The logits [n, vocab] at the n true positions of `keep` [b, t] (row-major): the head
    runs there only where the model `keeps_trained_logits`, else everywhere, then indexed."""
    if keeps_trained_logits(model):
        keywords["logits_to_keep"] = keep
    logits = output_logits(model(input_ids, **keywords))
    return logits[keep] if logits.ndim == 3 else logits


def lm_loss(model: nn.Module, batch: LMBatch, pad_idx: int, use_cache_keyword: bool = False,
            trained_only: bool = False) -> tuple[Tensor, Tensor]:
    """(summed NLL in nats, number of targets), targets equal to `pad_idx` (the ignore
    index) excluded; see `lm_logits`."""
    logits, targets = lm_logits(model, batch, pad_idx, use_cache_keyword, trained_only)
    loss = F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=pad_idx, reduction="sum"
    )
    return loss, (targets != pad_idx).sum()


def chunked_lm_loss(model: nn.Module, batch: LMBatch, pad_idx: int, chunk_size: int,
                    use_cache_keyword: bool = False) -> tuple[Tensor, Tensor]:
    """`lm_loss` with the head's matmul and the cross-entropy computed `chunk_size` trained
    positions at a time (`units.linear_cross_entropy`): the [tokens, vocab] logits are never
    held. The model must `keeps_trained_logits` and have a linear head
    (`get_output_embeddings()`, transformers' name, which the LM recipe's GPT answers too)
    whose output it returns unchanged; what does not is refused by name."""
    hidden, head, targets, trained = head_inputs(model, batch, pad_idx, use_cache_keyword)
    loss = linear_cross_entropy(hidden, head.weight, head.bias, targets, chunk_size, pad_idx)
    return loss, trained.sum()


def head_inputs(model: nn.Module, batch: LMBatch, pad_idx: int, use_cache_keyword: bool = False
                ) -> tuple[Tensor, nn.Linear, Tensor, Tensor]:
    """The model run with its head skipped (`captured_head`): (the head's input at the n
    trained positions [n, d], the head, their targets [n], the trained mask [b, t'] in the
    targets' layout), for a loss that computes the head itself in chunks. Refused by name
    where that would not be exact (`chunked_loss_head`, or logits changed after the head)."""
    head = chunked_loss_head(model)
    keywords = model_keywords(batch, use_cache_keyword)
    targets, shift = lm_targets(batch, pad_idx)
    trained, keep = trained_mask(targets, shift, pad_idx)
    with captured_head(head) as seen:
        logits = output_logits(model(batch["input_ids"], **keywords, logits_to_keep=keep))
    if not seen.output_unchanged(logits):
        raise ValueError(
            f"loss_chunk_size: {type(unwrapped(model)).__name__} changes its logits after its "
            "head (e.g. soft-capping or scaling them, or a hook on the head that changes its "
            "input or output), which the chunked loss would skip: "
            "leave loss_chunk_size unset for this model")
    return seen.hidden, head, targets[trained], trained


AUTO_MIN_VOCAB = 32768
"""The vocabulary from which "auto" chunks the loss: there the [tokens, vocab] logits, their
log-softmax and their gradient are most of the step's transient memory (1 GB for a row of
512 tokens at Qwen's 151,936), and the chunked loss computes the same three matmuls without
them (docs/measured.md: the real-size step)."""
AUTO_CHUNK = 1024
AUTO_CHUNK_CPU = 128
"""Rows of logits a chunk holds. On a CPU the head's three matmuls are as fast at 128 rows
(not at 64), so the chunk holds an eighth of the memory (78 MB at Qwen's vocabulary, not
622 MB)."""


def auto_loss_chunk_size(model: nn.Module) -> int | None:
    """`AUTO_CHUNK` (`AUTO_CHUNK_CPU` for a head on the CPU) when the model's head can take
    the chunked loss and its vocabulary has at least `AUTO_MIN_VOCAB` rows; else None (the
    plain path)."""
    try:
        head = chunked_loss_head(model)
    except ValueError as refusal:  # its own words name the model and why
        log.debug("the plain loss path: %s", refusal)
        return None
    if head.out_features < AUTO_MIN_VOCAB:
        return None
    return AUTO_CHUNK_CPU if head.weight.device.type == "cpu" else AUTO_CHUNK


_LOGIT_CHANGES = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0,
                  "lm_head_multiplier": 1.0}
"""transformers' config keys of models that change their logits after the head (Gemma 2/3
soft-capping, Cohere's and Granite's scales, Falcon-H1's multiplier), with the value that
changes nothing; the check after the forward (`head_inputs`) catches any other."""


def chunked_loss_head(model: nn.Module) -> nn.Linear:
    """The model's linear head, for `chunked_lm_loss`; refused by name where the chunked
    loss cannot be exact."""
    inner = unwrapped(model)
    name = type(inner).__name__
    if not keeps_trained_logits(model):
        raise ValueError(f"loss_chunk_size: {name}'s forward takes no `logits_to_keep` mask "
                         "(or it is compiled): leave loss_chunk_size unset for this model")
    get_head = getattr(inner, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"loss_chunk_size: {name} has no linear head "
                         "(`get_output_embeddings()`): leave loss_chunk_size unset")
    reason = _not_the_plain_linear(head)
    if reason is not None:  # the chunked loss computes `hidden @ weight.T + bias` alone
        raise ValueError(f"loss_chunk_size: {name}'s head {type(head).__name__} {reason}, "
                         "which a chunked head would skip: leave loss_chunk_size unset")
    config = getattr(inner, "config", None)
    changed = [key for key, plain in _LOGIT_CHANGES.items()
               if getattr(config, key, None) not in (None, plain)]
    if changed:
        raise ValueError(f"loss_chunk_size: {name} changes its logits after its head "
                         f"({changed[0]}={getattr(config, changed[0])}), which a chunked head "
                         "would skip: leave loss_chunk_size unset for this model")
    if any(isinstance(p, DTensor) for p in head.parameters()):
        raise ValueError(f"loss_chunk_size: {name}'s head is sharded (tensor parallel or "
                         "FSDP), and the chunked loss needs its whole weight on each rank: "
                         "leave loss_chunk_size unset under these layouts")
    return head


def _not_the_plain_linear(head: nn.Linear) -> str | None:
    """Why the head's output may not be ``hidden @ weight.T + bias``, or None (hooks on it
    are checked as the model runs: `CapturedHead.output_unchanged`)."""
    if type(head).forward is not nn.Linear.forward or "forward" in vars(head):
        return "has a forward of its own"
    if getattr(head, "parametrizations", None) is not None:
        return "has a parametrized weight"
    return None


def derive_lm_metrics(values: dict[str, float], bytes_per_token: float | None) -> None:
    """Perplexity, and bits per byte when tokens map to a known number of bytes."""
    for key in [k for k in values if k == "loss" or k.endswith("/loss")]:
        prefix = key[: -len("loss")]
        loss = values[key]
        values[f"{prefix}perplexity"] = math.exp(min(loss, 700.0))
        if bytes_per_token:
            values[f"{prefix}bits_per_byte"] = loss / math.log(2) / bytes_per_token


class CausalLMUnit(TrainUnit[LMBatch]):
    """Next-token prediction; `num_targets` counts the targets that are not padding.

    Takes our models (logits) and Hugging Face causal LMs (`.logits`), with either batch
    form of `LMBatch`. `pad_idx` is the ignore index (-100, as in Hugging Face labels).

    `bytes_per_token=1` (byte-level models) adds `bits_per_byte` to the published metrics;
    `flops_per_target` (training FLOPs per token) lets the trainer publish `mfu` on a GPU.

    `trained_positions_only` (default): a model that `keeps_trained_logits` (transformers
    causal LMs, the LM recipe's GPT) runs its head at the trained positions only (the
    logits of masked prompt tokens and padding are never computed); the loss and gradients
    are the full head's. Other models take the plain path. `loss_chunk_size` (tokens): the
    head and the cross-entropy run that many trained positions at a time
    (`chunked_lm_loss`), so memory stops growing with vocabulary x tokens; refused by name
    where it cannot be exact. "auto" (default): chunks of `AUTO_CHUNK` rows (a quarter on a
    CPU: `auto_loss_chunk_size`) where the
    vocabulary has at least `AUTO_MIN_VOCAB` rows and the head allows it
    (`auto_loss_chunk_size`), else the plain path; None: always the plain path.
    """

    def __init__(
        self, model: nn.Module, pad_idx: int = IGNORE_INDEX, bytes_per_token: float | None = None,
        moe_aux_loss_weight: float = 0.0, flops_per_target: float | None = None,
        trained_positions_only: bool = True,
        loss_chunk_size: int | Literal["auto"] | None = "auto",
    ) -> None:
        self._model = model
        if loss_chunk_size == "auto":
            loss_chunk_size = auto_loss_chunk_size(model) if trained_positions_only else None
        elif loss_chunk_size is not None:
            if loss_chunk_size < 1:
                raise ValueError(f"loss_chunk_size must be positive, got {loss_chunk_size}")
            chunked_loss_head(model)  # refuse before anything runs
        self.loss_chunk_size = loss_chunk_size
        self._trained_only = trained_positions_only and keeps_trained_logits(model)
        self.flops_per_target = flops_per_target
        self.pad_idx = pad_idx
        self.bytes_per_token = bytes_per_token
        self.moe_aux_loss_weight = moe_aux_loss_weight
        self._moe = [m for _, m in moe_layers(model)]
        self._moe_aux = (ExpertLayersAuxLoss(model, self._moe, moe_aux_loss_weight)
                         if self._moe and moe_aux_loss_weight > 0 else None)
        self._router_aux = RouterAuxLoss.of(model)  # a HF MoE's, when its config asks
        self._use_cache_keyword = takes_use_cache(model)

    @property
    def model(self) -> nn.Module:
        return self._model

    def sequence_batch(self, batch: LMBatch) -> dict[str, Tensor]:
        return sequence_batch(batch, self.pad_idx)

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> tuple[Tensor, Tensor]:
        if self.loss_chunk_size is not None:
            loss, num_targets = chunked_lm_loss(self._model, batch, self.pad_idx,
                                                self.loss_chunk_size, self._use_cache_keyword)
        else:
            loss, num_targets = lm_loss(self._model, batch, self.pad_idx,
                                        self._use_cache_keyword, self._trained_only)
        if self._moe:
            self._count_expert_tokens(metrics)
        if self._moe_aux is not None:
            loss = loss + self._moe_aux.summed(num_targets)
        if self._router_aux is not None:
            loss = loss + self._router_aux.summed(num_targets)
        return loss, num_targets

    def _count_expert_tokens(self, metrics: MetricBag) -> None:
        """Publish tokens routed to each expert (summed over ranks at publish time)."""
        counts = torch.stack([m.tokens_per_expert for m in self._moe]).sum(0)
        for m in self._moe:
            m.reset_tokens_per_expert()
        for expert, count in enumerate(counts.unbind()):
            metrics.update_sum(f"moe/tokens_expert_{expert}", count)

    def derive_metrics(self, values: dict[str, float]) -> None:
        derive_lm_metrics(values, self.bytes_per_token)


class CausalLMEvalUnit(EvalUnit[LMBatch]):
    """Records the mean NLL (`loss`, weighted by target count) and perplexity; models and
    batches as `CausalLMUnit`. `token_accuracy=True` adds `accuracy`: the share of targets
    whose most likely token (argmax of the logits) is the target. `trained_positions_only` as
    in `CausalLMUnit`."""

    metric_names = ("loss", "perplexity", "bits_per_byte")

    def __init__(
        self,
        model: nn.Module,
        name: str = "valid",
        pad_idx: int = IGNORE_INDEX,
        bytes_per_token: float | None = None,
        token_accuracy: bool = False,
        trained_positions_only: bool = True,
    ) -> None:
        self._model = model
        self._trained_only = trained_positions_only and keeps_trained_logits(model)
        self.name = name
        self.pad_idx = pad_idx
        self.bytes_per_token = bytes_per_token
        self.token_accuracy = token_accuracy
        names = ("loss", "perplexity") if bytes_per_token is None else self.metric_names
        self.metric_names = (*names, "accuracy") if token_accuracy else names
        self._use_cache_keyword = takes_use_cache(model)

    @property
    def model(self) -> nn.Module:
        return self._model

    @torch.no_grad()  # not inference_mode: see trainer.validator
    def __call__(self, batch: LMBatch, metrics: MetricBag) -> None:
        logits, targets = lm_logits(self._model, batch, self.pad_idx, self._use_cache_keyword,
                                    self._trained_only)
        loss = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                               ignore_index=self.pad_idx, reduction="sum")
        trained = targets != self.pad_idx
        num_targets = trained.sum()
        metrics.update_total("loss", loss, num_targets)
        if self.token_accuracy:
            correct = (logits.argmax(-1) == targets) & trained
            metrics.update_total("accuracy", correct.sum(), num_targets)

    def derive_metrics(self, values: dict[str, float]) -> None:
        derive_lm_metrics(values, self.bytes_per_token)
