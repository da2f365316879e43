"""Did-you-mean hints for an unknown setting, by meaning first and spelling second.

Spelling alone points the wrong way for the names users bring from other trainers:
`max_val_steps` is closest in spelling to `max_num_steps`, and `enable_gradient_checkpointing`
to `keep_last_n_checkpoints`. So the names those trainers use (HF `TrainingArguments`, TRL's
`SFTConfig`, Lightning's `Trainer`, fairseq2, torchtitan) map to ours by meaning; a known
name whose setting does not exist here gets no spelling guess either. A meaning written
`section.field` names a field whose name other sections use too: it is hinted in its own
section, or by that whole path where the config's first field of the name is that one.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

MEANINGS: dict[str, str] = {
    # validation size and schedule
    "max_val_steps": "max_num_valid_batches",
    "max_eval_steps": "max_num_valid_batches",
    "eval_steps": "validate_every_n_steps",
    "limit_val_batches": "max_num_valid_batches",
    "val_check_interval": "validate_every_n_steps",
    "eval_every_n_steps": "validate_every_n_steps",
    "check_val_every_n_epoch": "validate_every_n_epochs",
    "eval_every_n_epochs": "validate_every_n_epochs",
    # length
    "max_steps": "max_num_steps",
    "num_train_steps": "max_num_steps",
    "max_epochs": "max_num_data_epochs",
    "num_train_epochs": "max_num_data_epochs",
    "num_epochs": "max_num_data_epochs",
    # the step
    "gradient_accumulation_steps": "num_accumulate",
    "accumulate_grad_batches": "num_accumulate",
    "grad_accum_steps": "num_accumulate",
    "max_grad_norm": "max_gradient_norm",
    "gradient_clip_val": "max_gradient_norm",
    "clip_grad_norm": "max_gradient_norm",
    "enable_gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing": "activation_checkpointing",
    "activation_checkpoint": "activation_checkpointing",
    "mixed_precision": "trainer.dtype",
    "bf16": "trainer.dtype",
    "fp16": "trainer.dtype",
    "precision": "trainer.dtype",
    # checkpoints
    "save_steps": "checkpoint_every_n_steps",
    "checkpoint_every_n_train_steps": "checkpoint_every_n_steps",
    "every_n_train_steps": "checkpoint_every_n_steps",
    "save_total_limit": "keep_last_n_checkpoints",
    "save_top_k": "keep_best_n_checkpoints",
    "resume_from_checkpoint": "resume_from",
    "ckpt_path": "resume_from",
    "metric_for_best_model": "score_metric",
    "greater_is_better": "lower_better",
    # output
    "logging_steps": "publish_metrics_every_n_steps",
    "log_every_n_steps": "publish_metrics_every_n_steps",
    "seed_everything": "seed",
    # TRL's SFTConfig and HF's TrainingArguments, by the SFT recipe's names
    "max_length": "seq_len",
    "max_seq_length": "seq_len",
    "dataset_text_field": "text_field",
    "completion_only_loss": "train_on",
    "assistant_only_loss": "train_on",
    "chat_template_path": "chat_template",
    "dataset_num_proc": "num_workers",
    "padding_free": "padding",
    "per_device_train_batch_size": "batch_size",
    "per_device_eval_batch_size": "valid_batch_size",
    "data_seed": "shuffle_seed",
    "learning_rate": "lr",
    "adam_beta1": "betas",
    "adam_beta2": "betas",
    "adam_epsilon": "eps",
    "optim": "optimizer.name",
    "lr_scheduler_type": "lr_scheduler.type",
    "torch_dtype": "model.dtype",
    "model_init_kwargs": "model.dtype",
}


def did_you_mean(name: str, allowed: Sequence[str],
                 elsewhere: Callable[[str], str | None] | None = None) -> str | None:
    """The setting `name` most likely means: among `allowed` by meaning, else where
    `elsewhere(field)` finds that field in the rest of the config (a dotted path), else by
    spelling, unless `name` is a known name of a setting this config lacks (None then)."""
    meant = MEANINGS.get(name.lower())
    if meant is not None:
        field = meant.rpartition(".")[2]
        if field in allowed:
            return field
        found = elsewhere(field) if elsewhere is not None else None
        return found if "." not in meant or found == meant else None
    close = difflib.get_close_matches(name, allowed, n=1)
    return close[0] if close else None
