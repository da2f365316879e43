"""`Engine`: runs requests (a context to prefill, a seed, a token budget) over a fixed number
of slots of a preallocated KV cache (`SlotCache`), the model's own forward each step.

- Continuous batching: the host reads the slots' state once every ``sync_every`` decode steps
  (by default 8 on an accelerator, whose queue a read would drain; every step on the CPU,
  where a read costs nothing and a row's stop is seen at once), or sooner when no row has
  that many tokens of budget left (stop tokens, budgets and the
  capacity are checked on the device in between; a finished
  row writes to scratch columns until the sync); finished rows leave their slot and waiting
  rows are prefilled into it, long contexts in chunks of ``prefill_chunk`` tokens (chunks are
  right-aligned so every row's last token is in the last column: ``logits_to_keep=1``), rows
  of very different lengths in separate forwards (`prefill_groups`: less padding computed).
  When nothing waits and at most half the slots are busy the cache is compacted once.
- Continued rows (multi-turn): when a row stops, ``on_stop`` may return tokens to append (a
  tool's result) and the next turn's budget; the turn's last sampled token (never fed) and
  those tokens are prefilled into the same slot: nothing it already holds is encoded again.
- Sampling: `gangtrain.rl.sampling.sample_tokens`, keyed by (seed, absolute position), so a
  row's tokens do not depend on its slot, its batch or its rank.
- FSDP2 lockstep (``gang`` given): a forward is a collective there, so every rank does the
  same number of prefill and decode forwards between syncs, agreed by all-reduces MAX (one
  also says whether any rank has rows left; a rank with fewer prefill chunks does 1-token
  dummy forwards on a scratch column, a rank with no live row decodes its idle slots).

Each forward passes a 4D boolean-derived additive mask, which transformers uses as is
(``masking_utils``: "If the mask is already 4D, simply return as-is"), per-row RoPE
positions, and the cache.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from gangs import Gang, ReduceOperation
from gangtrain.rl.sampling import sample_tokens
from gangtrain.rl.slot_cache import SlotCache

__all__ = ["Engine", "OnStop", "Request", "Turn", "default_sync_every", "forward_cost",
           "prefill_groups"]


@dataclass
class Turn:
    """What one turn of a row sampled: ids (the stop token included when it stopped), their
    log-probabilities, whether the turn's budget ran out (or the slot's capacity)."""

    ids: list[int]
    logprobs: list[float]
    truncated: bool


@dataclass
class Request:
    """A row: its whole context to prefill, its seed, its first turn's budget."""

    ids: Sequence[int]
    seed: int
    max_new_tokens: int
    turns: list[Turn] = field(default_factory=list)
    inputs: dict[str, Tensor] | None = None
    """Model inputs beside the ids for its first prefill (a vision-language model's
    ``pixel_values``: per-image tensors, joined along dim 0 across the rows prefilled
    together, in row order); such a prefill runs in one chunk, so the image tokens and
    their pixels meet in one forward."""


# on_stop(request index, the turn just ended, the request) -> None (finished) or
# (tokens to append to its context, the next turn's budget)
OnStop = Callable[[int, Turn, Request], "tuple[Sequence[int], int] | None"]


