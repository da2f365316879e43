"""Assemble the GRPO recipe: gangs, the model's tokenizer, the prompts (`data.prompts`), the
reward functions (import paths, TRL's calling convention), the pretrained policy loaded over
the gangs, the reference model when ``loss.beta > 0`` (`units.reference`: a frozen copy laid
out like the policy, or with LoRA the base with its adapters off), the generator (the policy
itself with a KV cache, `gangtrain.rl.generation.HFGenerator`) or recorded rollouts to
replay, the GRPO unit and the trainer. At the end the best checkpoint (by ``valid/reward``
when data.valid_files is given) is exported to ``OUTPUT_DIR/hf/``.

Every input is opened and checked before anything is written (`check_inputs`): the model
directory, the prompt files (a missing field or a prompt longer than the context named by
file and line), each reward function called once on the first prompt (one that raises or
returns a wrong result named), the rollouts to replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from torch import nn

from gangs import Gangs
from gangtrain.app.cli import recipe_gangs, run_recipe
from gangtrain.app.config.import_path import import_object
from gangtrain.app.evaluate import evaluate
from gangtrain.app.parameter_counts import parameter_line
from gangtrain.data.prompts import PromptSet, read_prompts
from gangtrain.models.hf import load_pretrained
from gangtrain.models.hf.hf_config import check_model_dir, check_tokenizer_fits
from gangtrain.rl.generation import HFGenerator
from gangtrain.rl.rewards import RewardFunction, score
from gangtrain.rl.rollouts import read_replay
from gangtrain.rl.windows import PromptWindows
from recipes.grpo.config import PRESETS, RESUME_GUARD, GRPOConfig
from trainer.errors import UserError
from trainer.lr_schedules import warmup_cosine
from trainer.observe.console_log import configure_logging
from trainer.run_dir import RunDir
from units.online_rl import GRPOUnit, Rollouts
from units.online_rl.evaluation import GRPOEvalUnit, ValidPrompts
from units.reference import ReferenceModel

__all__ = ["check_inputs", "cli", "eval_main", "main"]


def check_layout(config: GRPOConfig) -> None:
    """Refuse, by name, what this recipe does not run exactly."""
    g = config.gangs
    for name, size in (("pp_size", g.pp_size), ("cp_size", g.cp_size), ("ep_size", g.ep_size),
                       ("tp_size", g.tp_size)):
        if size > 1:
            raise UserError(f"config 'gangs.{name}={size}': recipes.grpo runs data "
                            "parallelism (FSDP2, HSDP, DDP) only: generation inside the unit "
                            f"is not built for this parallelism yet; set gangs.{name}=1")
    if g.fault_tolerance is not None:
        raise UserError("config 'gangs.fault_tolerance': recipes.grpo does not run torchft "
                        "replica groups yet (a window's groups are gathered over the DP "
                        "gang); unset it")
    g.check(config.trainer.data_parallel)
    gen, d = config.generation, config.data
    window = gen.window or config.trainer.num_accumulate
    if (window * d.batch_size) % gen.num_generations:
        raise UserError(f"config 'generation.num_generations={gen.num_generations}' does not "
                        f"divide the completions of a window (generation.window {window} x "
                        f"data.batch_size {d.batch_size}): a window holds whole groups")
    if config.rewards and config.reward_weights is not None \
            and len(config.reward_weights) != len(config.rewards):
        raise UserError(f"config 'reward_weights' has {len(config.reward_weights)} weights for "
                        f"{len(config.rewards)} reward functions")
    if not config.rewards and gen.replay is None:
        raise UserError("config 'rewards' is empty: name the reward functions, e.g. "
                        "--set 'rewards=[\"my_rewards:exact_match\"]'")


def load_rewards(config: GRPOConfig) -> list[RewardFunction]:
    out = []
    for path in config.rewards:
        fn = import_object(path, "reward function")
        out.append(RewardFunction(getattr(fn, "__name__", path.rpartition(":")[2]), path, fn))
    return out


def _prompts(config: GRPOConfig, tokenizer: Any, hf_config: Any, files: list[str],
             setting: str) -> PromptSet:
    context = getattr(hf_config, "max_position_embeddings", None) or 10**9
    return read_prompts(files, tokenizer, setting=setting, prompt_field=config.data.prompt_field,
                        max_prompt_tokens=context - config.generation.max_new_tokens)


def _probe(rewards: list[RewardFunction], prompts: PromptSet) -> None:
    """Call each reward function once, on the first prompt and an empty completion."""
    first = prompts[0]
    completion: Any = [{"role": "assistant", "content": ""}] if prompts.conversational else ""
    score(rewards, [first.prompt], [completion], [[]],
          {k: [v] for k, v in first.columns.items()})


@dataclass
class _Inputs:
    hf_config: Any
    tokenizer: Any
    train: PromptSet | None
    valid: PromptSet | None
    rewards: list[RewardFunction]
    replay: dict[int, list[dict[str, Any]]] | None


def _inputs(config: GRPOConfig, train: bool) -> _Inputs:
    check_layout(config)
    hf_config = check_model_dir(config.model.path, config.generation.max_new_tokens + 1)
    assert config.model.path is not None
    from recipes.preference.recipe import load_tokenizer  # the same rules; not at import time

    tokenizer = load_tokenizer(config.model.path, config.data.chat_template)
    check_tokenizer_fits(tokenizer, hf_config, config.model.path)
    if train and not config.data.files:
        raise UserError("config 'data.files' is empty: list the prompt files, e.g. "
                        "--set 'data.files=[prompts.jsonl]'")
    prompts = _prompts(config, tokenizer, hf_config, config.data.files, "data.files") \
        if train else None
    valid = _prompts(config, tokenizer, hf_config, config.data.valid_files,
                     "data.valid_files") if config.data.valid_files else None
    rewards = load_rewards(config)
    for some in (prompts, valid):
        if some is not None and rewards:
            _probe(rewards, some)
    replay = read_replay(config.generation.replay) if config.generation.replay and train \
        else None
    config.loss.settings(config.generation.max_new_tokens)
    return _Inputs(hf_config, tokenizer, prompts, valid, rewards, replay)


def check_inputs(config: GRPOConfig) -> None:
    """Open and check every input before anything is written (see the module docstring)."""
    _inputs(config, train=True)
    config.optimizer.build(nn.Linear(1, 1))  # its name and options


def _stop_ids(path: str, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: generation_config.json's, and the tokenizer's."""
    from transformers import GenerationConfig

    ids = set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:  # no generation_config.json
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


