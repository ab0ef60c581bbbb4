#!/usr/bin/env python3
"""The dashboards against a live shardtraind and a real Prometheus.

Starts build/bin/shardtraind on CPU slots and Debian's prometheus with the
shipped deploy/prometheus/prometheus.yml (targets pointed at loopback, scrape
interval 1 s), trains a 2-rank DDP gpt2-tiny job to its end, then runs every
expression of every dashboard in deploy/grafana/dashboards/ through
Prometheus's query API, template variables filled in, and expects data from
each. Expressions that read only GPU metrics (shardtrain_gpu_*, DCGM_*) are
skipped on a host without them. Also lints the daemon's /metrics with
`promtool check metrics`.

  dashboards_prometheus_test.py [--build-dir build] [--source-dir .]

Needs build/bin/shardtraind, build/bin/shardtrain-worker, build/tests/submit_job,
prometheus and promtool (scripts/setup installs them). Standard library only.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dashboards  # noqa: E402  (beside this file)

JOB_STEPS = 40
STARTUP_TIMEOUT_S = 60
JOB_TIMEOUT_S = 420
MIN_SCRAPED_S = 10  # how long Prometheus must have seen the job's series


class TestFailure(Exception):
    pass


# --------------------------------------------------------------------------
# Small helpers

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8")


def wait_for(what, condition, timeout_s, alive=lambda: None, interval_s=0.5):
    """Polls condition() until it returns a true value, which it returns.
    alive() raises when a process the wait depends on has died."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive()
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TestFailure(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def die_with_parent():
    """preexec_fn: the child gets SIGTERM when this test process dies, so a
    test killed by its timeout leaves no daemon or Prometheus behind."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path, lines=30):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as error:
        return f"({error})"


class Prometheus:
    def __init__(self, address):
        self.base = f"http://{address}"

    def query(self, expr):
        """The result list of an instant query at now; raises on an API error."""
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = json.loads(http_get(url, timeout=10))
        except urllib.error.HTTPError as error:
            body = json.loads(error.read().decode("utf-8"))
        if body.get("status") != "success":
            raise TestFailure(f"{body.get('errorType')}: {body.get('error')}")
        result = body["data"]["result"]
        if body["data"]["resultType"] == "scalar":
            return [result]
        return result

    def has(self, expr):
        try:
            return bool(self.query(expr))
        except (TestFailure, OSError):
            return False


# --------------------------------------------------------------------------
# The processes

class Processes:
    """Starts the daemon and Prometheus; stop() ends both, whatever happened."""

    def __init__(self, build_dir, source_dir, tmp):
        self.build_dir = build_dir
        self.source_dir = source_dir
        self.tmp = tmp
        self.daemon = None
        self.prometheus = None
        self.state_dir = os.path.join(tmp, "state")
        self.daemon_log = os.path.join(tmp, "shardtraind.log")
        self.prometheus_log = os.path.join(tmp, "prometheus.log")

    def check_daemon(self):
        if self.daemon.poll() is not None:
            raise TestFailure(f"shardtraind exited with {self.daemon.returncode}:\n"
                              + tail(self.daemon_log))

    def check_prometheus(self):
        if self.prometheus.poll() is not None:
            raise TestFailure(f"prometheus exited with {self.prometheus.returncode}:\n"
                              + tail(self.prometheus_log))

    def check_both(self):
        self.check_daemon()
        self.check_prometheus()

    def start_daemon(self):
        self.metrics_address = f"127.0.0.1:{free_port()}"
        command = [os.path.join(self.build_dir, "bin", "shardtraind"),
                   "--listen", "127.0.0.1:0",
                   "--metrics-listen", self.metrics_address,
                   "--state-dir", self.state_dir,
                   "--device-kind", "cpu", "--cpu-slots", "2",
                   "--metrics-retention", "600"]
        os.makedirs(self.state_dir)
        with open(self.daemon_log, "wb") as log:
            self.daemon = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL,
                                           preexec_fn=die_with_parent)
        endpoint = os.path.join(self.state_dir, "endpoint")
        wait_for("shardtraind to write STATE/endpoint", lambda: os.path.exists(endpoint),
                 STARTUP_TIMEOUT_S, self.check_daemon)
        with open(endpoint, encoding="utf-8") as f:
            self.address = f.read().strip()
        wait_for(f"http://{self.metrics_address}/metrics", self.metrics_text,
                 STARTUP_TIMEOUT_S, self.check_daemon)
        print(f"shardtraind: gRPC {self.address}, metrics {self.metrics_address}")

    def metrics_text(self):
        try:
            return http_get(f"http://{self.metrics_address}/metrics")
        except OSError:
            return None

    def prometheus_config(self, web_address):
        """The shipped config with its targets moved to this test's loopback
        ports and every interval set to 1 s."""
        path = os.path.join(self.source_dir, "deploy", "prometheus", "prometheus.yml")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        replacements = {
            "shardtraind:9464": self.metrics_address,
            # Nothing listens there: the DCGM target stays down, as on a host
            # without GPUs, and no name is looked up.
            "dcgm-exporter:9400": f"127.0.0.1:{free_port()}",
            "localhost:9090": web_address,
        }
        for old, new in replacements.items():
            if old not in text:
                raise TestFailure(f"{path} no longer names target {old}; update this test")
            text = text.replace(old, new)
        text = re.sub(r"(scrape_interval|evaluation_interval): *\d+[smh]", r"\1: 1s", text)
        config = os.path.join(self.tmp, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as f:
            f.write(text)
        return config

    def start_prometheus(self):
        web_address = f"127.0.0.1:{free_port()}"
        command = [shutil.which("prometheus"),
                   f"--config.file={self.prometheus_config(web_address)}",
                   f"--storage.tsdb.path={os.path.join(self.tmp, 'tsdb')}",
                   f"--web.listen-address={web_address}"]
        with open(self.prometheus_log, "wb") as log:
            self.prometheus = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL,
                                               preexec_fn=die_with_parent)

        def ready():
            try:
                http_get(f"http://{web_address}/-/ready")
                return True
            except OSError:
                return False

        wait_for("prometheus to be ready", ready, STARTUP_TIMEOUT_S, self.check_prometheus)
        print(f"prometheus: {web_address}")
        return Prometheus(web_address)

    def stop(self):
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)  # stops its workers too
            try:
                self.daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        if self.prometheus is not None and self.prometheus.poll() is None:
            self.prometheus.kill()
            self.prometheus.wait()


# --------------------------------------------------------------------------
# The test

def submit_job(build_dir, address):
    command = [os.path.join(build_dir, "tests", "submit_job"), "--address", address,
               "--model", "gpt2-tiny", "--data", "brown", "--strategy", "ddp",
               "--world-size", "2", "--max-steps", str(JOB_STEPS),
               "--batch-size", "2", "--seq-len", "64"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        raise TestFailure(f"submit_job exited with {run.returncode}: {run.stderr.strip()}")
    lines = run.stdout.split()
    if not lines or not re.fullmatch(r"job-\d+", lines[-1]):
        raise TestFailure(f"submit_job printed no job id: {run.stdout!r}")
    return lines[-1]


def wait_for_job(processes, prometheus, job):
    """Until the job has finished (its final eval's val_loss is in Prometheus)
    and Prometheus has scraped its series for MIN_SCRAPED_S."""

    def failed():
        processes.check_both()
        if prometheus.has(f'shardtrain_train_step{{exported_job="{job}"}}'):
            raise TestFailure(f"Prometheus stored {job}'s series under exported_job, not job: "
                              "the shardtraind scrape job needs honor_labels: true")
        if prometheus.has(f'shardtrain_jobs{{state=~"failed|cancelled"}} > 0'):
            logs = [os.path.join(processes.state_dir, "jobs", job, name)
                    for name in ("rank-0.log", "rank-1.log")]
            raise TestFailure(f"{job} failed or was cancelled; rank logs:\n"
                              + "\n".join(f"--- {log}\n{tail(log)}" for log in logs))

    started = time.monotonic()
    wait_for(f"shardtrain_train_step{{job=\"{job}\"}} in Prometheus",
             lambda: prometheus.has(f'shardtrain_train_step{{job="{job}"}}'),
             JOB_TIMEOUT_S, failed, interval_s=1)
    first_seen = time.monotonic()
    print(f"{job}: first step scraped after {first_seen - started:.0f} s")
    wait_for(f"{job} to finish (shardtrain_val_loss of its final eval)",
             lambda: prometheus.has(f'shardtrain_val_loss{{job="{job}"}}'),
             JOB_TIMEOUT_S - (first_seen - started), failed, interval_s=1)
    print(f"{job}: finished {time.monotonic() - first_seen:.0f} s after its first scrape")
    # Enough scrapes for the rate windows, including ones after the last step.
    wait_for(f"{MIN_SCRAPED_S} s of scrapes of {job}",
             lambda: time.monotonic() - first_seen >= MIN_SCRAPED_S, MIN_SCRAPED_S + 5,
             failed)
    time.sleep(3)


def skip_reason(names, prometheus):
    """Why an empty result is expected for an expression reading `names`,
    or None when data was due."""
    if all(dashboards.is_gpu_metric(n) for n in names):
        absent = [n for n in sorted(names) if not prometheus.has(n)]
        if absent:
            return f"no GPU metrics on this host ({', '.join(absent)} absent)"
    return None


def check_dashboards(prometheus, source_dir, job):
    values = dict(dashboards.DEFAULT_VARIABLES, job=job, strategy="ddp", mesh="ddp2",
                  rank="0")
    passed = failed = skipped = 0
    for query in dashboards.all_queries(dashboards.load_dashboards(source_dir)):
        expr = dashboards.substitute(dashboards.as_promql(query.expr), values)
        try:
            result = prometheus.query(expr)
        except TestFailure as error:
            print(f"FAIL  {query}\n      {expr}\n      query error: {error}")
            failed += 1
            continue
        if result:
            print(f"ok    {query}")
            passed += 1
            continue
        reason = skip_reason(dashboards.metric_names(expr), prometheus)
        if reason:
            print(f"skip  {query}: {reason}")
            skipped += 1
        else:
            print(f"FAIL  {query}\n      {expr}\n      returned no data")
            failed += 1
    return passed, failed, skipped


def check_metrics_lint(processes):
    text = processes.metrics_text()
    if not text:
        print("FAIL  promtool check metrics: could not fetch /metrics")
        return 0, 1
    lint = subprocess.run(["promtool", "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=60)
    if lint.returncode == 0:
        print("ok    promtool check metrics on shardtraind's /metrics")
        return 1, 0
    print("FAIL  promtool check metrics on shardtraind's /metrics\n"
          + (lint.stdout + lint.stderr).strip())
    return 0, 1


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default=os.environ.get(
        "SHARDTRAIN_BINARY_DIR", os.path.join(here, "..", "..", "build")))
    parser.add_argument("--source-dir", default=os.path.join(here, "..", ".."))
    args = parser.parse_args()
    build_dir = os.path.abspath(args.build_dir)
    source_dir = os.path.abspath(args.source_dir)

    needed = [os.path.join(build_dir, "bin", "shardtraind"),
              os.path.join(build_dir, "bin", "shardtrain-worker"),
              os.path.join(build_dir, "tests", "submit_job")]
    missing = [p for p in needed if not os.access(p, os.X_OK)]
    missing += [tool for tool in ("prometheus", "promtool") if not shutil.which(tool)]
    if missing:
        print(f"missing: {', '.join(missing)} (build them; scripts/setup installs Prometheus)")
        print("0 passed, 1 failed")
        return 1

    tmp = tempfile.mkdtemp(prefix="shardtrain-dashboards-")
    processes = Processes(build_dir, source_dir, tmp)
    passed = failed = skipped = 0
    try:
        processes.start_daemon()
        prometheus = processes.start_prometheus()
        job = submit_job(build_dir, processes.address)
        print(f"submitted {job}: gpt2-tiny, ddp, 2 ranks, {JOB_STEPS} steps")
        wait_for_job(processes, prometheus, job)
        p, f, s = check_dashboards(prometheus, source_dir, job)
        passed, failed, skipped = passed + p, failed + f, skipped + s
        p, f = check_metrics_lint(processes)
        passed, failed = passed + p, failed + f
    except (TestFailure, OSError, subprocess.SubprocessError) as error:
        print(f"FAIL  {error}")
        failed += 1
    finally:
        processes.stop()
    if failed:
        print(f"logs kept in {tmp}: shardtraind.log, prometheus.log, state/jobs/")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
