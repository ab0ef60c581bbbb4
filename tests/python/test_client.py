"""The Python client against a real shardtraind and real workers (gpt2-tiny
on CPU slots): submit, watch, metrics, logs, cancel, list, cluster,
compare, token auth and errors; the package installs with pip; the sweep
example in docs/ runs.

Run by ctest (python_client_test) with PYTHONPATH=build/python and
SHARDTRAIN_BIN_DIR=build/bin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, Iterator, List

import numpy as np
import pytest

import shardtrain

BIN = os.environ.get("SHARDTRAIN_BIN_DIR", os.path.join(os.getcwd(), "bin"))
SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(model="gpt2-tiny", batch_size=2, seq_len=32, eval_every=2, eval_steps=1, lr=1e-3)


class Daemon:
    """shardtraind on a free port it picks itself (port 0), in a state dir
    of its own; the address is what it publishes in STATE/endpoint."""

    def __init__(self, state: str, *extra: str) -> None:
        self.state = state
        self.process = subprocess.Popen(
            [os.path.join(BIN, "shardtraind"), "--listen", "127.0.0.1:0", "--metrics-listen", "",
             "--state-dir", state, "--cpu-slots", "2", "--heartbeat-timeout", "120", *extra],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(os.path.dirname(state), "daemon.log"), "w"))
        endpoint = os.path.join(state, "endpoint")
        deadline = time.monotonic() + 60
        while not os.path.exists(endpoint):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"shardtraind did not start (exit {self.process.poll()})")
            time.sleep(0.05)
        with open(endpoint) as f:
            self.address = f.read().strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def write_tokens(path: str, count: int, seed: int) -> None:
    """An llm.c token file: 256 int32 header (magic 20240520, version 1,
    count), then uint16 ids."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, count)
    ids = np.random.default_rng(seed).integers(0, 50257, count, dtype=np.uint16)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(ids.astype("<u2").tobytes())


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("data")
    write_tokens(str(d / "train.bin"), 20000, 1)
    write_tokens(str(d / "val.bin"), 2000, 2)
    return str(d)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(str(tmp_path_factory.mktemp("daemon") / "state"))
    yield d
    d.stop()


@pytest.fixture()
def client(daemon: Daemon) -> Iterator[shardtrain.Client]:
    with shardtrain.Client(daemon.address) as c:
        yield c


def cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "shardtrain"), *args],
                          env={**os.environ, "SHARDTRAIN_ADDRESS": address},
                          capture_output=True, text=True)


def test_submit_watch_to_succeeded_and_metrics_equal_the_cli(client, daemon, data):
    job = client.submit(data=data, max_steps=4, name="py-first", labels={"suite": "python"}, **SMALL)
    assert job.state == "QUEUED" and job.name == "py-first"

    updates = list(client.watch(job.id))

    assert updates[0].kind == "job" and updates[0].job.id == job.id
    steps = [u.step["step"] for u in updates if u.kind == "step"]
    assert steps and steps[-1] == 4 and steps == sorted(steps)
    states = [u.state for u in updates if u.kind == "state"]
    assert states[-1] == "SUCCEEDED", states
    done = client.get(job.id)
    assert done.state == "SUCCEEDED" and done.done
    assert done.last_step["step"] == 4 and done.output_dir

    rows = client.metrics(job.id, as_frame=False)
    printed = json.loads(cli(daemon.address, "metrics", job.id, "-o", "json").stdout)["steps"]
    assert len(rows) == len(printed) == 4  # one rank, four steps
    for ours, theirs in zip(rows, printed):
        assert ours == {k: theirs.get(k) for k in ours}, (ours, theirs)
        assert set(theirs) <= set(ours)
    assert rows[1]["val_loss"] is not None and rows[0]["val_loss"] is None


def test_metrics_are_a_dataframe_with_pandas(client, data):
    pandas = pytest.importorskip("pandas")
    job = client.wait(client.submit(data=data, max_steps=2, **SMALL).id)
    frame = client.metrics(job.id)
    assert isinstance(frame, pandas.DataFrame)
    assert list(frame["step"]) == [1, 2]
    assert {"loss", "tokens_per_second", "memory_peak_bytes", "val_loss"} <= set(frame.columns)
    assert frame["loss"].iloc[-1] == client.metrics(job.id, as_frame=False)[-1]["loss"]


def test_logs_and_follow_end_with_the_job(client, data):
    job = client.wait(client.submit(data=data, max_steps=2, **SMALL).id)
    lines = list(client.logs(job.id))
    assert any("step 2/2" in line.line for line in lines), [l.line for l in lines][-5:]
    assert {line.rank for line in lines} == {0}
    followed = list(client.logs(job.id, follow=True, tail=3))
    assert 0 < len(followed) <= 3