@dataclass
class _Setup:
    gangs: Gangs
    console: Console | None
    inputs: _Inputs
    model: nn.Module
    reference: ReferenceModel | None
    stop_ids: list[int]
    pad_id: int


def _setup(config: GRPOConfig, train: bool) -> _Setup:
    configure_logging()
    inputs = _inputs(config, train)
    g = config.gangs
    gangs, console = recipe_gangs(g.timeout_s, 1, 1, g.dp_shard_size)
    assert config.model.path is not None
    model = load_pretrained(config.model.path, gangs, data_parallel=config.trainer.data_parallel,
                            activation_checkpointing=config.model.activation_checkpointing,
                            **config.lora.load_options(config.trainer.seed))
    reference = None
    if config.loss.beta > 0:
        copy = None
        if config.lora.r is None:
            sharded = "fsdp" if config.trainer.data_parallel == "fsdp" else None
            copy = load_pretrained(config.model.path, gangs, data_parallel=sharded)
        reference = ReferenceModel(model, copy, "loss.beta > 0")
    tokenizer = inputs.tokenizer
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    if console:
        console.print(f"model: {config.model.path}, {parameter_line(model)}; loss "
                      f"{config.loss.kind}, beta {config.loss.beta}; reference: "
                      + ("none" if reference is None else "the base, adapters disabled"
                         if reference.is_policy_base else "a frozen copy"))
    return _Setup(gangs, console, inputs, model, reference, _stop_ids(config.model.path,
                                                                     tokenizer), pad)


