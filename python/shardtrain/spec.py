"""Job specs from Python: a dict, a YAML file or keyword arguments, with the
names `shardtrain submit` takes (``batch_size`` or ``"batch-size"``), turned
into the daemon's ``shardtrain.v1.JobSpec``.

The daemon validates a spec (the same rules as the CLI); here only the names
and the Python types are checked, so a typo fails before anything is sent.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Dict, Mapping, Optional, Union

from shardtrain.v1 import job_pb2

PathLike = Union[str, "os.PathLike[str]"]

# Job-level keys: name -> JobSpec field.
_JOB_FIELDS = {
    "name": "name",
    "priority": "priority",
    "priority_class": "priority_class",
    "model": "model",
    "data": "data",
    "world_size": "world_size",
    "max_restarts": "max_restarts",
}
# StrategyOptions: key -> field.
_STRATEGY_FIELDS = {
    "bucket_mb": "bucket_mb",
    "reshard_after_forward": "reshard_after_forward",
    "prefetch": "prefetch",
    "fsdp_no_sync": "fsdp_no_sync",
    "shard_group_size": "shard_group_size",
    "activation_checkpointing": "activation_checkpointing",
    "comm_timeout": "comm_timeout_seconds",
    "pipeline_stages": "pipeline_stages",
    "tensor_parallel": "tensor_parallel",
    "pipeline_split": "pipeline_split",
    "micro_batches": "micro_batches",
    "pipeline_schedule": "pipeline_schedule",
    "virtual_stages": "virtual_stages",
}
# TrainerOptions: key -> field.
_TRAINER_FIELDS = {
    name: name
    for name in (
        "batch_size", "seq_len", "grad_accum", "max_steps", "epochs", "lr",
        "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2",
        "eps", "grad_clip", "seed", "precision", "eval_every", "eval_steps",
        "checkpoint_every", "shuffle", "peak_flops", "init_from",
        "threads_as_ranks")
}
_TRAINER_FIELDS["memory_cap"] = "memory_cap_bytes"
# Keys handled on their own.
_SPECIAL = ("labels", "strategy", "device", "min_world_size")

KEYS = sorted([*_JOB_FIELDS, *_STRATEGY_FIELDS, *_TRAINER_FIELDS, *_SPECIAL])

# As the CLI reads sizes (step_metrics.cc ParseBytes): K, Ki, KiB binary;
# KB decimal.
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _SIZE_UNITS.update({_p: 2**(10 * _i), _p + "i": 2**(10 * _i), _p + "ib": 2**(10 * _i),
                        _p + "b": 10**(3 * _i)})


def parse_size(value: Union[int, str]) -> int:
    """Bytes from an int or a size like ``"512MiB"`` or ``"80GB"``."""
    if isinstance(value, bool):
        raise ValueError(f"memory_cap: got {value!r}; expected bytes or a size like '512MiB'")
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"memory_cap: got {value!r}; expected bytes or a size like '512MiB'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def _normalise(key: str) -> str:
    return key.strip().replace("-", "_")


def _unknown(key: str) -> ValueError:
    close = difflib.get_close_matches(_normalise(key), KEYS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(KEYS)}"
    return ValueError(f"unknown job spec key {key!r}{hint}")


def load_yaml(path: PathLike) -> Dict[str, Any]:
    """A job YAML file (the format of ``shardtrain submit -f``) as a dict."""
    import yaml  # Debian's python3-yaml; needed only for files

    with open(path) as f:
        loaded = yaml.safe_load(f)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: a job file is a mapping of keys to values")
    return loaded


def build_spec(spec: Union[None, Mapping[str, Any], PathLike, job_pb2.JobSpec] = None,
               **overrides: Any) -> job_pb2.JobSpec:
    """The JobSpec for `spec` (a dict, a YAML path or a JobSpec) with
    `overrides` (keyword arguments) applied on top, as flags win over ``-f``.

    Relative ``data`` and ``init_from`` paths become absolute, as the CLI makes
    them; ``model`` defaults to ``gpt2-tiny`` and ``world_size`` to 1.
    """
    if isinstance(spec, job_pb2.JobSpec):
        out = job_pb2.JobSpec()
        out.CopyFrom(spec)
        values: Dict[str, Any] = {}
    else:
        out = job_pb2.JobSpec(model="gpt2-tiny", world_size=1)
        if spec is None:
            values = {}
        elif isinstance(spec, Mapping):
            values = dict(spec)
        else:
            values = load_yaml(spec)
    values.update(overrides)
    for key, value in values.items():
        _apply(out, _normalise(key), key, value)
    if out.data and out.data != "brown":
        out.data = os.path.abspath(out.data)
    if out.trainer.HasField("init_from"):
        out.trainer.init_from = os.path.abspath(out.trainer.init_from)
    return out


def _apply(out: job_pb2.JobSpec, key: str, given: str, value: Any) -> None:
    try:
        if key in _JOB_FIELDS:
            setattr(out, _JOB_FIELDS[key], value)
        elif key in _STRATEGY_FIELDS:
            setattr(out.strategy, _STRATEGY_FIELDS[key], value)
        elif key == "memory_cap":
            out.trainer.memory_cap_bytes = parse_size(value)
        elif key in _TRAINER_FIELDS:
            field = _TRAINER_FIELDS[key]
            if field in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2",
                         "eps", "grad_clip", "peak_flops") and isinstance(value, int):
                value = float(value)
            setattr(out.trainer, field, value)
        elif key == "strategy":
            out.strategy.name = value
        elif key == "labels":
            if not isinstance(value, Mapping):
                raise TypeError("labels: expected a mapping of key to value")
            out.labels.clear()
            for k, v in value.items():
                out.labels[str(k)] = str(v)
        elif key == "device":
            kind = str(value).lower().split(":")[0]  # "cuda:1" as the CLI takes it
            kinds = {"cpu": job_pb2.CPU, "cuda": job_pb2.GPU, "gpu": job_pb2.GPU}
            if kind not in kinds:
                raise ValueError(f"device: got {value!r}; expected cpu or cuda")
            out.device_kind = kinds[kind]
        elif key == "min_world_size":
            out.elastic.min_world_size = value
        else:
            raise _unknown(given)
    except TypeError as e:
        raise TypeError(f"job spec key {given!r}: got {value!r} ({type(value).__name__}): {e}") from None