def test_a_yaml_file_with_overrides(client, data, tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"name: from-yaml\nmodel: gpt2-tiny\ndata: {data}\nbatch-size: 2\nseq-len: 32\n"
                    "max-steps: 1\nlr: 6e-4\nlabels: {sweep: yaml}\n")
    job = client.submit(str(path), lr=3e-4, eval_steps=1)
    spec = job.proto.spec
    assert spec.name == "from-yaml" and spec.trainer.lr == pytest.approx(3e-4)
    assert spec.trainer.batch_size == 2 and dict(spec.labels) == {"sweep": "yaml"}
    assert client.wait(job.id).state == "SUCCEEDED"


def test_cancel_list_and_cluster(client, data):
    job = client.submit(data=data, max_steps=100000, name="to-cancel", labels={"suite": "cancel"}, **SMALL)
    for update in client.watch(job.id):
        if update.kind == "step":
            break
    cluster = client.cluster()
    assert len(cluster["devices"]) == 2
    assert any(d["job_id"] == job.id for d in cluster["devices"])
    cancelled = client.cancel(job.id)
    assert cancelled.id == job.id
    assert client.wait(job.id).state == "CANCELLED"

    listed = client.list(labels={"suite": "cancel"})
    assert [j.id for j in listed] == [job.id]
    assert job.id in [j.id for j in client.list(states=["cancelled"])]
    assert job.id not in [j.id for j in client.list(states=["SUCCEEDED"])]


def test_errors_carry_the_daemons_code_and_message(client, data):
    with pytest.raises(shardtrain.NotFound) as e:
        client.get("no-such-job")
    assert e.value.code == "NOT_FOUND" and "no-such-job" in e.value.message

    with pytest.raises(shardtrain.InvalidArgument) as e:
        client.submit(data=data, batch_size=-4)
    assert "batch_size" in e.value.message

    with pytest.raises(shardtrain.InvalidArgument) as e:
        client.submit(data=data, model="gpt2-huge")
    assert "gpt2-huge" in e.value.message

    with pytest.raises(ValueError, match="did you mean 'max_steps'"):
        client.submit(data=data, max_step=3)
    with pytest.raises(TypeError, match="batch_size"):
        client.submit(data=data, batch_size="four")

    with shardtrain.Client("127.0.0.1:1", timeout=5) as nowhere:
        with pytest.raises(shardtrain.Unavailable, match="no shardtraind answers at 127.0.0.1:1"):
            nowhere.list()


def test_token_auth(tmp_path, data):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    os.chmod(token_file, 0o600)
    daemon = Daemon(str(tmp_path / "state"), "--auth-token-file", str(token_file))
    try:
        with shardtrain.Client(daemon.address, token="") as anonymous:
            with pytest.raises(shardtrain.Unauthenticated):
                anonymous.list()
        with shardtrain.Client(daemon.address, token="wrong") as wrong:
            with pytest.raises(shardtrain.Unauthenticated):
                wrong.cluster()
        with shardtrain.Client(daemon.address, token="s3cret-token") as good:
            assert good.list() == []
            assert len(good.cluster()["devices"]) == 2
        # As read from a file or the environment: the newline is not the token's.
        with shardtrain.Client(daemon.address, token="s3cret-token\n") as from_file:
            assert from_file.list() == []
    finally:
        daemon.stop()


def test_users_own_their_jobs_and_only_they_or_an_admin_cancel_them(tmp_path, data):
    token_file = tmp_path / "tokens"
    token_file.write_text("tok-a,alice,user\ntok-b,bob,user\ntok-o,ops,admin\n")
    os.chmod(token_file, 0o600)
    daemon = Daemon(str(tmp_path / "state"), "--auth-token-file", str(token_file))
    try:
        with shardtrain.Client(daemon.address, token="tok-a") as alice, \
                shardtrain.Client(daemon.address, token="tok-b") as bob, \
                shardtrain.Client(daemon.address, token="tok-o") as ops:
            job = alice.submit(data=data, max_steps=100000, **SMALL)
            assert job.owner == "alice"
            seen = bob.get(job.id)
            assert seen.owner == "alice" and seen.preemptions == 0
            assert seen.remeshes == 0 and seen.remesh_seconds_lost == 0.0
            with pytest.raises(shardtrain.PermissionDenied, match="belongs to alice"):
                bob.cancel(job.id)
            assert ops.cancel(job.id).id == job.id
            assert ops.wait(job.id, poll_seconds=0.2).state == "CANCELLED"
    finally:
        daemon.stop()


