"""The Python client of shardtraind: what the ``shardtrain`` CLI does with
jobs, from a notebook or a script."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
import re
import statistics
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from shardtrain import errors
from shardtrain.spec import PathLike, build_spec
from shardtrain.v1 import cluster_service_pb2, cluster_service_pb2_grpc
from shardtrain.v1 import job_pb2, job_service_pb2, job_service_pb2_grpc

TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
DEFAULT_ADDRESS = "127.0.0.1:50551"


def _state_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "shardtrain", "state")


def default_address() -> str:
    """Where the CLI would connect: $SHARDTRAIN_ADDRESS, else the local
    daemon's published endpoint, else 127.0.0.1:50551."""
    if os.environ.get("SHARDTRAIN_ADDRESS"):
        return os.environ["SHARDTRAIN_ADDRESS"]
    try:
        with open(os.path.join(_state_dir(), "endpoint")) as f:
            address = f.read().strip()
            if address:
                return address
    except OSError:
        pass
    return DEFAULT_ADDRESS


def _enum_name(enum_type: Any, number: int) -> Any:
    """The value's name; the number itself for a value this client does not
    know (a newer daemon's)."""
    value = enum_type.values_by_number.get(number)
    return value.name if value is not None else number


def _value(field: Any, value: Any) -> Any:
    if field.enum_type is not None:
        return _enum_name(field.enum_type, value)
    if field.type == field.TYPE_MESSAGE:
        return _row(value)
    return value


def _row(message: Any) -> Dict[str, Any]:
    """A message's fields by proto name, numbers as numbers, enums by name;
    an unset optional field is None."""
    row: Dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            row[field.name] = {k: _value(value_field, v) for k, v in value.items()}
        elif field.label == field.LABEL_REPEATED:
            row[field.name] = [_value(field, v) for v in value]
        elif field.has_presence and field.type != field.TYPE_MESSAGE and not message.HasField(field.name):
            row[field.name] = None
        else:
            row[field.name] = _value(field, value)
    return row


def _time(ms: int) -> Optional[_dt.datetime]:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.timezone.utc) if ms > 0 else None


@dataclasses.dataclass(frozen=True)
class Job:
    """A job as the daemon reports it. ``proto`` is the full message."""

    id: str
    name: str
    state: str  # QUEUED, STARTING, RUNNING, RESTARTING, PREEMPTED, SUCCEEDED, FAILED, CANCELLED
    state_reason: str
    owner: str  # the user who submitted it ("" on a daemon without users)
    priority: int  # effective: the priority class's, else spec.priority
    preemptions: int
    # Times an elastic job's mesh changed while it ran, and the seconds it
    # went without a step across them.
    remeshes: int
    remesh_seconds_lost: float
    eta_seconds: float  # RUNNING: its pace so far times the steps left; else 0
    model: str
    strategy: str
    world_size: int
    restarts: int
    # The whole mesh in compare's notation ("pp2xfsdp2", "tp2"; "auto: tp4"
    # once auto has chosen), as the daemon names it.
    mesh: str
    submitted: Optional[_dt.datetime]
    started: Optional[_dt.datetime]
    ended: Optional[_dt.datetime]
    failure: Optional[Dict[str, Any]]  # reason, rank, message, log_tail
    last_step: Optional[Dict[str, Any]]
    output_dir: str
    spec: Dict[str, Any]
    proto: job_pb2.Job = dataclasses.field(repr=False)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @staticmethod
    def from_proto(job: job_pb2.Job) -> "Job":
        return Job(
            id=job.id,
            name=job.spec.name,
            state=_enum_name(job_pb2.JobState.DESCRIPTOR, job.state),
            state_reason=job.state_reason,
            owner=job.owner,
            priority=job.priority,
            preemptions=job.preemptions,
            remeshes=job.remeshes,
            remesh_seconds_lost=job.remesh_seconds_lost,
            eta_seconds=job.eta_seconds,
            model=job.spec.model,
            strategy=job.spec.strategy.name,
            world_size=job.world_size or job.spec.world_size,
            restarts=job.restarts,
            mesh=job.mesh or job.spec.strategy.name,
            submitted=_time(job.submit_time_unix_ms),
            started=_time(job.start_time_unix_ms),
            ended=_time(job.end_time_unix_ms),
            failure=_row(job.failure) if job.state == job_pb2.FAILED else None,
            last_step=_row(job.last_step) if job.HasField("last_step") else None,
            output_dir=job.output_dir,
            spec=_row(job.spec),
            proto=job,
        )


