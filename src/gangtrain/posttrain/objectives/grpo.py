"""Online RL (`recipes.grpo`): GRPO, Dr. GRPO, DAPO and RLOO of a local Hugging Face causal
LM on prompts (`data.prompts`) scored by reward functions (import paths, TRL's calling
convention); the reference model when ``loss.beta > 0`` (`units.reference`: a frozen copy
laid out like the policy, or with LoRA the base with its adapters off); the generator (the
policy itself with a KV cache, `gangtrain.rl.generation.HFGenerator`) or recorded rollouts to
replay. docs/grpo.md maps every TRL `GRPOConfig` option to the config's settings.

Every input is opened and checked before anything is written (`check_inputs`): the model
directory, the prompt files (a missing field or a prompt longer than the context named by
file and line), each reward function called once on the first prompt (one that raises or
returns a wrong result named), the rollouts to replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator
from torch import nn

from gangtrain.app.config.import_path import import_object
from gangtrain.app.config.optimizers import OptimizerConfig
from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, TrainerConfig
from gangtrain.data.prompts import PromptSet, read_prompts
from gangtrain.data.vision_prompts import placeholder_ids
from gangtrain.models.hf.hf_config import check_model_dir, read_hf_config
from gangtrain.posttrain.objective import Objective, Parts
from gangtrain.posttrain.objectives import grpo_images
from gangtrain.posttrain.objectives.vision_ddp import policy_options
from gangtrain.rl.agents import AgentLoop, environment_tools
from gangtrain.rl.generation import HFGenerator
from gangtrain.rl.image_generation import ImageGenerator
from gangtrain.rl.rewards import RewardSource, build_reward_sources, score
from gangtrain.rl.rollouts import read_replay
from gangtrain.rl.tools import load_tools
from gangtrain.rl.windows import PromptWindows
from trainer.errors import UserError
from trainer.run_dir import RunDir
from units.online_rl import GRPOUnit, Rollouts
from units.online_rl.evaluation import GRPOEvalUnit, ValidPrompts
from units.online_rl.losses import GRPOKindLoss, GRPOLossSettings
from units.reference import ReferenceModel

__all__ = ["RESUME_GUARD", "GRPOConfig", "GRPOObjective"]

class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json, safetensors weights, tokenizer
    files with a chat template for conversational prompts). Required."""
    activation_checkpointing: bool = False


class OptimizerSection(OptimizerConfig):
    """AdamW with TRL's GRPOConfig defaults (lr 1e-6, no weight decay), or another
    torch.optim class by `optimizer.name`."""

    lr: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)


class DataSection(Section):
    files: list[str] = []
    """Prompts: JSONL or JSON files (or directories of them), TRL's prompt-only forms: a
    `prompt` field holding text or messages; other fields go to the reward functions."""
    valid_files: list[str] = []
    """Held-out prompts: validation generates one greedy completion each and records
    valid/reward; empty: no validation."""
    prompt_field: str = "prompt"
    chat_template: str | None = None
    """A Jinja chat template file replacing the tokenizer's own; null: the tokenizer's."""
    batch_size: PositiveInt = 8
    """The GLOBAL micro-batch in completions, across DP ranks (TRL's
    per_device_train_batch_size x processes)."""
    valid_batch_size: PositiveInt = 16
    """Held-out prompts a validation micro-batch, across DP ranks."""
    shuffle_seed: int = 0


class GenerationSection(Section):
    num_generations: int = Field(default=8, ge=2)
    """Completions a prompt: the group size."""
    max_new_tokens: PositiveInt = 256
    """TRL's max_completion_length."""
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    window: PositiveInt | None = None
    """Micro-batches generated at once (TRL's steps_per_generation); null: the trainer's
    num_accumulate. Independent of the accumulation: the loss is normalised per optimizer
    step whatever it is."""
    replay: str | None = None
    """A run's directory (or its rollouts/): train on its recorded completions and rewards
    instead of sampling."""
    write_rollouts: bool = True
    """Write OUT/rollouts/step_N.jsonl for every window."""
    max_turns: PositiveInt = 4
    """With tools or an environment: the most assistant turns of a trajectory (its budget
    of sampled tokens is max_new_tokens, over all its turns)."""
    tool_timeout: float = Field(default=10.0, gt=0)
    """Seconds a tool call may run; past it, the policy reads a timeout error."""
    tool_isolation: Literal["thread", "process"] = "thread"
    """thread: tools run in a thread of the trainer's process, abandoned at the timeout (a
    thread cannot be killed). process: tools= functions run in a worker process, killed at
    the timeout (a hard stop for tools that ignore it) and restarted; not with an
    environment (its methods hold the trajectory's state in the trainer's process)."""
    engine: Literal["hf", "vllm"] = "hf"
    """hf: the policy itself through `gangtrain.rl.engine` (slot KV cache, continuous
    batching). vllm: a colocated vLLM (needs vllm and a GPU; refused by name otherwise)."""


class GRPOConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    generation: GenerationSection = GenerationSection()
    loss: GRPOLossSettings = GRPOKindLoss()
    """One loss kind's settings, picked by `kind` (grpo, dapo, dr_grpo, rloo): each kind is a
    class of `units.online_rl.losses` that owns its settings, advantages and loss."""
    rewards: list[str | dict[str, Any]] = []
    """Reward sources, each an import path 'package.module:function' (TRL's convention,
    weight 1), or a mapping {fn: 'pkg.mod:fn', weight: 1.0} or {model: DIR, weight: 0.5}
    (a sequence-classification model directory, num_labels 1, scoring with its own tokenizer
    and template)."""
    reward_weights: list[float] | None = None
    """Deprecated: one weight per entry of `rewards` (give each entry its weight); null: the
    entries' own."""
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection(warmup_steps=0)
    trainer: TrainerConfig = FINETUNING_TRAINER.model_copy(update={
        "score_metric": "valid/reward", "validate_every_n_steps": 50,
        "checkpoint_every_n_steps": 50})
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()
    tools: list[str] = []
    """Tools for multi-turn rollouts, import paths 'pkg.mod:function' (TRL's tools=): the
    JSON schema comes from the signature and Google-style docstring, the template gets them
    as tools=; the policy's calls are run and their results appended as tool turns."""
    environment: str | None = None
    """An environment factory 'pkg.mod:Factory' (TRL's environment_factory): one environment
    per trajectory, reset(**row) its first observation, its public methods its tools."""

    @field_validator("tools")
    @classmethod
    def _tools(cls, paths: list[str]) -> list[str]:
        load_tools(paths, resolve=import_object)  # a schema that cannot be made: named here
        return paths

    @model_validator(mode="after")
    def _turn_settings_need_tools(self) -> GRPOConfig:
        """A multi-turn setting without tools or an environment would be ignored: refused."""
        if not self.tools and self.environment is None:
            gen = self.generation
            for name in ("max_turns", "tool_timeout", "tool_isolation"):
                if getattr(gen, name) != type(gen).model_fields[name].get_default():
                    raise ValueError(f"generation.{name} is set but there are no tools or "
                                     "environment (single-turn): set tools= or environment=, "
                                     "or leave it out")
        if self.environment is not None and self.generation.tool_isolation == "process":
            raise ValueError("generation.tool_isolation=process runs tools= functions in a "
                             "worker process; an environment's methods hold each "
                             "trajectory's state in the trainer's process and cannot run "
                             "there: set generation.tool_isolation=thread with environment=")
        return self

    @field_validator("environment")
    @classmethod
    def _environment(cls, path: str | None) -> str | None:
        if path is not None:
            factory = import_object(path, "environment")
            if not callable(factory):
                raise ValueError(f"environment '{path}' is a {type(factory).__name__}, not a "
                                 "factory")
            try:  # one environment, to make its tools' schemas here, before the run
                environment = factory()
            except Exception as error:  # noqa: BLE001 - the user's code: named, one line
                raise ValueError(f"environment '{path}': making one raised "
                                 f"{type(error).__name__}: {error}") from None
            environment_tools(environment)
        return path

    @field_validator("rewards")
    @classmethod
    def _importable(cls, entries: list[Any]) -> list[Any]:
        for entry in entries:  # imported under the config's import gate: named, not recorded
            path = entry if isinstance(entry, str) else entry.get("fn")
            if path is None:
                continue  # a model directory: opened with the other inputs
            fn = import_object(str(path), "reward function")
            if not callable(fn):
                raise ValueError(f"reward function '{path}' is a {type(fn).__name__}, not "
                                 "callable")
        return entries


# Settings a resumed run may not change: the model, the loss and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.prompt_field", "data.chat_template",
                "data.batch_size", "data.shuffle_seed", "generation.num_generations",
                "generation.max_new_tokens", "generation.window", "generation.replay",
                "loss.kind", "loss.beta", "loss.num_iterations", "rewards", "reward_weights",
                *LoraSection.RESUME_GUARD)


def check_settings(config: GRPOConfig) -> Any:
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
    if gen.engine == "vllm":
        _check_vllm()
    if config.rewards and config.reward_weights is not None \
            and len(config.reward_weights) != len(config.rewards):
        raise UserError(f"config 'reward_weights' has {len(config.reward_weights)} weights for "
                        f"{len(config.rewards)} reward functions")
    if not config.rewards and gen.replay is None:
        raise UserError("config 'rewards' is empty: name the reward functions, e.g. "
                        "--set 'rewards=[\"my_rewards:exact_match\"]'")
    return check_model_dir(config.model.path, gen.max_new_tokens + 1)