def test_a_token_gRPC_cannot_carry_is_refused_without_showing_it(tmp_path, capfd, monkeypatch):
    # No daemon needed: the token is checked before anything is sent.
    for token in ("s3cret\nline-two", "s3cret\x1b[2Jtoken", "s3cr\u00e9t-token", "s3cret\x00token"):
        with pytest.raises(shardtrain.InvalidArgument) as refused:
            shardtrain.Client("127.0.0.1:1", token=token)
        assert isinstance(refused.value, shardtrain.ShardtrainError)
        assert "s3c" not in str(refused.value) and "token has" in str(refused.value)
        assert "position" in refused.value.message
    monkeypatch.setenv("SHARDTRAIN_TOKEN", "s3cret\rtoken")
    with pytest.raises(shardtrain.InvalidArgument) as from_env:
        shardtrain.Client("127.0.0.1:1")
    assert "$SHARDTRAIN_TOKEN" in str(from_env.value) and "s3c" not in str(from_env.value)
    out, err = capfd.readouterr()
    assert "s3c" not in out + err
    # A space inside a token is a character a header carries: it is sent as is.
    with shardtrain.Client("127.0.0.1:1", token="  two words  ") as client:
        assert client._metadata == (("authorization", "Bearer two words"),)


def test_compare_runs_each_strategy_on_the_same_global_batch(client, data):
    results = client.compare(data=data, strategies=("single", "ddp"), world_size=2,
                             repeat=2, max_steps=3, **{**SMALL, "eval_every": 0})
    assert [r.strategy for r in results] == ["single", "ddp"]
    single, ddp = results
    # Two runs each, interleaved: single, ddp, single, ddp.
    assert len(single.job_ids) == 2 and len(ddp.job_ids) == 2
    assert single.job_id == single.job_ids[0]
    order = sorted(single.job_ids + ddp.job_ids,
                   key=lambda job_id: client.get(job_id).proto.start_time_unix_ms)
    assert order == [single.job_ids[0], ddp.job_ids[0], single.job_ids[1], ddp.job_ids[1]]
    assert client.get(ddp.job_ids[1]).name.endswith("-ddp-run2")
    # The interval is Student's t over the two runs' means.
    means = []
    for job_id in ddp.job_ids:
        rank0 = [r for r in client.metrics(job_id, as_frame=False) if r["rank"] == 0]
        means.append(sum(r["tokens_per_second"] for r in rank0[1:]) / len(rank0[1:]))
    assert ddp.tokens_per_second == pytest.approx(sum(means) / 2)
    assert ddp.tokens_per_second_ci95 == pytest.approx(12.706 * abs(means[0] - means[1]) / 2)
    assert " ± " in results.table()
    with pytest.raises(ValueError, match="repeat"):
        client.compare(data=data, strategies=("single",), repeat=0)
    assert (single.world_size, single.batch_size) == (1, 4)
    assert (ddp.world_size, ddp.batch_size) == (2, 2)
    assert abs(single.final_loss - ddp.final_loss) <= 1e-4 * single.final_loss
    assert ddp.peak_memory_bytes > 0 and ddp.tokens_per_second > 0
    assert "ddp" in results.table()
    if _has_pandas():
        frame = results.to_frame()
        assert list(frame.index) == ["single", "ddp"]
        assert list(frame["strategy"]) == ["single", "ddp"]  # docs/python.md's example
    studies = {j.proto.spec.labels["study"] for j in client.list(labels={"strategy": "ddp"})}
    assert len(studies) == 1
    # Both at the threads per rank of the 2-rank job.
    for entry in ("single", "ddp"):
        jobs = client.list(labels={"strategy": entry})
        assert {j.proto.spec.trainer.threads_as_ranks for j in jobs} == {2}


def test_compare_takes_pipeline_meshes(client, data):
    # pp2: two stages of one replica on the global batch, as single-device;
    # tp2: every layer split over two ranks, likewise; the same training
    # step for step.
    results = client.compare(data=data, strategies=("single", "pp2", "tp2"), world_size=2,
                             max_steps=3, **{**SMALL, "eval_every": 0})
    assert [r.strategy for r in results] == ["single", "pp2", "tp2"]
    single, pp2, tp2 = results
    assert (pp2.world_size, pp2.batch_size) == (2, 4)
    assert client.get(pp2.job_id).proto.spec.strategy.pipeline_stages == 2
    assert abs(single.final_loss - pp2.final_loss) <= 1e-5 * single.final_loss
    assert (tp2.world_size, tp2.batch_size) == (2, 4)
    assert client.get(tp2.job_id).proto.spec.strategy.tensor_parallel == 2
    # Every row and job names its mesh, as the CLI's views do.
    assert [r.mesh for r in results] == ["single", "pp2", "tp2"]
    assert client.get(tp2.job_id).mesh == "tp2"
    assert "tp2" in results.table().splitlines()[3]
    assert abs(single.final_loss - tp2.final_loss) <= 1e-5 * single.final_loss
    # A mesh naming no strategy is the daemon's error, naming it.
    with pytest.raises(Exception, match="zero"):
        client.compare(data=data, strategies=("pp2xzero",), world_size=2, max_steps=1)


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
        return True
    except ImportError:
        return False


