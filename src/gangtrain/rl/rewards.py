"""Reward sources: what scores a window's completions, each by name with its weight.

A `RewardSource` is called as TRL calls a reward function, ``source(prompts, completions,
completion_ids, columns, *, step_nr, publish) -> list[float | None]``: one value per
completion; ``columns`` every other field of the prompt records by its name (one value per
completion); ``step_nr`` the optimizer step the window opens in; ``publish(metric, value)``
records a metric of the source's own under ``rewards/<name>/<metric>``. Text prompts give
text completions; conversational prompts give completions as ``[{"role": "assistant",
"content": text}]`` (TRL's form). ``None`` means "cannot score this one": it is left out of
the weighted sum (TRL's ``nansum``) and of the source's mean.

Two kinds, built after the gangs (`build_reward_sources`, from a config's ``rewards`` list):

- `FunctionReward`: a function by import path, called with TRL's keywords
  (``fn(prompts=..., completions=..., completion_ids=..., **columns)``).
- `ModelReward`: a sequence-classification model directory (`ModelReward.load`).

`score(sources, ...)` calls each source and returns the table ``[completions, sources]``
(float64, NaN where a source returned None); `weighted_sum` is TRL's nansum with the
sources' weights. The train and eval units both score through them.

Anything else a source returns is its mistake, named in one line (`RewardError`, a
`UserError`): an exception, a result that is not a list of that length, an item that is not
a number or None, a NaN or infinity.
"""

from __future__ import annotations

import copy
import importlib
import math
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gangs import Gang
from gangs.errors import UserError
from gangtrain.data.prompts import PromptSet

__all__ = ["FunctionReward", "ModelReward", "Publish", "RewardError", "RewardFunction",
           "RewardSource", "build_reward_sources", "reward_weights", "score", "score_completions",
           "weighted_sum", "with_weights"]

Publish = Callable[[str, float], None]
"""``publish(metric, value)``: record a metric of a source (a mean over the publish window)."""


class RewardError(UserError):
    """A reward source misbehaved: the message names it and what it did."""


def _ignore(metric: str, value: float) -> None:
    del metric, value


class RewardSource:
    """One source of rewards: `name` (its metrics: ``rewards/<name>/mean``), `weight` (its
    share of the weighted sum; the one place its default, 1.0, is written), and `what` (how
    errors name it). Subclasses implement `compute`; calling the source checks its result."""

    name: str
    weight: float = 1.0

    @property
    def what(self) -> str:
        return f"reward source '{self.name}'"

    def compute(self, prompts: list[Any], completions: list[Any],
                completion_ids: list[list[int]], columns: dict[str, list[Any]], *,
                step_nr: int, publish: Publish) -> Sequence[Any]:
        """The raw values, one per completion (None: cannot score it)."""
        raise NotImplementedError

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any],
                 completion_ids: Sequence[Sequence[int]], columns: Mapping[str, list[Any]], *,
                 step_nr: int = 0, publish: Publish | None = None) -> list[float | None]:
        n = len(completions)
        try:
            values = self.compute(list(prompts), list(completions),
                                  [list(c) for c in completion_ids], dict(columns),
                                  step_nr=step_nr, publish=publish or _ignore)
        except RewardError:
            raise
        except Exception as error:  # the user's code may fail in any way: name it, in one line
            detail = str(error).splitlines()[0] if str(error) else ""
            raise RewardError(f"{self.what} raised {type(error).__name__}"
                              f"{': ' + detail if detail else ''}") from None
        return _checked(self.what, values, n)


def _checked(what: str, values: Any, n: int) -> list[float | None]:
    if isinstance(values, Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{what} returned a {type(values).__name__}; expected a list of {n} "
                          "numbers (None for a completion it cannot score)")
    if len(values) != n:
        raise RewardError(f"{what} returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"{what} returned a {type(value).__name__} ({value!r}) for "
                              f"completion {i}; expected a number or None")
        if not math.isfinite(float(value)):
            raise RewardError(f"{what} returned {value} for completion {i}; return None for a "
                              "completion it cannot score")
        out.append(float(value))
    return out


class FunctionReward(RewardSource):
    """A reward function by import path ``path`` (TRL's signature, see the module
    docstring); `name` is the function's ``__name__``."""

    def __init__(self, name: str, path: str, fn: Callable[..., Any], weight: float = 1.0
                 ) -> None:
        self.name, self.path, self.fn, self.weight = name, path, fn, float(weight)

    @property
    def what(self) -> str:
        return f"reward function '{self.path}'"

    @classmethod
    def of_path(cls, path: str, weight: float = 1.0,
                resolve: Callable[[str, str], Any] | None = None) -> FunctionReward:
        fn = (resolve or _import_path)(path, "reward function")
        if not callable(fn):
            raise UserError(f"reward function '{path}' is a {type(fn).__name__}, not callable")
        return cls(getattr(fn, "__name__", path.rpartition(":")[2]), path, fn, weight)

    def compute(self, prompts: list[Any], completions: list[Any],
                completion_ids: list[list[int]], columns: dict[str, list[Any]], *,
                step_nr: int, publish: Publish) -> Sequence[Any]:
        del step_nr, publish  # TRL's signature takes neither
        return self.fn(**{**columns, "prompts": prompts, "completions": completions,
                          "completion_ids": completion_ids})

    def __repr__(self) -> str:
        return f"FunctionReward({self.path!r}, weight={self.weight})"