def _check_vllm() -> None:
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        raise UserError("config 'generation.engine=vllm': vllm is not importable here; "
                        "install it or set generation.engine=hf")
    if not torch.cuda.is_available():
        raise UserError("config 'generation.engine=vllm': no GPU here (vLLM runs on one); "
                        "set generation.engine=hf")
    raise UserError("config 'generation.engine=vllm': the colocated vLLM generator is not "
                    "built yet; set generation.engine=hf")


def load_rewards(config: GRPOConfig, device: Any = "cpu",
                 functions_only: bool = False) -> list[RewardSource]:
    """The config's reward sources on `device` (`functions_only`: leave the model
    directories out, for a check that needs no model)."""
    entries = [e for e in config.rewards if not functions_only
               or isinstance(e, str) or "fn" in e]
    try:
        return build_reward_sources(entries, device=device, resolve=import_object)
    except ValueError as error:  # an import path that does not import
        raise UserError(f"config 'rewards': {error}") from None


def _prompts(config: GRPOConfig, tokenizer: Any, hf_config: Any, files: list[str],
             setting: str) -> PromptSet:
    context = getattr(hf_config, "max_position_embeddings", None) or 10**9
    if grpo_images.uses_images(config):  # TRL's VLM prompts: read with the processor
        return grpo_images.read_prompts_with_images(
            config, tokenizer, hf_config, files, setting,
            context - config.generation.max_new_tokens)
    return read_prompts(files, tokenizer, setting=setting, prompt_field=config.data.prompt_field,
                        max_prompt_tokens=context - config.generation.max_new_tokens)


def _probe(rewards: list[RewardSource], prompts: PromptSet) -> None:
    """Call each reward source once, on the first prompt and an empty completion."""
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
    rewards: list[RewardSource]
    replay: dict[int, list[dict[str, Any]]] | None


def read_inputs(config: GRPOConfig, tokenizer: Any, train: bool) -> _Inputs:
    hf_config = read_hf_config(Path(config.model.path))
    if train and not config.data.files:
        raise UserError("config 'data.files' is empty: list the prompt files, e.g. "
                        "--set 'data.files=[prompts.jsonl]'")
    prompts = _prompts(config, tokenizer, hf_config, config.data.files, "data.files") \
        if train else None
    valid = _prompts(config, tokenizer, hf_config, config.data.valid_files,
                     "data.valid_files") if config.data.valid_files else None
    rewards = load_rewards(config, functions_only=True)  # the models load with the policy
    for some in (prompts, valid):
        if some is not None and rewards:
            _probe(rewards, some)
    if (config.tools or config.environment) and prompts is not None \
            and not prompts.conversational:
        raise UserError("config 'tools'/'environment': multi-turn rollouts need conversational "
                        "prompts (a 'prompt' of messages)")
    replay = read_replay(config.generation.replay) if config.generation.replay and train \
        else None
    return _Inputs(hf_config, tokenizer, prompts, valid, rewards, replay)


def _generator(config: GRPOConfig, a: Any, temperature: float) -> HFGenerator:
    fsdp = config.trainer.data_parallel == "fsdp" and a.gangs.dp.size > 1
    # (a VLM's generator passes a prompt's images to its prefill; text prompts as HFGenerator)
    more = {"placeholder_ids": placeholder_ids(a.processor)} if a.processor is not None else {}
    generator = ImageGenerator if more else HFGenerator
    return generator(a.model, **more, stop_ids=a.stop_ids, pad_id=a.pad_id,
                       max_new_tokens=config.generation.max_new_tokens, temperature=temperature,
                       top_p=config.generation.top_p if temperature else 1.0,
                       gang=a.gangs.dp if fsdp else None)