def test_the_learning_rate_sweep_example_prints_the_best(daemon, data):
    example = os.path.join(SOURCE, "docs", "examples", "lr_sweep.py")
    run = subprocess.run([sys.executable, example, "--data", data, "--max-steps", "2",
                          "--lrs", "1e-3,3e-3"],
                         env={**os.environ, "SHARDTRAIN_ADDRESS": daemon.address},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "best: lr 1e-03" in run.stdout or "best: lr 3e-03" in run.stdout, run.stdout
    assert "lr 1e-03: final loss" in run.stdout and "lr 3e-03: final loss" in run.stdout


def test_pip_installs_the_package_with_its_generated_modules(tmp_path):
    # From a copy: pip builds in the source folder.
    src = tmp_path / "src"
    shutil.copytree(os.path.join(SOURCE, "python"), src / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    shutil.copytree(os.path.join(SOURCE, "proto"), src / "proto")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-build-isolation", "--no-index",
                          "--no-deps", str(src / "python")],
                         capture_output=True, text=True, cwd=str(tmp_path))
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    check = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import shardtrain, shardtrain.v1.job_service_pb2_grpc as g; "
                            "print(shardtrain.__file__, g.JobServiceStub.__name__)"],
                           capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert check.returncode == 0, check.stderr
    assert str(venv) in check.stdout and "JobServiceStub" in check.stdout


def test_every_job_spec_field_has_a_key():
    """spec.py's tables cover the API: a field added to JobSpec,
    StrategyOptions or TrainerOptions without a Python key fails here."""
    from shardtrain import spec
    from shardtrain.v1 import job_pb2

    reachable = {("JobSpec", f) for f in spec._JOB_FIELDS.values()}
    reachable |= {("StrategyOptions", f) for f in spec._STRATEGY_FIELDS.values()}
    reachable |= {("TrainerOptions", f) for f in spec._TRAINER_FIELDS.values()}
    reachable |= {("JobSpec", "labels"), ("JobSpec", "device_kind"), ("JobSpec", "strategy"),
                  ("JobSpec", "trainer"), ("JobSpec", "elastic"), ("StrategyOptions", "name"),
                  ("ElasticOptions", "min_world_size")}
    for message in (job_pb2.JobSpec, job_pb2.StrategyOptions, job_pb2.TrainerOptions,
                    job_pb2.ElasticOptions):
        for field in message.DESCRIPTOR.fields:
            assert (message.DESCRIPTOR.name, field.name) in reachable, field.full_name
    built = spec.build_spec(strategy="hsdp", shard_group_size=2, min_world_size=1,
                            device="cuda", memory_cap="1GiB", comm_timeout=30)
    assert built.strategy.shard_group_size == 2 and built.elastic.min_world_size == 1
    assert built.device_kind == job_pb2.GPU and built.trainer.memory_cap_bytes == 2**30
    assert built.strategy.comm_timeout_seconds == 30
    piped = spec.build_spec({"pipeline-stages": 2, "pipeline_split": "1", "micro-batches": 4,
                             "pipeline_schedule": "gpipe"}, strategy="ddp", world_size=4)
    assert piped.strategy.pipeline_stages == 2 and piped.strategy.pipeline_split == "1"
    assert piped.strategy.micro_batches == 4 and piped.strategy.pipeline_schedule == "gpipe"
    assert piped.strategy.name == "ddp" and piped.world_size == 4


def test_rows_sizes_and_filters_without_a_daemon():
    """What needs no daemon: enum values a newer daemon may send come back as
    numbers, sizes read as the CLI reads them, list() and device inputs."""
    from shardtrain import spec
    from shardtrain.client import Job, _row
    from shardtrain.v1 import job_pb2, job_service_pb2

    job = job_pb2.Job(id="j", state=99)
    job.failure.reason = 77
    assert Job.from_proto(job).state == 99
    assert _row(job)["failure"]["reason"] == 77
    assert _row(job_service_pb2.ListJobsRequest(states=[1, 3], labels={"a": "b"})) == {
        "states": ["QUEUED", "RUNNING"], "labels": {"a": "b"}, "page_size": 0, "page_token": ""}
    assert spec.parse_size("512M") == spec.parse_size("512MiB") == 512 * 2**20
    assert spec.parse_size("1KB") == 1000 and spec.parse_size("2Gi") == 2 * 2**30
    with pytest.raises(ValueError, match="memory_cap"):
        spec.parse_size("lots")
    assert spec.build_spec(device="cuda:1").device_kind == job_pb2.GPU
    with shardtrain.Client("127.0.0.1:1") as c:
        with pytest.raises(ValueError, match="states: got"):
            c.list(states=["RUNING"])
        with pytest.raises(ValueError, match="limit"):
            c.list(limit=-1)