@dataclasses.dataclass(frozen=True)
class Update:
    """One item of :meth:`Client.watch`: ``kind`` says which field is set.

    - ``"job"``: the job as it is when watching starts (``job``);
    - ``"state"``: a state change (``state``, ``message``);
    - ``"step"``: rank 0's metrics of one step (``step``, a dict of
      StepMetrics fields).
    """

    kind: str
    job: Optional[Job] = None
    state: Optional[str] = None
    message: str = ""
    step: Optional[Dict[str, Any]] = None


@dataclasses.dataclass(frozen=True)
class LogLine:
    rank: int
    line: str


@dataclasses.dataclass(frozen=True)
class StrategyResult:
    """One entry's run in :meth:`Client.compare`."""

    strategy: str  # the entry as given: "ddp", "pp2xfsdp2", "auto"
    job_id: str
    world_size: int
    batch_size: int  # per data-parallel replica
    final_loss: float
    val_loss: Optional[float]
    peak_memory_bytes: int  # the largest of any rank and step
    tokens_per_second: float  # mean over the steps after the first
    grad_norm: float  # at the last step
    # Every run's job, in order (job_id is the first; one with repeat=1);
    # the losses, norm and validation loss are the first run's.
    job_ids: Tuple[str, ...] = ()
    # Half-width of the 95% interval of tokens_per_second over the runs'
    # means (Student's t); None for a single run.
    tokens_per_second_ci95: Optional[float] = None
    # The mesh that ran, as the daemon names it: the entry's, or for auto
    # the one chosen ("auto: tp2").
    mesh: str = ""


class Comparison(list):
    """The runs of :meth:`Client.compare`, one :class:`StrategyResult` each."""

    def to_frame(self) -> Any:
        """A pandas DataFrame indexed by the entry, which stays a column
        too (``strategy``), with the mesh that ran (needs pandas)."""
        import pandas

        return pandas.DataFrame([dataclasses.asdict(r) for r in self]).set_index(
            "strategy", drop=False)

    def table(self) -> str:
        width = max([8] + [len(r.mesh or r.strategy) for r in self])
        header = (f"{'mesh':<{width}} {'ranks':>5} {'batch':>5} {'final loss':>10} "
                  f"{'peak/rank':>10} {'tokens/s':>9} {'norm':>6}")
        lines = [header]
        for r in self:
            spread = f" ± {r.tokens_per_second_ci95:,.0f}" if r.tokens_per_second_ci95 is not None else ""
            lines.append(f"{r.mesh or r.strategy:<{width}} {r.world_size:>5} {r.batch_size:>5} {r.final_loss:>10.4f} "
                         f"{r.peak_memory_bytes / 2**20:>6.1f} MiB {r.tokens_per_second:>9,.0f} {r.grad_norm:>6.3f}"
                         f"{spread}")
        return "\n".join(lines)


def _bearer_metadata(token: Optional[str], source: str) -> Tuple[Tuple[str, str], ...]:
    """The authorization header for ``token``, stripped of surrounding
    whitespace (a token read from a file or the environment often ends in a
    newline) as the CLI and the daemon strip it. A character a gRPC header
    cannot carry is refused here, naming its position and kind but never the
    token, so that neither an exception nor gRPC's own log shows a secret."""
    token = (token or "").strip()
    if not token:
        return ()
    for position, char in enumerate(token):
        if " " <= char <= "~":
            continue
        kind = "a non-ASCII character" if ord(char) > 0x7E else "a control character"
        raise errors.InvalidArgument(
            "INVALID_ARGUMENT",
            f"{source}: the token has {kind} at position {position + 1} of {len(token)}; "
            "a bearer token is printable ASCII (the daemon's --auth-token-file holds it)")
    return (("authorization", f"Bearer {token}"),)


