"""`GRPOUnit`: online RL as a `TrainUnit`. When the first micro-batch of a generation window
arrives (`gangtrain.rl.windows.PromptWindows`), it samples the window's completions with
the current policy (its `Generator`), or takes them from recorded rollouts (replay), scores
them with the reward functions, gathers the rewards over DP so advantages see whole groups,
and keeps this rank's micro-batches (`window`); each micro-batch then returns
``(loss summed, num_targets)`` of its loss kind (`losses`). The Trainer's division by the
step's global target count normalises per optimizer step, whatever the window, the
accumulation and the DP size.

Old log-probabilities (the policy at generation) are computed with a forward of each
micro-batch right after generation when some micro-batch of the window is trained after an
optimizer step (``num_iterations > 1``, or a window longer than what remains of the step);
otherwise the ratio is exactly 1 (TRL's shortcut). The reference's log-probabilities
(``loss.beta > 0``) are computed then too. The window is checkpointed (`state_dict`), so a
run resumed inside a window trains on the same completions and ends bit for bit the same.

Where optimizer steps fall comes from the Trainer (`set_micro_batch`, called before each
micro-batch with its place in the step); the unit keeps no copy of the accumulation
(``num_accumulate`` is only a fallback for a caller that never calls the hook). The loss kind
(`losses`) says whether old log-probabilities are needed, computes the advantages and the
loss. Rewards come from `gangtrain.rl.rewards` sources (functions, reward models), scored
through one function (`score_completions`) shared with the eval unit. Token log-probs go
through the chunked head (`units.linear_cross_entropy`) where the model's head allows it at a
large vocabulary (`units.causal_lm.auto_loss_chunk_size`): no [tokens, vocab] float32
log-softmax is held. ``flops_per_token`` given, the unit states its FLOPs per target
(`flops_per_target`): the training forwards and backwards (and the forwards of old and
reference log-probs), never generation, so MFU counts the training work.

Metrics (TRL's names; window statistics are computed from the gathered window, identical on
every rank; token and completion statistics are totals, exact over DP): ``reward``,
``reward_std``, ``frac_reward_zero_std``, ``rewards/<source>/mean|std`` (and what a source
publishes, ``rewards/<source>/<metric>``),
``completions/mean_length``, ``completions/min_length``, ``completions/max_length``,
``completions/clipped_ratio``, ``kl``, ``entropy``, ``clip_ratio/*``,
``generation/completions_per_s``, ``generation/tokens_per_s``; with
``loss.sampler_correction``, ``sampling/sampling_logp_difference/*`` and
``sampling/importance_sampling_ratio/*``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gangs import FakeGang, Gang
from gangs.errors import UserError
from gangtrain.data.prompts import PromptSet
from gangtrain.data.vision_prompts import join_inputs
from gangtrain.layers.wrappers import unwrapped
from gangtrain.rl.advantages import reward_metrics
from gangtrain.rl.agents import AgentLoop
from gangtrain.rl.generation import Completion, Generator, sample_seed
from gangtrain.rl.rewards import (
    RewardSource,
    reward_weights,
    score_completions,
    weighted_sum,
    with_weights,
)
from gangtrain.rl.rollouts import write_rollouts
from units.metrics import MetricBag
from units.online_rl.losses import GRPOLossKind, TokenScores
from units.online_rl.multi_turn import replayed_completion, roll_out
from units.online_rl.sampler_correction import weigh_slices
from units.online_rl.token_logps import token_logps
from units.online_rl.window import Slice, WindowBuffer, local_indices, slice_tensors
from units.reference import ReferenceModel
from units.unit import TrainUnit

__all__ = ["GRPOUnit", "Rollouts"]


@dataclass
class Rollouts:
    """Where completions come from and go: the generator (None with ``replay``), recorded
    windows to replay ({window: records}), where step N's records are written
    (`file_of(N)`; None: not written)."""

    generator: Generator | None = None
    replay: dict[int, list[dict[str, Any]]] | None = None
    file_of: Callable[[int], Path] | None = None
    decode: Callable[[Sequence[int]], str] | None = None
    agent: AgentLoop | None = None
    """Multi-turn rollouts with tools or environments (in place of ``generator``)."""


class GRPOUnit(TrainUnit[dict[str, Any]]):
    """``loss``: the loss kind with its settings (`losses.GRPO_LOSS_KINDS`); ``prompts``: the
    prompt set the windows index; ``rewards``: the reward sources, each with its weight
    (`gangtrain.rl.rewards`); ``batch_size``: completions per global micro-batch;
    ``window``: micro-batches per generation; ``dp``: the data-parallel gang;
    ``flops_per_token``: the training FLOPs of one token (forward and backward, as
    `CausalLMUnit`'s ``flops_per_target``), for `flops_per_target`; ``logps_chunk_size``:
    see `token_logps`.

    Kept for code written against the former signature: ``num_accumulate`` (used only when
    the Trainer does not call `set_micro_batch`), ``reward_weights`` (one weight per source,
    replacing theirs; warned)."""

    def __init__(self, model: nn.Module, loss: GRPOLossKind, prompts: PromptSet,
                 rewards: Sequence[RewardSource], rollouts: Rollouts, *,
                 num_generations: int, batch_size: int, window: int,
                 num_accumulate: int | None = None, temperature: float = 1.0, pad_id: int = 0,
                 seed: int = 0, reward_weights: Sequence[float] | None = None,
                 reference: ReferenceModel | None = None, dp: Gang | None = None,
                 flops_per_token: float | None = None,
                 logps_chunk_size: int | None | Literal["auto"] = "auto") -> None:
        self._model = model
        self.loss = loss
        self.prompts = prompts
        self.rewards = with_weights(rewards, reward_weights)
        self.rollouts = rollouts
        self.G, self.B, self.W = num_generations, batch_size, window
        self.num_accumulate = num_accumulate or 1  # only without the Trainer's hook
        self.temperature = temperature
        self.pad_id, self.seed = pad_id, seed
        self.reference = reference
        self.dp = dp or FakeGang()
        self.flops_per_token = flops_per_token
        self.logps_chunk_size = logps_chunk_size
        if loss.needs_reference and reference is None:
            raise ValueError("loss.beta > 0 needs a reference model")
        if batch_size % self.dp.size:
            raise ValueError(f"data.batch_size {batch_size} is not divisible by the DP size "
                             f"{self.dp.size}")
        self.buffer: WindowBuffer | None = None
        self._step_nr, self._calls_in_step = 0, 0
        self._place: tuple[int, int] | None = None  # (index, micro-batches) from the Trainer
        self._step_records: list[dict[str, Any]] = []
        self._flops = (0.0, 0)  # (training FLOPs, targets) of the windows opened so far

    @property
    def model(self) -> nn.Module:
        return self._model

    def set_step_nr(self, step_nr: int) -> None:
        if step_nr != self._step_nr:
            self._step_records = []
        self._step_nr, self._calls_in_step = step_nr, 0

    def set_micro_batch(self, index: int, num_micro_batches: int) -> None:
        """The Trainer's word on where the next micro-batch falls in its step."""
        self._place = (index, num_micro_batches)

    def _window_outlives_step(self) -> bool:
        """Whether the window opening now has micro-batches after this step's end."""
        index, count = self._place or (self._calls_in_step, self.num_accumulate)
        return index + self.W > count

    def flops_per_target(self) -> float | None:
        """FLOPs per target of the training work (no generation): measured over the
        windows opened so far, or, before the first, estimated from the prompts' mean
        length and ``max_new_tokens`` completions; None without ``flops_per_token``."""
        if self.flops_per_token is None:
            return None
        flops, targets = self._flops
        if targets > 0:
            return flops / targets
        n = len(self.prompts)
        prompt = sum(len(self.prompts[i].ids) for i in range(n)) / max(n, 1)
        new = self.loss.max_new_tokens or getattr(self.rollouts.generator, "max_new_tokens",
                                                  256)
        forwards = int(self.loss.needs_old_logps(False)) + int(self.loss.needs_reference)
        cost = self.flops_per_token * (prompt + new) * (
            1 + forwards / (3 * self.loss.num_iterations))
        return cost / (new if self.loss.counts_tokens else 1)

    # -- checkpointed state: the current window -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"buffer": None if self.buffer is None else self.buffer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffer = state.get("buffer")
        self.buffer = None if buffer is None else WindowBuffer.of_state(buffer)

    # -- one micro-batch ----------------------------------------------------------------
    def __call__(self, batch: dict[str, Any], metrics: MetricBag) -> tuple[Tensor, Tensor | int]:
        position, window = int(batch["position"]), int(batch["window"])
        if position == 0:
            self.buffer = self._open(window, list(batch["prompts"]), metrics)
        elif self.buffer is None or self.buffer.window != window:
            raise RuntimeError(f"micro-batch {position} of generation window {window} came "
                               "without its window (a checkpoint saved under another layout "
                               "cannot resume inside a window)")
        self._calls_in_step += 1
        self._place = None
        s = self.buffer.slices[position % self.W]
        logp, entropy = token_logps(self._model, s, self.temperature, with_entropy=True,
                                    chunk_size=self.logps_chunk_size)
        row = s.row
        assert row is not None
        scores = TokenScores(logp, s.old, s.ref, row, s.advantages, s.kept, s.sampling_ratio)
        loss, num_targets, values = self.loss.loss(scores)
        weight = s.kept[row].double()
        assert entropy is not None
        values["entropy"] = ((entropy.double() * weight).sum(), weight.sum())
        for name, (total, count) in values.items():
            metrics.update_total(name, total, count)
        metrics.update_sum("num_tokens", s.attention_mask.sum())  # the Trainer's tokens/s
        return loss, num_targets

    # -- a new window -------------------------------------------------------------------
    def _open(self, window: int, prompt_indices: list[int], metrics: MetricBag
              ) -> WindowBuffer:
        mine = local_indices(self.W, self.B, self.dp.rank, self.dp.size)
        where = [(prompt_indices[c // self.G], c % self.G) for c in mine]
        images = self._row_inputs([p for p, _ in where])  # prompts with images: theirs
        started = time.perf_counter()
        completions, values, names = self._sample(window, where, images, metrics)
        seconds = time.perf_counter() - started
        prompt_ids = [c.prompt_ids or self.prompts[p].ids
                      for (p, _), c in zip(where, completions, strict=True)]
        b = self.B // self.dp.size
        slices = []
        for m in range(self.W):
            part = slice(m * b, (m + 1) * b)
            ids, mask, scored = slice_tensors(prompt_ids[part],
                                              [c.ids for c in completions[part]], self.pad_id,
                                              [c.mask for c in completions[part]])
            truncated = torch.tensor([c.truncated for c in completions[part]])
            kept = ~truncated if self.loss.mask_truncated_completions else \
                torch.ones_like(truncated)
            slices.append(Slice(ids, mask, scored, torch.zeros(b), kept))
        device = next(self._model.parameters()).device
        slices = [Slice(*(t.to(device) if isinstance(t, Tensor) else t
                          for t in vars(s).values())) for s in slices]
        for m, s in enumerate(slices):
            if images:
                s.inputs = {k: v.to(device) for k, v in
                            join_inputs(images[m * b:(m + 1) * b]).items()}
        needs_old = self.loss.needs_old_logps(self._window_outlives_step())
        kl_sequence = self._score_old_and_reference(slices, needs_old)
        if self.loss.sampler_correction is not None:
            weigh_slices(self.loss.sampler_correction, slices, completions,
                         self.B // self.dp.size, metrics)
        self._count_flops(prompt_ids, completions, needs_old)
        advantages = self._advantages(values, kl_sequence, names, metrics)
        local = advantages[torch.tensor(mine)]
        for m, s in enumerate(slices):
            s.advantages = local[m * b:(m + 1) * b].float().to(device)
        self._record_completions(completions, seconds, metrics)
        if self.rollouts.file_of is not None:
            self._write(window, where, completions, values, names, advantages, mine)
        return WindowBuffer(window, slices)

    def _sample(self, window: int, where: list[tuple[int, int]],
                images: list[dict[str, Tensor]] | None, metrics: MetricBag
                ) -> tuple[list[Completion], Tensor, list[str]]:
        """This rank's completions and their reward values [n, functions]; `images`: each
        row's model inputs beside its ids (None: text prompts)."""
        if self.rollouts.replay is not None:
            return self._replayed(window, where)
        seeds = [sample_seed(self.seed, window, p, s) for p, s in where]
        if self.rollouts.agent is not None:
            completions, values = roll_out(self.rollouts.agent, self.prompts, where, seeds,
                                           self.rewards, self._step_nr, metrics)
            return completions, values, [r.name for r in self.rewards]
        assert self.rollouts.generator is not None
        completions = self.rollouts.generator.generate(
            [self.prompts[p].ids for p, _ in where], seeds,
            **({"inputs": images} if images else {}))
        values = score_completions(
            self.rewards, self.prompts, [p for p, _ in where], [c.ids for c in completions],
            self.rollouts.decode, step_nr=self._step_nr,
            publish=lambda name, value: metrics.update_mean(name, float(value)))
        return completions, values, [r.name for r in self.rewards]

    def _row_inputs(self, prompt_indices: list[int]) -> list[dict[str, Tensor]] | None:
        """Each row's model inputs beside its ids (its prompt's images, decoded once a
        prompt); None for text prompts."""
        seen: dict[int, dict[str, Tensor]] = {}
        for p in prompt_indices:
            if p not in seen:
                seen[p] = self.prompts.model_inputs(p)
        rows = [seen[p] for p in prompt_indices]
        return rows if any(rows) else None

    def _replayed(self, window: int, where: list[tuple[int, int]]
                  ) -> tuple[list[Completion], Tensor, list[str]]:
        assert self.rollouts.replay is not None
        records = {(r["prompt_index"], r["sample_index"]): r
                   for r in self.rollouts.replay.get(window, [])}
        missing = [w for w in where if w not in records]
        if missing:
            raise UserError(f"generation.replay holds no completion {missing[0][1]} of prompt "
                            f"{missing[0][0]} for window {window}: replay with the recorded "
                            "run's data.files, data.batch_size, data.shuffle_seed, "
                            "generation.window and generation.num_generations")
        chosen = [records[w] for w in where]
        names = list(chosen[0]["rewards"])
        completions = [replayed_completion(r) for r in chosen]
        values = torch.tensor([[float("nan") if r["rewards"][n] is None else r["rewards"][n]
                                for n in names] for r in chosen], dtype=torch.float64)
        return completions, values.reshape(len(chosen), len(names)), names

    @torch.no_grad()
    def _score_old_and_reference(self, slices: list[Slice], needs_old: bool) -> Tensor | None:
        """Fill each slice's old and reference log-probs when needed; each completion's k1
        KL sum (this rank's, slice by slice) where the loss kind wants it in the reward."""
        policy = unwrapped(self._model)
        sequence_kl = self.loss.needs_sequence_kl()
        kl = []
        for s in slices:
            if needs_old:
                s.old = token_logps(policy, s, self.temperature,
                                    chunk_size=self.logps_chunk_size)[0].detach()
            if self.reference is not None and self.loss.needs_reference:
                with self.reference.scoring() as reference:
                    s.ref = token_logps(unwrapped(reference), s, self.temperature,
                                        chunk_size=self.logps_chunk_size)[0]
                if sequence_kl:
                    assert s.old is not None and s.row is not None
                    kl.append(torch.zeros(s.scored.shape[0], dtype=torch.float64,
                                          device=s.row.device).index_add(
                        0, s.row, (s.old - s.ref).double()))
        return torch.cat(kl).cpu() if kl else None

    def _count_flops(self, prompt_ids: list[Any], completions: list[Completion],
                     needs_old: bool) -> None:
        """Add the window's training FLOPs and targets (host numbers) for
        `flops_per_target`: each micro-batch trained num_iterations times, plus a forward
        (a third of forward and backward) for old and for reference log-probs."""
        if self.flops_per_token is None:
            return
        tokens = sum(len(p) + len(c.ids) for p, c in zip(prompt_ids, completions, strict=True))
        kept = [not (self.loss.mask_truncated_completions and c.truncated) for c in completions]
        targets = self.loss.host_targets([c.sampled for c in completions], kept)
        forwards = int(needs_old) + int(self.reference is not None
                                        and self.loss.needs_reference)
        iterations = self.loss.num_iterations
        flops = self.flops_per_token * tokens * (iterations + forwards / 3)
        total, count = self._flops
        self._flops = (total + flops, count + targets * iterations)

    def _gather(self, local: Tensor) -> Tensor:
        """Every rank's rows of ``local`` [n, k], in window order."""
        if self.dp.size == 1:
            return local
        out = torch.empty((self.dp.size, *local.shape), dtype=local.dtype)
        self.dp.all_gather(out, local)
        b = self.B // self.dp.size
        # rank r's k-th row is micro-batch k // b, place r * b + k % b
        parts = out.view(self.dp.size, self.W, b, -1).permute(1, 0, 2, 3)
        return parts.reshape(self.W * self.B, -1)

    def _advantages(self, values: Tensor, kl_sequence: Tensor | None, names: list[str],
                    metrics: MetricBag) -> Tensor:
        local = values if kl_sequence is None else torch.cat([values, kl_sequence[:, None]], 1)
        device = next(self._model.parameters()).device
        gathered = self._gather(local.to(device)).cpu()
        per_source = gathered[:, :len(names)]
        rewards = weighted_sum(per_source, reward_weights(self.rewards, names))
        scale = self.loss.scale_rewards
        for name, value in reward_metrics(rewards, per_source, names, self.G, scale).items():
            metrics.update_mean(name, float(value))
        return self.loss.advantages(rewards, self.G,
                                    None if kl_sequence is None else gathered[:, -1])

    def _record_completions(self, completions: list[Completion], seconds: float,
                            metrics: MetricBag) -> None:
        # a trajectory's length is the policy's tokens, not its context's
        lengths = torch.tensor([c.sampled for c in completions], dtype=torch.float64)
        truncated = torch.tensor([c.truncated for c in completions], dtype=torch.float64)
        n = float(len(completions))
        # host floats: these are CPU values and the bag may live on an accelerator
        metrics.update_total("completions/mean_length", float(lengths.sum()), n)
        metrics.update_min("completions/min_length", float(lengths.min()))
        metrics.update_max("completions/max_length", float(lengths.max()))
        metrics.update_total("completions/clipped_ratio", float(truncated.sum()), n)
        if self.rollouts.replay is None and seconds > 0:
            # per rank rates averaged over ranks and windows, times the DP size: the gang's
            metrics.update_mean("generation/completions_per_s", n * self.dp.size / seconds)
            metrics.update_mean("generation/tokens_per_s",
                                float(lengths.sum()) * self.dp.size / seconds)

    def _write(self, window: int, where: list[tuple[int, int]], completions: list[Completion],
               values: Tensor, names: list[str], advantages: Tensor, mine: list[int]) -> None:
        """Append this window to ``rollouts/step_N.jsonl`` (rank 0 writes the file)."""
        local = [(c, p, s, comp, values[i].tolist())
                 for i, (c, (p, s), comp) in enumerate(zip(mine, where, completions,
                                                           strict=True))]
        gathered = self.dp.all_gather_objects(local) if self.dp.size > 1 else [local]
        if self.dp.rank != 0:
            return
        decode = self.rollouts.decode or (lambda ids: " ".join(map(str, ids)))
        rows = sorted((row for part in gathered for row in part), key=lambda r: r[:3])
        weights = reward_weights(self.rewards, names)
        for c, p, s, comp, reward_values in rows:
            prompt = self.prompts[p]
            rewards = dict(zip(names, reward_values, strict=True))
            total = sum(w * v for w, v in zip(weights, reward_values, strict=True)
                        if v == v)
            record = {
                "window": window, "prompt_index": p, "sample_index": s,
                "prompt_ids": list(comp.prompt_ids or prompt.ids),
                "completion_ids": list(comp.ids), "prompt": prompt.prompt,
                "completion": decode(comp.ids), "truncated": comp.truncated,
                "rewards": rewards, "reward": total, "advantage": float(advantages[c]),
                "logprobs": list(comp.logprobs)}
            if comp.mask is not None:  # multi-turn: what was sampled, the turns as messages
                record.update(completion_mask=list(comp.mask), messages=list(comp.messages or ()),
                              tool_calls=comp.tool_calls, tool_failures=comp.tool_failures)
            self._step_records.append(record)
        assert self.rollouts.file_of is not None
        write_rollouts(self.rollouts.file_of(self._step_nr),
                       self._step_records)