RewardFunction = FunctionReward
"""The former name (``RewardFunction(name, path, fn)``)."""


class ModelReward(RewardSource):
    """A learned reward: a sequence-classification model (one label) scoring each
    prompt + completion, batched (`batch_size` completions a forward), in its own dtype, on
    `device`, in eval mode without gradients. Its own tokenizer renders the text: a
    conversational prompt and completion through its chat template, text ones concatenated;
    the score is the model's logit at the last token that is not padding (as
    transformers' ``*ForSequenceClassification`` reads it). Build with `load`."""

    def __init__(self, name: str, model: Any, tokenizer: Any, *, weight: float = 1.0,
                 batch_size: int = 16, directory: str | None = None) -> None:
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.weight, self.batch_size = float(weight), batch_size
        self.directory = directory or name

    @property
    def what(self) -> str:
        return f"reward model '{self.directory}'"

    @classmethod
    def load(cls, directory: str | Path, *, device: torch.device | str = "cpu",
             weight: float = 1.0, batch_size: int = 16, name: str | None = None
             ) -> ModelReward:
        """The model and tokenizer of `directory` (refused in one `UserError` naming it when
        it is missing, not a model directory, or its head has other than one label); its dtype
        the config's ``dtype`` / ``torch_dtype``, else float32."""
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        path = Path(directory)
        if not (path / "config.json").is_file():
            raise UserError(f"reward model '{directory}': no such model directory (no "
                            "config.json); give a sequence-classification model saved with "
                            "save_pretrained")
        try:
            config = AutoConfig.from_pretrained(path)
        except Exception as error:
            raise UserError(f"reward model '{directory}': cannot read its config "
                            f"({type(error).__name__}: {error})") from None
        if getattr(config, "num_labels", None) != 1:
            raise UserError(f"reward model '{directory}' has {config.num_labels} labels; a "
                            "reward model scores with one (num_labels=1)")
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype or torch.float32)
        except Exception as error:
            raise UserError(f"reward model '{directory}': cannot load it as a sequence-"
                            f"classification model ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else ''})") from None
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:  # where transformers reads the last token
            model.config.pad_token_id = tokenizer.pad_token_id
        model.to(device).eval().requires_grad_(False)
        return cls(name or path.resolve().name, model, tokenizer, weight=weight,
                   batch_size=batch_size, directory=str(directory))

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """Each prompt + completion as this model's tokenizer renders it."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):  # conversational: the model's own template
                out.append(self.tokenizer.apply_chat_template(
                    [*prompt, *completion], tokenize=False))
            else:
                out.append(str(prompt) + str(completion))
        return out

    @torch.no_grad()
    def compute(self, prompts: list[Any], completions: list[Any],
                completion_ids: list[list[int]], columns: dict[str, list[Any]], *,
                step_nr: int, publish: Publish) -> Sequence[Any]:
        del completion_ids, columns, step_nr, publish
        texts = self.texts(prompts, completions)
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            # as TRL's reward models: the template already holds the special tokens
            inputs = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt",
                                    padding=True, padding_side="right",
                                    add_special_tokens=False).to(device)
            logits = self.model(input_ids=inputs["input_ids"],
                                attention_mask=inputs["attention_mask"]).logits
            scores += logits[:, 0].float().tolist()
        return scores

    def __repr__(self) -> str:
        return f"ModelReward({self.directory!r}, weight={self.weight})"


def _import_path(path: str, what: str) -> Any:
    """The object ``package.module:attr`` names (the config already checked the path)."""
    module, sep, attrs = path.partition(":")
    if not sep or not module.strip() or not attrs.strip():
        raise UserError(f"{what} path '{path}' must look like 'package.module:name'")
    try:
        obj: Any = importlib.import_module(module.strip())
    except Exception as error:
        raise UserError(f"cannot import {what} '{path}': {type(error).__name__}: {error}"
                        ) from None
    for attr in attrs.strip().split("."):
        if not hasattr(obj, attr):
            raise UserError(f"cannot import {what} '{path}': no attribute '{attr}'")
        obj = getattr(obj, attr)
    return obj


ENTRY_KEYS = ("fn", "model", "weight")


def build_reward_sources(entries: Sequence[str | Mapping[str, Any]], *,
                         device: torch.device | str = "cpu", gang: Gang | None = None,
                         resolve: Callable[[str, str], Any] | None = None
                         ) -> list[RewardSource]:
    """The sources of a config's ``rewards`` list, in order: each entry an import path
    ``"pkg.mod:fn"`` (weight 1.0), ``{fn: "pkg.mod:fn", weight: 1.0}`` or ``{model: DIR,
    weight: 0.5}`` (a sequence-classification model directory, placed on `device`). An
    unknown key is refused by name. `gang`: the ranks that load model sources (each loads its
    own copy; reserved for a rank-0-first read). `resolve(path, what)`: how an import path is
    resolved (the app's `import_object`; default: a plain import)."""
    del gang
    sources: list[RewardSource] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            sources.append(FunctionReward.of_path(entry, 1.0, resolve))
            continue
        if not isinstance(entry, Mapping):
            raise UserError(f"config 'rewards[{i}]' is a {type(entry).__name__}; give an "
                            "import path 'pkg.mod:fn' or a mapping {fn: ..., weight: ...} / "
                            "{model: DIR, weight: ...}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise UserError(f"config 'rewards[{i}]' has unknown key(s) {', '.join(unknown)}; "
                            f"a reward entry takes {', '.join(ENTRY_KEYS)}")
        if ("fn" in entry) == ("model" in entry):
            raise UserError(f"config 'rewards[{i}]' names {'both' if 'fn' in entry else 'neither'}"
                            " of fn and model; give exactly one")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) \
                or not math.isfinite(float(weight)):
            raise UserError(f"config 'rewards[{i}].weight' is {weight!r}; give a finite number")
        if "fn" in entry:
            sources.append(FunctionReward.of_path(str(entry["fn"]), float(weight), resolve))
        else:
            sources.append(ModelReward.load(str(entry["model"]), device=device,
                                            weight=float(weight)))
    return sources