class Engine:
    """Runs requests over ``max_batch`` slots of ``capacity`` tokens each (see module doc)."""

    def __init__(self, model: nn.Module, *, stop_ids: Sequence[int], pad_id: int,
                 temperature: float = 1.0, top_p: float = 1.0, max_batch: int = 32,
                 sync_every: int | None = None, prefill_chunk: int = 512, compact: bool = True,
                 gang: Gang | None = None) -> None:
        self.model = model
        self.stop_ids = sorted(set(int(t) for t in stop_ids))
        self.pad_id = pad_id
        self.temperature, self.top_p = temperature, top_p
        self.max_batch, self.sync_every, self.prefill_chunk = max_batch, sync_every, prefill_chunk
        self.compact = compact
        self.gang = gang
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._work: Tensor | None = None
        self.forwards = 0
        self.forward_cost = forward_cost(model)

    # -- one forward ------------------------------------------------------------------
    def _forward(self, cache: SlotCache, rows: Tensor | None, ids: Tensor, positions: Tensor,
                 cols: Tensor, mask: Tensor, **inputs: Tensor) -> Tensor:
        """Logits [n, V] at each row's last column."""
        cache.rows, cache.cols, cache.kmax = rows, cols, mask.shape[-1]
        dtype = next(self.model.parameters()).dtype
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            ~mask, float("-inf"))
        self.forwards += 1
        out = self.model(input_ids=ids, attention_mask=additive, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_kw: cache}, **inputs)
        return out.logits[:, -1]

    def _workspace(self, logits: Tensor) -> Tensor:
        w = self._work
        if w is None or w.shape[0] < logits.shape[0] or w.shape[1] != logits.shape[1] \
                or w.device != logits.device:
            w = self._work = torch.empty((max(self.max_batch, logits.shape[0]),
                                          logits.shape[1]), dtype=torch.float32,
                                         device=logits.device)
        return w

    def _dummy_forward(self, cache: SlotCache, device: torch.device) -> None:
        one = torch.zeros((1, 1), dtype=torch.long, device=device)
        mask = torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device)
        mask[..., 0] = True
        self._forward(cache, one[0], one + self.pad_id, one, one, mask)

    # -- the loop ---------------------------------------------------------------------
    @torch.no_grad()
    def run(self, requests: Sequence[Request], *, capacity: int,
            on_stop: OnStop | None = None) -> list[Request]:
        """Runs every request to its end; each gets its ``turns``. ``capacity``: the most
        tokens a row's context may hold (a turn reaching it is cut, ``truncated``)."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            return self._run(list(requests), capacity, on_stop)
        finally:
            model.train(was_training)

    def _run(self, requests: list[Request], capacity: int, on_stop: OnStop | None
             ) -> list[Request]:
        device = next(self.model.parameters()).device
        num_layers = _num_layers(self.model)
        S = max(1, min(self.max_batch, len(requests)))
        L = capacity + 1  # + the scratch column
        cache = SlotCache(num_layers, S, L)
        stops = torch.tensor(self.stop_ids or [-1], dtype=torch.long, device=device)
        sync_every = self.sync_every or default_sync_every(device, self.gang)
        T = max(r.max_new_tokens for r in requests) if requests else 1
        # device state, one entry per slot
        length = torch.zeros(S, dtype=torch.long, device=device)   # tokens in the cache
        nxt = torch.zeros(S, dtype=torch.long, device=device)      # sampled, not yet cached
        live = torch.zeros(S, dtype=torch.bool, device=device)
        stopped = torch.zeros(S, dtype=torch.bool, device=device)  # ended by a stop token
        budget = torch.zeros(S, dtype=torch.long, device=device)
        count = torch.zeros(S, dtype=torch.long, device=device)    # sampled this turn
        seeds = torch.zeros(S, dtype=torch.long, device=device)
        out_ids = torch.zeros((S, T + 1), dtype=torch.long, device=device)  # col T: trash
        out_lp = torch.zeros((S, T + 1), dtype=torch.float32, device=device)
        # host state
        owner: list[int | None] = [None] * S    # request index in each slot
        pending: dict[int, list[int]] = {}      # slot -> tokens to prefill
        cached = [0] * S                        # host copy of `length` at the last sync
        # host copies of `budget` and `count`: a round decodes no more steps than a row needs
        budget_h, count_h = [0] * S, [0] * S
        steps_since = 0
        waiting = list(range(len(requests)))[::-1]

        def admit() -> None:
            for s in range(S):
                if owner[s] is None and waiting:
                    i = waiting.pop()
                    r = requests[i]
                    owner[s], pending[s], cached[s] = i, list(r.ids), 0
                    budget[s] = budget_h[s] = r.max_new_tokens
                    seeds[s] = r.seed

        def grow(width: int) -> None:
            nonlocal out_ids, out_lp, T
            if width > T:
                pad = width - T
                out_ids = torch.cat([out_ids[:, :T], out_ids.new_zeros((S, pad + 1))], 1)
                out_lp = torch.cat([out_lp[:, :T], out_lp.new_zeros((S, pad + 1))], 1)
                T = width

        def accept(slots: Tensor, tok: Tensor, lp: Tensor) -> None:
            """Record the token each live row of ``slots`` sampled; a row stops on a stop
            token, its budget or the capacity. Rows not live are left as they are."""
            on = live[slots]
            c = count[slots]
            col = torch.where(on, c, torch.full_like(c, T))
            out_ids[slots, col] = tok
            out_lp[slots, col] = lp
            is_stop = torch.isin(tok, stops)
            end = is_stop | (c + 1 >= budget[slots]) | (length[slots] >= capacity - 1)
            count[slots] = c + on.long()
            stopped[slots] = torch.where(on, is_stop, stopped[slots])
            nxt[slots] = torch.where(on, tok, nxt[slots])
            live[slots] = on & ~end

        def inputs_of(todo: list[int]) -> list[dict[str, Tensor]]:
            """The `Request.inputs` of the rows of ``todo`` prefilled for the first time."""
            return [r.inputs for r in (requests[owner[s]] for s in todo  # type: ignore[index]
                                       if cached[s] == 0) if r.inputs]

        def groups(todo: list[int]) -> list[list[int]]:
            lengths = [len(pending[s]) for s in todo]
            return [[todo[k] for k in g] for g in prefill_groups(lengths, self.prefill_chunk,
                                                                   self.forward_cost)]

        def prefill_forwards(todo: list[int]) -> int:
            """The forwards `prefill(todo)` will run: its groups' chunks (one with images)."""
            return sum(1 if inputs_of(g) else
                       _chunks(max(len(pending[s]) for s in g), self.prefill_chunk)[0]
                       for g in groups(todo))

        def prefill(todo: list[int]) -> None:
            for group in groups(todo):
                prefill_group(group)

        def prefill_group(todo: list[int]) -> None:
            """Prefill ``todo`` slots' pending tokens in chunks; sample each one's first
            token."""
            m = [len(pending[s]) for s in todo]
            given = inputs_of(todo)  # a row's images go in with its whole prompt
            inputs = {k: torch.cat([g[k] for g in given]).to(device) for k in given[0]} \
                if given else {}
            chunks, width = (1, max(m)) if given else _chunks(max(m), self.prefill_chunk)
            total = chunks * width
            n = len(todo)
            grid = torch.full((n, total), self.pad_id, dtype=torch.long)
            pos = torch.full((n, total), -1, dtype=torch.long)
            for k, s in enumerate(todo):
                grid[k, total - m[k]:] = torch.tensor(pending[s], dtype=torch.long)
                pos[k, total - m[k]:] = torch.arange(cached[s], cached[s] + m[k])
            grid, pos = grid.to(device), pos.to(device)
            rows = torch.tensor(todo, dtype=torch.long, device=device)
            real = pos >= 0
            keys = torch.arange(int(pos.max()) + 2, device=device)
            for c in range(chunks):
                part = slice(c * width, (c + 1) * width)
                p, ok = pos[:, part], real[:, part]
                kmax = int(p.max()) + 2
                k = keys[:kmax]
                mask = torch.where(ok[..., None], (k >= 1) & (k <= p[..., None] + 1),
                                   k == 0)[:, None]
                logits = self._forward(cache, rows, grid[:, part], p.clamp(min=0),
                                       torch.where(ok, p + 1, 0), mask, **inputs)
            for k, s in enumerate(todo):
                cached[s] += m[k]
                del pending[s]
            length[rows] = torch.tensor([cached[s] for s in todo], device=device)
            count[rows] = 0
            live[rows] = True
            tok, lp = sample_tokens(logits, seeds[rows], length[rows], self.temperature,
                                    self.top_p, self._workspace(logits))
            accept(rows, tok, lp)

        def decode() -> None:
            nonlocal steps_since
            rows_live = live.clone()
            cols = torch.where(rows_live, length + 1, 0)
            kmax = min(max(cached[s] for s in range(S)) + steps_since + 2, L)
            k = torch.arange(kmax, device=device)
            mask = torch.where(rows_live[:, None], (k >= 1) & (k <= cols[:, None]),
                               k == 0)[:, None, None]
            logits = self._forward(cache, None, nxt[:, None], length[:, None], cols[:, None],
                                   mask)
            length.add_(rows_live.long())
            tok, lp = sample_tokens(logits, seeds, length, self.temperature, self.top_p,
                                    self._workspace(logits))
            accept(all_slots, tok, lp)
            steps_since += 1

        def agree(*counts: int) -> list[int]:
            """The ranks' largest value of each count (one all-reduce MAX)."""
            if self.gang is None or getattr(self.gang, "size", 1) == 1:
                return list(counts)
            v = torch.tensor(counts, dtype=torch.float64, device=device)
            self.gang.all_reduce(v, ReduceOperation.MAX)
            return [int(x) for x in v.tolist()]

        all_slots = torch.arange(S, device=device)
        admit()
        todo = [s for s in range(S) if s in pending]
        while True:
            # prefill what waits for a slot (new rows, continued rows); the ranks agree on the
            # number of forwards first: under FSDP2 each is a collective, so a rank with
            # fewer chunks (a tool result continued one of its rows) pads with dummy ones.
            mine = prefill_forwards(todo)
            # decode steps: sync_every, or fewer when no row has that many tokens left
            # (the rows a prefill starts have their first token: budget - 1 left)
            for s in todo:
                count_h[s] = 1
            need = max((budget_h[s] - count_h[s] for s in range(S) if owner[s] is not None),
                       default=0)
            want, steps = agree(mine, min(sync_every, max(need, 0)))
            prefill(todo)
            for _ in range(want - mine):
                self._dummy_forward(cache, device)
            steps_since = 0
            # decode without asking the host
            for _ in range(steps):
                decode()
            # sync: one read of the slots' state
            live_h, length_h, counts, stopped_h = torch.stack(
                [live.long(), length, count, stopped.long()]).tolist()
            todo = []
            for s in range(S):
                cached[s], count_h[s] = length_h[s], counts[s]
                i = owner[s]
                if i is None or s in pending or live_h[s]:
                    continue
                n = counts[s]
                turn = Turn(out_ids[s, :n].tolist(), out_lp[s, :n].tolist(),
                            truncated=not stopped_h[s])
                r = requests[i]
                r.turns.append(turn)
                more = on_stop(i, turn, r) if on_stop is not None else None
                if more is None:
                    owner[s] = None
                    continue
                suffix, next_budget = more
                # the turn's last token was sampled, never fed: it goes first
                pending[s] = [turn.ids[-1], *suffix] if turn.ids else list(suffix)
                if cached[s] + len(pending[s]) >= capacity:  # no room: end it here
                    r.turns[-1].truncated = True
                    del pending[s]
                    owner[s] = None
                    continue
                budget[s] = budget_h[s] = next_budget
                grow(next_budget)
            admit()
            todo = [s for s in range(S) if s in pending]
            busy = sum(o is not None for o in owner)
            (left,) = agree(int(busy > 0 or bool(waiting)))
            if left == 0:
                break
            # compact: nothing waits and at most half the slots are busy
            if self.compact and not waiting and busy <= S // 2:
                # (a rank with nothing left keeps one idle slot to step with its gang)
                keep_slots = [s for s in range(S) if owner[s] is not None] or [0]
                keep = torch.tensor(keep_slots, dtype=torch.long, device=device)
                cache.compact(keep)
                length, nxt, live, stopped, budget, count, seeds = (
                    t[keep] for t in (length, nxt, live, stopped, budget, count, seeds))
                out_ids, out_lp = out_ids[keep], out_lp[keep]
                remap = {old: new for new, old in enumerate(keep_slots)}
                owner = [owner[s] for s in keep_slots]
                pending = {remap[s]: v for s, v in pending.items()}
                cached = [cached[s] for s in keep_slots]
                budget_h = [budget_h[s] for s in keep_slots]
                count_h = [count_h[s] for s in keep_slots]
                todo = [remap[s] for s in todo]
                S = len(keep_slots)
                all_slots = torch.arange(S, device=device)
        return requests