class GRPOObjective(Objective):
    """`grpo`: generate with the policy (or replay), score, and train on the window's
    completions; data parallelism only (FSDP2, HSDP, DDP)."""

    name = "grpo"
    config_type = GRPOConfig
    resume_guard = RESUME_GUARD

    def check(self, config: GRPOConfig) -> Any:
        return check_settings(config)

    def check_evaluation(self, config: GRPOConfig) -> None:
        if not config.data.valid_files:
            raise UserError("--eval-only needs held-out prompts: set data.valid_files")

    def read_data(self, config: GRPOConfig, tokenizer: Any, dp_rank: int, dp_size: int,
                  train: bool) -> _Inputs:
        inputs = read_inputs(config, tokenizer, train)
        grpo_images.check_image_layout(config, [inputs.train, inputs.valid], dp_size)
        return inputs

    def load_policy(self, config: GRPOConfig, a: Any) -> Any:
        return a.load_layout(**policy_options(config, a.hf_config))  # (a VLM under DDP)

    def load_reference(self, config: GRPOConfig, a: Any) -> Any:
        if config.loss.beta == 0:
            return None
        copy = a.frozen_copy() if config.lora.r is None else None
        return ReferenceModel(a.model, copy, "loss.beta > 0")

    def describe(self, config: GRPOConfig, a: Any) -> str:
        reference = ("none" if a.reference is None else "the base, adapters disabled"
                     if a.reference.is_policy_base else "a frozen copy")
        return f"; loss {config.loss.kind}, beta {config.loss.beta}; reference: {reference}"

    def build(self, config: GRPOConfig, a: Any, data: _Inputs, train: bool) -> Parts:
        # Built after the gangs: a reward model is placed on the policy's device.
        rewards = load_rewards(config, a.gangs.device) if data.rewards or config.rewards else []
        valid_units, valid_readers = _valid(config, a, data, rewards)
        if not train:
            return Parts(None, None, valid_units, valid_readers)
        assert a.output_dir is not None
        gen, t = config.generation, config.trainer
        assert data.train is not None
        window = gen.window or t.num_accumulate
        loss = config.loss.with_max_new_tokens(gen.max_new_tokens)
        generator = None if data.replay is not None else _generator(config, a, gen.temperature)
        rollouts = Rollouts(
            generator=generator, replay=data.replay,
            file_of=RunDir(a.output_dir).rollout_file if gen.write_rollouts else None,
            decode=_decoder(a.tokenizer),
            agent=_agent(config, a, generator, data) if generator is not None else None)
        try:
            unit = GRPOUnit(a.model, loss, data.train, rewards, rollouts,
                            num_generations=gen.num_generations,
                            batch_size=config.data.batch_size, window=window,
                            num_accumulate=t.num_accumulate, temperature=gen.temperature,
                            pad_id=a.pad_id, seed=t.seed or 0,
                            reward_weights=config.reward_weights, reference=a.reference,
                            dp=a.gangs.dp)
        except ValueError as error:  # a batch that does not split over the DP ranks
            raise UserError(f"config: {error}") from None
        reader = PromptWindows(len(data.train), window * config.data.batch_size //
                               gen.num_generations, window * loss.num_iterations,
                               seed=config.data.shuffle_seed)
        updates = {} if valid_units else {  # nothing to score
            "score_metric": None, "keep_best_n_checkpoints": None,
            "validate_every_n_steps": None, "validate_at_start": False}
        return Parts(unit, reader, valid_units, valid_readers, stateful={"grpo_window": unit},
                     trainer_updates=updates)

    def check_inputs(self, config: GRPOConfig, tokenizer: Any) -> None:
        read_inputs(config, tokenizer, train=True)
        config.optimizer.build(nn.Linear(1, 1))  # its name and options


def _agent(config: GRPOConfig, a: Any, generator: HFGenerator, data: _Inputs
           ) -> AgentLoop | None:
    """The multi-turn loop over the generator's engine when tools or an environment are set."""
    if not config.tools and config.environment is None:
        return None
    gen, prompts = config.generation, data.train
    assert prompts is not None
    context = getattr(data.hf_config, "max_position_embeddings", None) or 1 << 15
    longest = max(len(prompts[i].ids) for i in range(len(prompts)))
    # the KV slots hold the prompt (plus the tools' schemas), every turn and every result;
    # a trajectory that would outgrow them is cut (truncated), never an error
    capacity = min(context, 2 * longest + gen.max_new_tokens + gen.max_turns * 512)
    factory = import_object(config.environment, "environment") if config.environment else None
    return AgentLoop(generator.engine, a.tokenizer,
                     tools=load_tools(config.tools, resolve=import_object),
                     environment_factory=factory, max_turns=gen.max_turns,
                     max_new_tokens=gen.max_new_tokens, capacity=capacity,
                     tool_timeout=gen.tool_timeout, tool_isolation=gen.tool_isolation)


def _valid(config: GRPOConfig, a: Any, data: _Inputs, rewards: list[RewardSource]
           ) -> tuple[list[Any], list[Any]]:
    if data.valid is None:
        return [], []
    unit = GRPOEvalUnit(a.model, data.valid, rewards, _generator(config, a, 0.0),
                        _decoder(a.tokenizer), config.reward_weights)
    return [unit], [ValidPrompts(len(data.valid), config.data.valid_batch_size,
                                 a.gangs.dp.rank, a.gangs.dp.size)]


def _decoder(tokenizer: Any) -> Any:
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
