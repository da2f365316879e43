"""`TrainerSettings`: every setting of the Trainer, defined once.

Name, type, default, validation and a one-line description live here: `Trainer` spells out
each as a keyword argument with the same default (for editors and type checkers; a test
holds the two equal) and validates them with this model, `TrainerConfig` (YAML, recipes)
extends it, and `help(Trainer)` lists these descriptions. Every mistake is caught at
construction, before any step runs, with a message that names the setting (TNT PR #826
crashed at run time instead).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainer.hints import did_you_mean
from trainer.observe.profiler import ProfilerConfig

Precision = Literal["fp32", "bf16", "fp16"]
Threads = int | Literal["auto"]


class TrainerSettings(BaseModel):
    """The Trainer's settings (see each field's description)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    # -- how long ------------------------------------------------------------------------
    max_num_steps: int | None = Field(None, ge=1, description=(
        "Stop after this many optimizer steps (skipped steps count). None: no limit."))
    max_num_data_epochs: int | None = Field(None, ge=1, description=(
        "Stop after this many passes over the data reader. None: until the reader is spent "
        "(an epoch that yields nothing) or another limit."))
    num_accumulate: int = Field(1, ge=1, description=(
        "Micro-batches drawn per step; the step's gradient is that of the mean loss over "
        "every target of all of them on all DP ranks. The last window of an epoch may be "
        "shorter."))
    fsdp_reduce_every_micro_batch: bool = Field(True, description=(
        "FSDP2 with num_accumulate > 1: reduce-scatter gradients after every micro-batch, "
        "keeping only sharded gradients (True), or after the last only (False): N-1 fewer "
        "reduce-scatters a step, but every rank holds the unsharded gradients of the whole "
        "model meanwhile. HSDP's all-reduce across replicas runs on the last micro-batch "
        "either way."))
    # -- validation and scores -------------------------------------------------------------
    validate_every_n_steps: int | None = Field(None, ge=1, description=(
        "Run the valid units every this many steps (needs valid_units)."))
    validate_at_start: bool = Field(False, description="Also validate before the first step.")
    validate_at_end: bool = Field(True, description=(
        "Validate the final step when it was not a scheduled validation step."))
    score_metric: str | None = Field(None, description=(
        "The validation metric that scores a step, '<valid unit name>/<metric>' "
        "(e.g. 'valid/loss'); needed by keep_best_n_checkpoints and early_stopper."))
    lower_better: bool | None = Field(None, description=(
        "Direction of score_metric. None: what the valid unit declares for the metric "
        "(accuracy, F1, BLEU higher-better; loss, perplexity lower-better; see "
        "EvalUnit.higher_better_metrics); a contradiction is an error. The built-in early "
        "stoppers take it from here."))
    # -- checkpoints -----------------------------------------------------------------------
    checkpoint_every_n_steps: int | None = Field(None, ge=1, description=(
        "Save a checkpoint every this many steps (and at the end); None: no checkpoints, "
        "no resume."))
    keep_last_n_checkpoints: int | None = Field(None, ge=1, description=(
        "Retention: keep the newest N checkpoints (a union with keep_best; the newest is "
        "always kept). None with keep_best unset: keep all."))
    keep_best_n_checkpoints: int | None = Field(None, ge=1, description=(
        "Retention: keep the N best-scoring checkpoints; every checkpoint step must be a "
        "validation step (checkpoint_every_n_steps a multiple of validate_every_n_steps)."))
    async_checkpoint: bool = Field(False, description=(
        "Write checkpoints on a background thread from a host copy; training goes on. The "
        "copy of parameters and optimizer state overlaps the next forward and backward; the "
        "next optimizer step waits for it."))
    # -- the step --------------------------------------------------------------------------
    max_gradient_norm: float | None = Field(None, gt=0, description=(
        "Clip the global L2 norm of the (normalised, unscaled) gradients to this."))
    amp: bool = Field(True, description=(
        "Run the unit's forward under torch.autocast with `dtype` (bf16/fp16). Validation "
        "runs without autocast."))
    dtype: Precision = Field("fp32", description=(
        "Training precision: 'fp32', 'bf16' (autocast) or 'fp16' (autocast and a dynamic "
        "loss scale)."))
    fp16_loss_scale: tuple[float, float] = Field((2.0**15, 1e-4), description=(
        "(initial, minimum) dynamic fp16 loss scale; falling below the minimum is an error."))
    fp16_loss_scale_window: int | None = Field(None, ge=1, description=(
        "Clean steps before the fp16 scale doubles; default 2**14 / (dp size * "
        "num_accumulate)."))
    max_consecutive_non_finite: int = Field(0, ge=0, description=(
        "0: a non-finite loss or gradient stops the run with an error naming the step, "
        "before anything is saved. N > 0: such steps are skipped, and N + 1 in a row stop "
        "the run."))
    anomaly_detection: bool = Field(False, description=(
        "torch.autograd.detect_anomaly around the run (slow; for debugging)."))
    compile_model: bool = Field(False, description=(
        "torch.compile the unit's model (the module inside DDP, never the wrapper)."))
    num_threads: Threads = Field("auto", description=(
        "Intra-op CPU threads. 'auto': decided before the first step, never by timing: 1 "
        "thread for a model under 50M parameters, else this process's share of the cores "
        "(logged, published once, kept in the checkpoints: a resumed run keeps it). An int "
        "sets it. OMP_NUM_THREADS or a "
        "torch.set_num_threads call of the user always wins. No effect on CUDA; see "
        "trainer.lifecycle.threads."))
    seed: int | None = Field(2, description=(
        "Seed of torch, numpy and random (plus the rank). None: leave them as they are."))
    # -- output ------------------------------------------------------------------------
    profiler: ProfilerConfig | None = Field(None, description=(
        "Record a torch.profiler trace of record_steps steps after skip_steps under "
        "OUTPUT_DIR/profile/ ({skip_steps: 5, record_steps: 3}); see trainer.profiler."))
    publish_metrics_every_n_steps: int = Field(10, ge=1, description=(
        "Sync and record the train metrics every this many steps (the only per-step host "
        "reads happen then)."))
    progress: bool = Field(True, description="Show the rich progress bar on rank 0.")
    wandb_project: str | None = Field(None, description=(
        "Also record to Weights & Biases under this project (pip install gangtrain[wandb]; "
        "WANDB_MODE=offline works)."))
    # -- epoch schedules, validation size, checkpoint policies, resume point -------------
    validate_every_n_epochs: int | None = Field(None, ge=1, description=(
        "Run the valid units at the end of every this many epochs (passes over the data "
        "reader); exclusive with validate_every_n_steps."))
    checkpoint_every_n_epochs: int | None = Field(None, ge=1, description=(
        "Save a checkpoint at the end of every this many epochs (and at the end); "
        "exclusive with checkpoint_every_n_steps."))
    max_num_valid_batches: int | None = Field(None, ge=1, description=(
        "Read at most this many batches from each valid data reader at each validation "
        "(on each DP rank). None: the whole reader."))
    load_best_model_at_end: bool = Field(False, description=(
        "After run(), the model holds the weights of the best-scoring checkpoint (bitwise), "
        "not the last step's; needs checkpoints and a score_metric."))
    model_checkpoint_every_n_steps: int | None = Field(None, ge=1, description=(
        "Also save the model's weights alone every this many steps (and at the end) under "
        "OUTPUT_DIR/models/step_N/: model.safetensors, or a HF model's directory. They are "
        "for inference and evaluation, not for resuming."))
    keep_last_n_model_checkpoints: int | None = Field(None, ge=1, description=(
        "Retention of the model-only saves: keep the newest N. None: keep all."))
    resume_from: str | None = Field(None, description=(
        "Which checkpoint a resume starts from: 'last' (the newest complete one, what None "
        "does), 'best', 'step_N', or a step directory's path (another run's included). The "
        "data position and RNG come with it; on the command line --resume-from."))

    @model_validator(mode="after")
    def _check_num_threads(self) -> TrainerSettings:
        if self.num_threads != "auto" and self.num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or >= 1, got {self.num_threads!r}")
        return self

    @model_validator(mode="after")
    def _check_checkpoint_needs(self) -> TrainerSettings:
        for what in ("validate", "checkpoint"):  # one schedule each, never both
            if (getattr(self, f"{what}_every_n_steps") is not None
                    and getattr(self, f"{what}_every_n_epochs") is not None):
                raise ValueError(f"{what}_every_n_steps and {what}_every_n_epochs are "
                                 "exclusive: give one of them")
        if (self.keep_last_n_model_checkpoints is not None
                and self.model_checkpoint_every_n_steps is None):
            raise ValueError("keep_last_n_model_checkpoints needs model_checkpoint_every_n_steps")
        schedule = ("checkpoint_every_n_steps" if self.checkpoint_every_n_steps is not None
                    else "checkpoint_every_n_epochs")
        if self.checkpoint_every_n_steps is None and self.checkpoint_every_n_epochs is None:
            for name in ("keep_last_n_checkpoints", "keep_best_n_checkpoints",
                         "load_best_model_at_end"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name} needs checkpoint_every_n_steps (or _epochs)")
            return self
        if self.load_best_model_at_end and self.score_metric is None:
            raise ValueError("load_best_model_at_end needs a score_metric (e.g. 'valid/loss')")
        every = getattr(self, schedule)
        validate_name = schedule.replace("checkpoint", "validate")
        validate = getattr(self, validate_name)
        if self.keep_best_n_checkpoints and (validate is None or every % validate != 0):
            raise ValueError(
                "keep_best_n_checkpoints needs every checkpoint step to be a validated step: "
                f"{schedule} ({every}) must be a multiple of {validate_name} ({validate})"
            )
        return self