def default_sync_every(device: torch.device, gang: Gang | None) -> int:
    """Decode steps between host reads when none is given: 1 on the CPU (the read is a
    copy of four small tensors; a stopped row ends its turn at once), unless ranks step
    together (each read is an all-reduce there); else 8."""
    alone = gang is None or getattr(gang, "size", 1) == 1
    return 1 if device.type == "cpu" and alone else 8


def forward_cost(model: nn.Module) -> int:
    """A forward's fixed cost in tokens of prefill: what splitting a prefill into one more
    forward must save. A forward reads every weight once (4 bytes a parameter) and a token
    costs 2 FLOPs a parameter it passes through (the decoder's, not the embedding's nor, at
    prefill, the head's); at ~8 FLOPs a byte (a CPU's matmul rate over its memory bandwidth)
    that is 16 x all parameters / the decoder's, e.g. 27 tokens for a 40M Llama of 8 layers,
    164 for one of 4 layers with a 151,936-token head, 22 at Qwen2.5-0.5B's shape."""
    total = sum(p.numel() for p in model.parameters())
    tables = {}  # the embedding and the head (once when tied)
    for name in ("get_input_embeddings", "get_output_embeddings"):
        table = getattr(model, name, lambda: None)()
        if table is not None:
            tables[id(table.weight)] = table.weight.numel()
    return math.ceil(16 * total / max(total - sum(tables.values()), 1))