def score(sources: Sequence[RewardSource], prompts: Sequence[Any],
          completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
          columns: Mapping[str, list[Any]], *, step_nr: int = 0,
          publish: Publish | None = None) -> Tensor:
    """Each source's value of each completion, float64 ``[completions, sources]`` (NaN
    where a source returned None). ``publish(metric, value)`` receives each source's own
    metrics as ``rewards/<name>/<metric>``."""
    n = len(completions)
    table = []
    for source in sources:
        def own(metric: str, value: float, prefix: str = f"rewards/{source.name}/") -> None:
            if publish is not None:
                publish(prefix + metric, value)

        values = source(prompts, completions, completion_ids, columns, step_nr=step_nr,
                        publish=own)
        table.append([math.nan if v is None else v for v in values])
    return torch.tensor(table, dtype=torch.float64).reshape(len(sources), n).T.contiguous()


def score_completions(sources: Sequence[RewardSource], prompts: PromptSet,
                      indices: Sequence[int], completion_ids: Sequence[Sequence[int]],
                      decode: Callable[[Sequence[int]], str] | None = None, *,
                      step_nr: int = 0, publish: Publish | None = None) -> Tensor:
    """`score` of completions of ``prompts[indices[i]]`` (token ids, decoded by `decode`;
    None: the ids as text), in TRL's form: conversational prompts give completions as
    ``[{"role": "assistant", "content": text}]``; every other field of the prompt records is
    passed by its name. What the train and eval units both call."""
    chosen = [prompts[i] for i in indices]
    texts: list[Any] = [decode(ids) if decode is not None else " ".join(map(str, ids))
                        for ids in completion_ids]
    if prompts.conversational:
        texts = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {key: [p.columns.get(key) for p in chosen]
               for key in sorted({k for p in chosen for k in p.columns})}
    return score(sources, [p.prompt for p in chosen], texts, completion_ids, columns,
                 step_nr=step_nr, publish=publish)


def reward_weights(sources: Sequence[RewardSource], names: Sequence[str] | None = None
                   ) -> list[float]:
    """The weights of `sources`; with `names` (columns of a table, e.g. replayed ones), each
    name's source's weight, 1.0 for a name no source has."""
    if names is None:
        return [s.weight for s in sources]
    by_name = {s.name: s.weight for s in sources}
    return [by_name.get(n, RewardSource.weight) for n in names]


def with_weights(sources: Sequence[RewardSource], weights: Sequence[float] | None
                 ) -> list[RewardSource]:
    """The sources, with `weights` (the former ``reward_weights``: one a source) replacing
    theirs where given, on copies (warned: a source carries its own weight)."""
    sources = list(sources)
    if weights is None:
        return sources
    warnings.warn("reward_weights= is deprecated: give each reward source its weight "
                  "(FunctionReward(..., weight=w), or {fn: ..., weight: w} in a config)",
                  DeprecationWarning, stacklevel=3)
    if len(weights) != len(sources):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(sources)} reward "
                         "sources")
    out = []
    for source, weight in zip(sources, weights, strict=True):
        source = copy.copy(source)
        source.weight = float(weight)
        out.append(source)
    return out


def weighted_sum(values: Tensor, weights: Sequence[float] | Sequence[RewardSource]) -> Tensor:
    """TRL's ``nansum(values * weights, dim=1)``: a source's None counts as nothing.
    `weights`: one number per column, or the sources themselves."""
    numbers_ = [w.weight if isinstance(w, RewardSource) else float(w) for w in weights]
    w = torch.tensor(numbers_, dtype=values.dtype, device=values.device)
    return torch.nansum(values * w, dim=1)
