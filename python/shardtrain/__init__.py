"""shardtrain: submit, watch and compare GPT-2 training jobs on a shardtraind
daemon from Python.

    import shardtrain
    client = shardtrain.Client()            # the local daemon, as the CLI finds it
    job = client.submit(model="gpt2-tiny", data="brown", max_steps=50)
    job = client.wait(job.id)
    client.metrics(job.id)                  # a pandas DataFrame when pandas is installed

docs/python.md has the whole tour.
"""

from shardtrain.client import (Client, Comparison, Job, LogLine, StrategyResult, Update,
                               default_address)
from shardtrain.errors import (FailedPrecondition, InvalidArgument, JobDidNotSucceed, NotFound,
                               PermissionDenied, ResourceExhausted, ShardtrainError,
                               Unauthenticated, Unavailable)
from shardtrain.spec import build_spec, parse_size

__all__ = [
    "Client", "Comparison", "Job", "LogLine", "StrategyResult", "Update", "default_address",
    "ShardtrainError", "InvalidArgument", "NotFound", "Unauthenticated", "PermissionDenied",
    "Unavailable",
    "FailedPrecondition", "ResourceExhausted", "JobDidNotSucceed", "build_spec", "parse_size",
]
__version__ = "0.1.0"