def validate_settings(settings: dict[str, Any], model: type[TrainerSettings] = TrainerSettings
                      ) -> TrainerSettings:
    """`model(**settings)`, with pydantic's errors turned into one line per setting: a
    `TypeError` for an unknown keyword (with the closest known one), else a `ValueError`."""
    unknown = [key for key in settings if key not in model.model_fields]
    if unknown:
        close = did_you_mean(unknown[0], list(model.model_fields))
        hint = f"; did you mean '{close}'?" if close else ""
        raise TypeError(f"Trainer got an unexpected keyword argument '{unknown[0]}'{hint}")
    try:
        return model(**settings)
    except ValidationError as err:
        raise ValueError(describe_errors(err)) from None


def describe_errors(err: ValidationError) -> str:
    lines = []
    for error in err.errors():
        where = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        message = message.replace("Input should be", "must be")
        if where:
            lines.append(f"{where} {message}, got {error['input']!r}")
        else:
            lines.append(message)
    return "; ".join(lines)


ARGUMENTS_DOC = """
    Args:
        unit: turns a batch into `(summed loss, num_targets)`; its `model` is trained.
        data_reader: any iterable of batches (a pass is an epoch); with `state_dict()` and
            `load_state_dict()` (e.g. `StatefulDataLoader`) it resumes mid-epoch exactly.
        optimizer: over the model's parameters. `AdamW(fused=True)` normalises, clips and
            skips on the device (no host read a step).
        output_dir: where checkpoints (`checkpoints/`), metrics (`metrics/*.jsonl`) and
            TensorBoard events (`tb/`) go.
        gangs: the process gangs (`gangs.setup_gangs`); default: the torchrun world under
            torchrun (`setup_gangs(setup_root_gang())`), else one process.
        lr_scheduler: stepped once per step, skipped steps included.
        valid_units: `EvalUnit`s run at each validation; their metrics are recorded as
            `<unit name>/<metric>`. To split validation data over DP ranks, give each rank
            its shard: metrics are summed over the DP gang.
        valid_data_readers: one reader per valid unit, iterated afresh at each validation.
        early_stopper: `(step_nr, score) -> bool`, called on rank 0 after each scheduled
            validation (never the extra one at the end of a run: its score is recorded and
            may rank for best); see `trainer.early_stoppers` for the built-ins.
        recorders: where metrics go (rank 0); a list replaces the defaults (JSONL,
            TensorBoard, the console, W&B when `wandb_project` is set).
        callbacks: `Callback`s, called on every rank at the run's events; one with
            `state_dict`/`load_state_dict` is checkpointed as `callback.<state_key or class>`.
        stateful: other objects with `state_dict`/`load_state_dict` (a curriculum, a
            counter), saved with every checkpoint under their name and restored on resume.
        resume: continue from the newest complete checkpoint in `output_dir`, if any.
            Starting over (False) where another run left checkpoints or metrics is refused.
        overwrite: start over, deleting another run's checkpoints, metrics and TensorBoard
            files in `output_dir` first.
        run_config: the run's whole config (plain data), kept beside each checkpoint as
            `config.yaml` (sha256: the manifest's `config_digest`) and compared on resume,
            naming changed keys in a warning. Default: these settings, `{"trainer": {...}}`.
        replica_group: this job's seat among torchft replica groups
            (`trainer.fault_tolerance.ReplicaGroup`, YAML `gangs.fault_tolerance`): steps
            commit over the live groups; a restarted group recovers live from a peer.
        fault_tolerance: the same from its settings (`FaultToleranceSettings`, YAML
            `gangs.fault_tolerance`): the Trainer joins the groups (a local lighthouse when
            no address is given) and leaves them when its run ends. Not with `replica_group`.
        model_files: the model family's files (`trainer.checkpoint.model_files.ModelFiles`):
            written beside each checkpoint's weights, checked before loading, and the best
            checkpoint's export at the end. Default: the family registered for the model
            (`gangtrain.models.hf` for a transformers model: OUTPUT_DIR/hf/), else the
            best weights as `checkpoints/best_model.safetensors`.
"""
"""The Trainer's arguments other than settings, for `help(Trainer)`."""


def settings_doc(model: type[BaseModel] = TrainerSettings) -> str:
    """Each setting with its default and description, for `help(Trainer)`."""
    lines = []
    for name, field in model.model_fields.items():
        default = "required" if field.is_required() else f"default {field.default!r}"
        lines.append(f"    {name} ({default}):\n        {field.description}")
    return "\n".join(lines)