def _generator(config: GRPOConfig, s: _Setup, temperature: float) -> HFGenerator:
    fsdp = config.trainer.data_parallel == "fsdp" and s.gangs.dp.size > 1
    return HFGenerator(s.model, stop_ids=s.stop_ids, pad_id=s.pad_id,
                       max_new_tokens=config.generation.max_new_tokens, temperature=temperature,
                       top_p=config.generation.top_p if temperature else 1.0,
                       gang=s.gangs.dp if fsdp else None)


def _valid(config: GRPOConfig, s: _Setup) -> tuple[list[Any], list[Any]]:
    if s.inputs.valid is None:
        return [], []
    decode = _decoder(s.inputs.tokenizer)
    unit = GRPOEvalUnit(s.model, s.inputs.valid, s.inputs.rewards, _generator(config, s, 0.0),
                        decode, config.reward_weights)
    return [unit], [ValidPrompts(len(s.inputs.valid), config.data.valid_batch_size,
                                 s.gangs.dp.rank, s.gangs.dp.size)]


def _decoder(tokenizer: Any) -> Any:
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def main(config: GRPOConfig, output_dir: Path, resume: bool) -> int:
    s = _setup(config, train=True)
    inputs, gen, t = s.inputs, config.generation, config.trainer
    assert inputs.train is not None
    window = gen.window or t.num_accumulate
    loss = config.loss.settings(gen.max_new_tokens)
    rollouts = Rollouts(
        generator=None if inputs.replay is not None else _generator(config, s, gen.temperature),
        replay=inputs.replay,
        file_of=RunDir(output_dir).rollout_file if gen.write_rollouts else None,
        decode=_decoder(inputs.tokenizer))
    try:
        unit = GRPOUnit(s.model, loss, inputs.train, inputs.rewards, rollouts,
                        num_generations=gen.num_generations, batch_size=config.data.batch_size,
                        window=window, num_accumulate=t.num_accumulate,
                        temperature=gen.temperature, pad_id=s.pad_id, seed=t.seed or 0,
                        reward_weights=config.reward_weights, reference=s.reference,
                        dp=s.gangs.dp)
    except ValueError as error:  # a batch that does not split over the DP ranks
        raise UserError(f"config: {error}") from None
    reader = PromptWindows(len(inputs.train), window * config.data.batch_size //
                           gen.num_generations, window * loss.num_iterations,
                           seed=config.data.shuffle_seed)
    valid_units, valid_readers = _valid(config, s)
    optimizer = config.optimizer.build(s.model)
    trainer_config = t if valid_units else t.model_copy(update={  # nothing to score
        "score_metric": None, "keep_best_n_checkpoints": None, "validate_every_n_steps": None,
        "validate_at_start": False})
    trainer = trainer_config.build(
        unit, reader, optimizer, output_dir=output_dir, gangs=s.gangs,
        lr_scheduler=warmup_cosine(optimizer, config.lr_scheduler, t.max_num_steps),
        valid_units=valid_units, valid_data_readers=valid_readers, resume=resume,
        run_config=config.model_dump(mode="json"), stateful={"grpo_window": unit})
    result = trainer.run()
    exported = RunDir(output_dir).hf
    if s.console:
        if exported.is_dir():
            inputs.tokenizer.save_pretrained(exported)
        s.console.print(f"stopped after step {result.num_steps}: {result.stop_reason}")
        if result.best_score is not None:
            s.console.print(f"best {config.trainer.score_metric}: {result.best_score:.4f} "
                            f"at step {result.best_step}")
    s.gangs.close()
    return 0


def eval_main(config: GRPOConfig, output_dir: Path, checkpoint: str) -> int:
    """``--eval-only``: greedy completions of data.valid_files scored by the rewards."""
    if not config.data.valid_files:
        raise UserError("--eval-only needs held-out prompts: set data.valid_files")
    s = _setup(config, train=False)
    units, readers = _valid(config, s)
    evaluate(units, readers, output_dir=output_dir, gangs=s.gangs, checkpoint=checkpoint,
             console=s.console)
    s.gangs.close()
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.grpo ARGS` as a function; returns the exit code."""
    return run_recipe(GRPOConfig, PRESETS, main, argv, prog="python -m recipes.grpo",
                      default_preset="default", resume_guard=RESUME_GUARD,
                      eval_main=eval_main, check_inputs=check_inputs)