class Client:
    """A connection to shardtraind.

    >>> client = Client()                       # the local daemon
    >>> job = client.submit(data="brown", max_steps=20)
    >>> for update in client.watch(job.id): ...
    >>> client.metrics(job.id)                  # a DataFrame with pandas

    ``address``: host:port (default: as the CLI finds it, see
    :func:`default_address`). ``token``: the bearer token of a daemon started
    with ``--auth-token-file`` (default: $SHARDTRAIN_TOKEN).
    ``root_certificates``: PEM bytes for a daemon with TLS. ``timeout``:
    seconds each unary call may take.

    Every call raises :class:`shardtrain.ShardtrainError` (a subclass per
    gRPC code, e.g. :class:`shardtrain.NotFound`) with the daemon's message.
    """

    def __init__(self, address: Optional[str] = None, token: Optional[str] = None,
                 *, root_certificates: Optional[bytes] = None, timeout: float = 60.0) -> None:
        self.address = address or default_address()
        source = "token" if token is not None else "$SHARDTRAIN_TOKEN"
        token = token if token is not None else os.environ.get("SHARDTRAIN_TOKEN")
        self._metadata = _bearer_metadata(token, source)
        self._timeout = timeout
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.secure_channel(self.address, creds)
        else:
            self._channel = grpc.insecure_channel(self.address)
        self._jobs = job_service_pb2_grpc.JobServiceStub(self._channel)
        self._cluster = cluster_service_pb2_grpc.ClusterServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, self.address) from None

    def _stream(self, method: Any, request: Any) -> Iterator[Any]:
        call = method(request, metadata=self._metadata)
        try:
            for item in call:
                yield item
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, self.address) from None
        finally:
            call.cancel()

    # -- jobs ---------------------------------------------------------------

    def submit(self, spec: Union[None, Mapping[str, Any], PathLike, job_pb2.JobSpec] = None,
               **kwargs: Any) -> Job:
        """Submits a job; returns it (QUEUED).

        ``spec``: a dict or a YAML file with the keys of ``shardtrain submit
        -f`` (``batch-size`` or ``batch_size``), or a ``JobSpec``; keyword
        arguments (the same names) win over it::

            client.submit("job.yaml", lr=3e-4)
            client.submit(model="gpt2-mini", data="brown", strategy="fsdp",
                          world_size=2, max_steps=100, labels={"sweep": "lr"})
        """
        request = job_service_pb2.SubmitJobRequest(spec=build_spec(spec, **kwargs))
        return Job.from_proto(self._call(self._jobs.SubmitJob, request))

    def get(self, job_id: str) -> Job:
        return Job.from_proto(self._call(self._jobs.GetJob, job_service_pb2.GetJobRequest(job_id=job_id)))

    def list(self, states: Optional[Sequence[str]] = None,
             labels: Optional[Mapping[str, str]] = None, limit: Optional[int] = None) -> List[Job]:
        """Jobs, oldest first; ``states`` (e.g. ``["RUNNING"]``) and
        ``labels`` (all must match) filter them; at most ``limit`` (None:
        all)."""
        if isinstance(states, str):
            states = [states]
        try:
            numbers = [job_pb2.JobState.Value(s.upper()) for s in states or ()]
        except ValueError:
            raise ValueError(f"states: got {list(states or ())}; expected some of "
                             f"{', '.join(job_pb2.JobState.keys()[1:])}") from None
        if limit is not None and limit < 0:
            raise ValueError(f"limit: got {limit}; expected None (all) or >= 0")
        request = job_service_pb2.ListJobsRequest(states=numbers, labels=dict(labels or {}))
        jobs: List[Job] = []
        while limit is None or len(jobs) < limit:
            response = self._call(self._jobs.ListJobs, request)
            jobs.extend(Job.from_proto(j) for j in response.jobs)
            if not response.next_page_token:
                break
            request.page_token = response.next_page_token
        return jobs if limit is None else jobs[:limit]

    def cancel(self, job_id: str) -> Job:
        """Cancels a queued or running job (its ranks stop; the job ends
        CANCELLED)."""
        return Job.from_proto(self._call(self._jobs.CancelJob, job_service_pb2.CancelJobRequest(job_id=job_id)))

    def watch(self, job_id: str) -> Iterator[Update]:
        """Updates of a job as they happen, ending when the job ends: first
        the job as it is, then state changes and rank 0's step metrics."""
        request = job_service_pb2.WatchJobRequest(job_id=job_id)
        for event in self._stream(self._jobs.WatchJob, request):
            which = event.WhichOneof("event")
            if which == "job":
                job = Job.from_proto(event.job)
                yield Update("job", job=job)
                if job.done:
                    return
            elif which == "state_change":
                state = _enum_name(job_pb2.JobState.DESCRIPTOR, event.state_change.state)
                yield Update("state", state=state, message=event.state_change.message)
                if state in TERMINAL_STATES:
                    return
            elif which == "step" and event.step.rank == 0:
                yield Update("step", step=_row(event.step))

    def wait(self, job_id: str, poll_seconds: float = 2.0) -> Job:
        """Blocks until the job ends; returns it. A watch the daemon closes
        early (it is shutting down) is opened again; a daemon that is gone
        raises :class:`Unavailable`."""
        while True:
            for _ in self.watch(job_id):
                pass
            job = self.get(job_id)
            if job.done:
                return job
            time.sleep(poll_seconds)

    def logs(self, job_id: str, follow: bool = False, rank: Optional[int] = None,
             tail: int = 0) -> Iterator[LogLine]:
        """The ranks' log lines (``tail``: the last N first); with
        ``follow`` new lines until the job ends."""
        request = job_service_pb2.StreamLogsRequest(job_id=job_id, tail=tail, follow=follow)
        if rank is not None:
            request.rank = rank
        for line in self._stream(self._jobs.StreamLogs, request):
            yield LogLine(line.rank, line.line)

    def metrics(self, job_id: str, rank: Optional[int] = None, from_step: int = 0,
                as_frame: Optional[bool] = None) -> Any:
        """A job's stored step metrics, every rank (or one): the rows of
        ``shardtrain metrics -o json`` (proto field names; ``val_loss`` None
        where no evaluation ran). A pandas DataFrame when pandas is
        installed, unless ``as_frame=False``."""
        request = job_service_pb2.GetJobMetricsRequest(job_id=job_id, from_step=from_step)
        if rank is not None:
            request.rank = rank
        rows = [_row(m) for m in self._call(self._jobs.GetJobMetrics, request).steps]
        if as_frame is False:
            return rows
        try:
            import pandas
        except ImportError:
            if as_frame:
                raise
            return rows
        return pandas.DataFrame(rows, columns=[f.name for f in job_pb2.StepMetrics.DESCRIPTOR.fields])

    def cluster(self) -> Dict[str, Any]:
        """Devices, who holds them, the queue (and the backend's nodes): the
        fields of ``shardtrain cluster -o json``."""
        return _row(self._call(self._cluster.GetCluster, cluster_service_pb2.GetClusterRequest()))

    # -- the study ------------------------------------------------------------

    def compare(self, spec: Union[None, Mapping[str, Any], PathLike] = None,
                strategies: Sequence[str] = ("single", "ddp", "fsdp"), world_size: int = 2,
                repeat: int = 1, **kwargs: Any) -> Comparison:
        """The same model and data under each strategy, one after the other,
        as ``shardtrain compare`` runs them: distributed strategies on
        ``world_size`` ranks, single-device on one with the whole global
        batch (strong scaling), so the losses match step for step. An entry
        may also be a mesh as ``shardtrain compare`` names it:
        ``[ppS x] [<strategy>[D]] [x tpT]`` (S pipeline stages, D replicas,
        T tensor-parallel ranks; without D, ``world_size / (S T)``: ``pp2``,
        ``pp2xddp2``, ``tp2``, ``ddp2xtp2``), each replica given its share of
        the global batch, or ``auto`` (the mesh the coordinator predicts
        fastest for ``world_size`` ranks). ``repeat`` (1-20) runs every entry
        that many times, round after round (single, ddp, single, ddp, ...) as
        ``shardtrain compare --repeat`` does, so that whatever changes on the
        host over time falls on every strategy alike; throughput is then the
        mean of the runs' means with a 95% interval from their spread.
        Returns one :class:`StrategyResult` per entry; raises
        :class:`JobDidNotSucceed` if a run fails (a mesh the daemon refuses
        raises its error)."""
        if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= 20:
            raise ValueError(f"repeat must be an integer from 1 to 20, not {repeat!r}")
        study = kwargs.pop("name", None) or f"compare-{int(time.time())}"
        labels = dict(kwargs.pop("labels", {}) or {})
        base = build_spec(spec, **kwargs)
        results = Comparison()
        # 8: TrainConfig's default batch per rank.
        per_rank = base.trainer.batch_size if base.trainer.HasField("batch_size") else 8
        entries = [(entry, *_study_entry(entry, world_size)) for entry in strategies]
        # Every run at the threads per rank of the study's largest job, as
        # `shardtrain compare` does: per-rank speed and memory at equal threads.
        largest = max([1] + [ranks for *_, ranks in entries])
        specs = []
        for entry, strategy, stages, tensor, ranks in entries:
            one = job_pb2.JobSpec()
            one.CopyFrom(base)
            one.strategy.name = strategy
            if stages > 1:
                one.strategy.pipeline_stages = stages
            if tensor > 1:
                one.strategy.tensor_parallel = tensor
            one.world_size = ranks
            # Every data-parallel replica its share of the global batch
            # (single-device: all of it).
            one.trainer.batch_size = per_rank * world_size // max(1, ranks // (stages * tensor))
            one.trainer.threads_as_ranks = largest
            one.name = f"{study}-{entry}"
            one.labels.update({**labels, "study": study, "strategy": entry})
            specs.append((entry, one))
        runs: Dict[str, List[Tuple[str, List[Dict[str, Any]]]]] = {entry: [] for entry, _ in specs}
        meshes: Dict[str, str] = {}
        for round_index in range(repeat):
            for entry, one in specs:
                if repeat > 1:
                    one.name = f"{study}-{entry}-run{round_index + 1}"
                job = self.submit(one)
                finished = self.wait(job.id)
                if finished.state != "SUCCEEDED":
                    raise errors.JobDidNotSucceed(finished)
                meshes.setdefault(entry, finished.mesh)
                runs[entry].append((job.id, self.metrics(job.id, as_frame=False)))
        for entry, one in specs:
            rank0_of = [[r for r in rows if r["rank"] == 0] for _, rows in runs[entry]]
            # Each run's mean over the steps after the first (warm-up).
            means = []
            for rank0 in rank0_of:
                timed = [r["tokens_per_second"] for r in rank0[1:]] or [r["tokens_per_second"] for r in rank0]
                means.append(statistics.fmean(timed) if timed else math.nan)
            first = rank0_of[0]
            evaluated = [r["val_loss"] for r in first if r["val_loss"] is not None]
            mesh = meshes.get(entry) or entry
            batch = one.trainer.batch_size
            if mesh.startswith("auto: "):
                # The mesh auto chose shares the global batch over its own
                # replicas.
                _, stages, tensor, ranks = _study_entry(mesh[len("auto: "):], world_size)
                replicas = max(1, ranks // (stages * tensor))
                if (batch * world_size) % replicas == 0:
                    batch = batch * world_size // replicas
            results.append(StrategyResult(
                strategy=entry, job_id=runs[entry][0][0], world_size=one.world_size,
                batch_size=batch, mesh=mesh,
                final_loss=first[-1]["loss"] if first else math.nan,
                val_loss=evaluated[-1] if evaluated else None,
                peak_memory_bytes=max((r["memory_peak_bytes"] for _, rows in runs[entry] for r in rows),
                                      default=0),
                tokens_per_second=statistics.fmean(means),
                grad_norm=first[-1]["grad_norm"] if first else math.nan,
                job_ids=tuple(job_id for job_id, _ in runs[entry]),
                tokens_per_second_ci95=_t_interval(means)))
        return results


# Student's t, two-sided 95%, for 1..19 degrees of freedom.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093)


def _t_interval(means: Sequence[float]) -> Optional[float]:
    """The 95% half-width of the mean of ``means`` (None for fewer than two)."""
    if len(means) < 2:
        return None
    return _T95[min(len(means) - 1, len(_T95)) - 1] * statistics.stdev(means) / math.sqrt(len(means))


_MESH = re.compile(r"(?:pp(\d+))?(?:x?([a-z]+?)(\d*))??(?:x?tp(\d+))?")


def _study_entry(entry: str, world_size: int) -> Tuple[str, int, int, int]:
    """(data-parallel strategy, pipeline stages, tensor-parallel ranks, ranks)
    of a compare entry: a strategy name, ``auto`` (the whole world, the mesh
    the coordinator picks), or a mesh ``[ppS x] [<strategy>[D]] [x tpT]``
    (the daemon checks the numbers)."""
    if entry == "auto":
        return entry, 1, 1, world_size
    mesh = _MESH.fullmatch(entry)
    if mesh is None or (mesh.group(1) is None and mesh.group(4) is None):
        return entry, 1, 1, 1 if entry == "single" else world_size
    stages = int(mesh.group(1) or 1)
    tensor = int(mesh.group(4) or 1)
    strategy = mesh.group(2) or "single"
    if mesh.group(3):
        replicas = int(mesh.group(3))
    else:
        replicas = 1 if strategy == "single" else max(1, world_size // max(1, stages * tensor))
    return strategy, stages, tensor, stages * tensor * replicas