def _chunks(longest: int, chunk: int) -> tuple[int, int]:
    """(forwards, width) of a prefill whose longest row has ``longest`` tokens."""
    width = min(chunk, longest)
    return math.ceil(longest / width), width


def prefill_groups(lengths: Sequence[int], chunk: int, forward_cost: int
                   ) -> list[list[int]]:
    """The rows (by their token counts) split into groups prefilled by forwards of their own:
    a group pads every row to its longest, so rows sorted by length are cut into the runs
    that cost the fewest tokens, padding included, plus ``forward_cost`` a forward
    (dynamic programming over the cut points: a batch of rows, at most a few hundred)."""
    order = sorted(range(len(lengths)), key=lambda k: lengths[k])
    m = [lengths[k] for k in order]

    def cost(i: int, j: int) -> int:  # rows i..j-1 of `order` in one group
        forwards, width = _chunks(m[j - 1], chunk)
        return forwards * ((j - i) * width + forward_cost)

    best: list[float] = [0.0] + [math.inf] * len(m)
    cut = [0] * (len(m) + 1)
    for j in range(1, len(m) + 1):
        for i in range(j):
            c = best[i] + cost(i, j)
            if c < best[j]:
                best[j], cut[j] = c, i
    runs, j = [], len(m)
    while j > 0:
        runs.append(order[cut[j]:j])
        j = cut[j]
    return runs[::-1]


def _num_layers(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    return int(text.num_hidden_layers)
