#!/usr/bin/env python3
"""The docker-compose deployment, built and run for real.

Starts a Docker engine when none answers (and stops it after), makes a Debian
base image without a registry (scripts/docker-base), builds the CPU
coordinator image from the binaries this build made (deploy/stage-binaries,
deploy/Dockerfile.prebuilt) and Prometheus from Debian's package
(deploy/prometheus/Dockerfile), then brings up deploy/docker-compose.yml with
deploy/docker-compose.cpu.yml under its own project name, volumes and
loopback ports, and from the host:

  - the CLI trains a job through the published port with the token from the
    secret, and the job succeeds;
  - the stack's Prometheus has the job's series, and every dashboard query
    returns data from it (the check of dashboards_prometheus_test.py);
  - `docker-compose restart shardtraind` during a second job: the job's
    record survives in the volume, and the job is resumed or failed with its
    reason, never lost or left RUNNING;
  - the TLS override comes up and the CLI talks to it over TLS;
  - `down` leaves no container of the project.

Prints each stage's wall time. Exits 77 (skipped) when this machine cannot
run a Docker engine: not root, no dockerd (scripts/setup installs docker.io),
or dockerd does not start.

The engine this test starts runs with --iptables=false --bridge=none: it
changes nothing in the host's firewall (a Docker engine's own rules drop
forwarded traffic of other bridges, such as the Slurm test bed's) and makes
no default bridge; the image builds use the host's network instead of NAT.
The test fails if the firewall, the bridge-netfilter switch or the host's
bridges differ after the engine stopped.

  compose_e2e_test.py [--build-dir build] [--source-dir .] [--image NAME]

--image runs the stack on a coordinator image built beforehand (e.g. by
`docker-compose build` from source: deploy/Dockerfile.cpu, or the GPU image,
which falls back to CPU slots without a GPU) instead of building one from
this build's binaries; the host's CLI still comes from --build-dir.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dashboards_prometheus_test as dpt  # noqa: E402  (beside this file)

SKIP = 77
ENGINE_TIMEOUT_S = 60
JOB_TIMEOUT_S = 600


class Skip(Exception):
    pass


class Stages:
    """Prints each stage's wall time as it ends, and all of them at the end."""

    def __init__(self):
        self.times = []
        self.name = None
        self.start = None

    def begin(self, name):
        self.end()
        self.name, self.start = name, time.monotonic()
        print(f"== {name}", flush=True)

    def end(self):
        if self.name is None:
            return
        seconds = time.monotonic() - self.start
        self.times.append((self.name, seconds))
        print(f"   {self.name}: {seconds:.1f} s", flush=True)
        self.name = None

    def summary(self):
        self.end()
        print("stage times: " + ", ".join(f"{n} {s:.0f} s" for n, s in self.times))


def run(command, timeout=600, check=True, env=None, cwd=None):
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=env, cwd=cwd)
    if check and result.returncode != 0:
        raise dpt.TestFailure(
            f"{' '.join(command)} exited with {result.returncode}:\n"
            f"{(result.stdout + result.stderr).strip()[-3000:]}")
    return result


def host_network_state():
    """What a Docker engine would change on the host: the chains' policies and
    its own chains and rules (DOCKER*), the bridge-netfilter switch, and its
    bridges (docker0, br-*). Other tests' rules and bridges (the Slurm test
    bed's, which may come and go meanwhile) are not compared."""
    state = {}
    for table in ("filter", "nat"):
        if shutil.which("iptables"):
            rules = run(["iptables", "-t", table, "-S"], check=False).stdout
            state[f"iptables -t {table}"] = "\n".join(
                line for line in rules.splitlines()
                if line.startswith("-P ") or "DOCKER" in line)
    try:
        with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
            state["bridge-nf-call-iptables"] = f.read().strip()
    except OSError:
        state["bridge-nf-call-iptables"] = "absent"
    links = run(["ip", "-o", "link", "show", "type", "bridge"], check=False).stdout
    names = (line.split(":")[1].strip() for line in links.splitlines())
    state["bridges"] = " ".join(sorted(
        n for n in names if n == "docker0" or n.startswith("br-")))
    return state


class Engine:
    """A Docker engine: the one running, or one started here (stopped by stop())."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.process = None
        self.host_before = None

    def answers(self):
        return run(["docker", "info"], timeout=30, check=False).returncode == 0

    def start(self):
        if self.answers():
            print("using the Docker engine already running")
            return
        if os.geteuid() != 0:
            raise Skip("starting a Docker engine needs root")
        if not shutil.which("dockerd"):
            raise Skip("no dockerd (scripts/setup installs Debian's docker.io)")
        self.host_before = host_network_state()
        log = open(os.path.join(self.tmp, "dockerd.log"), "w")
        self.process = subprocess.Popen(
            ["dockerd", "--iptables=false", "--ip-masq=false", "--bridge=none",
             "--data-root", os.environ.get("SHARDTRAIN_DOCKER_ROOT", "/var/lib/docker"),
             "--pidfile", os.path.join(self.tmp, "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=dpt.die_with_parent)
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise Skip("dockerd did not start:\n" + dpt.tail(log.name, 15))
            time.sleep(0.5)
        print("started dockerd (--iptables=false --bridge=none)")

    def stop(self):
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        # The host as it was: firewall, bridge netfilter, no bridge left.
        after = host_network_state()
        changed = [key for key in after if after[key] != self.host_before.get(key)]
        if changed:
            raise dpt.TestFailure(
                "the engine left the host changed: " + "; ".join(
                    f"{key}: {self.host_before.get(key)!r} -> {after[key]!r}"
                    for key in changed))
        print("ok    the host's firewall and bridges are as they were")


class Stack:
    """deploy/docker-compose.yml + docker-compose.cpu.yml under a project name
    of its own; every setting .env has, overridden from the environment."""

    def __init__(self, source_dir, tmp, images):
        self.source_dir = source_dir
        self.project = f"shardtrain-e2e-{os.getpid()}"
        self.grpc_port = dpt.free_port()
        self.prometheus_port = dpt.free_port()
        self.token_file = os.path.join(tmp, "token")
        with open(self.token_file, "w") as f:
            f.write("e2e-" + os.urandom(16).hex() + "\n")
        # Secrets are bind-mounted: readable by the image's user (uid 10001)
        # and nobody else, as shardtraind requires of a secret.
        os.chmod(self.token_file, 0o600)
        os.chown(self.token_file, 10001, 10001)
        password = os.path.join(tmp, "grafana-password")
        with open(password, "w") as f:
            f.write("unused\n")
        self.env = dict(
            os.environ,
            SHARDTRAIN_CPU_IMAGE=images["shardtraind"],
            PROMETHEUS_IMAGE=images["prometheus"],
            SHARDTRAIN_BIND="127.0.0.1", SHARDTRAIN_PORT=str(self.grpc_port),
            PROMETHEUS_BIND="127.0.0.1", PROMETHEUS_PORT=str(self.prometheus_port),
            SHARDTRAIN_TOKEN_FILE=self.token_file, GRAFANA_ADMIN_PASSWORD_FILE=password,
            SHARDTRAIN_STATE_VOLUME=f"{self.project}-state",
            PROMETHEUS_DATA_VOLUME=f"{self.project}-prometheus",
            GRAFANA_DATA_VOLUME=f"{self.project}-grafana",
            SHARDTRAIN_SHM_SIZE="512m",
            # Confined as docs/operations.md tells operators to run it: the jobs
            # still read back their own checkpoints (a restart resumes).
            SHARDTRAIN_EXTRA_ARGS="--device-kind cpu --cpu-slots 2 "
                                  "--path-root /usr/local/share/shardtrain",
        )
        self.files = ["docker-compose.yml", "docker-compose.cpu.yml"]

    def compose(self, *args, files=None, timeout=300, check=True):
        command = ["docker-compose", "-p", self.project]
        for f in files or self.files:
            command += ["-f", f]
        return run(command + list(args), timeout=timeout, check=check, env=self.env,
                   cwd=os.path.join(self.source_dir, "deploy"))

    def containers(self):
        out = run(["docker", "ps", "-aq", "--filter",
                   f"label=com.docker.compose.project={self.project}"], check=False)
        return out.stdout.split()


class Cli:
    def __init__(self, build_dir, stack, tls_ca=None):
        self.binary = os.path.join(build_dir, "bin", "shardtrain")
        self.stack = stack
        self.tls_ca = tls_ca

    def __call__(self, *args, timeout=120, check=True):
        command = [self.binary, *args, "--address", f"127.0.0.1:{self.stack.grpc_port}",
                   "--token-file", self.stack.token_file]
        if self.tls_ca:
            command += ["--tls-ca", self.tls_ca]
        return run(command, timeout=timeout, check=check)

    def job(self, job_id):
        return json.loads(self("get", job_id, "-o", "json").stdout)


def wait_daemon(cli):
    dpt.wait_for("shardtraind in the stack to answer",
                  lambda: cli("list", check=False).returncode == 0, 90, interval_s=1)


def build_images(source_dir, build_dir, tmp, stages, coordinator_image=None):
    stages.begin("base image (scripts/docker-base bookworm)")
    base = run([os.path.join(source_dir, "scripts", "docker-base"), "bookworm"],
               timeout=900).stdout.split()[-1]
    images = {"shardtraind": coordinator_image or "shardtrain-e2e:cpu",
              "prometheus": "shardtrain-e2e-prometheus:local"}
    if coordinator_image:
        stages.begin(f"images ({coordinator_image} as given, Debian's Prometheus)")
        if run(["docker", "image", "inspect", coordinator_image], check=False).returncode != 0:
            raise dpt.TestFailure(f"--image {coordinator_image}: no such image in this engine")
    else:
        stages.begin("images (prebuilt shardtraind, Debian's Prometheus)")
        context = os.path.join(tmp, "image-context")
        run([os.path.join(source_dir, "deploy", "stage-binaries"), build_dir, context])
        run(["docker", "build", "--network", "host", "-q", "-f",
             os.path.join(source_dir, "deploy", "Dockerfile.prebuilt"),
             "--build-arg", f"BASE_IMAGE={base}", "-t", images["shardtraind"], context],
            timeout=900)
    run(["docker", "build", "--network", "host", "-q", "-f",
         os.path.join(source_dir, "deploy", "prometheus", "Dockerfile"),
         "--build-arg", f"BASE_IMAGE={base}", "-t", images["prometheus"],
         os.path.join(source_dir, "deploy", "prometheus")], timeout=900)
    return images


def train(cli, steps, name):
    out = cli("submit", "--name", name, "--model", "gpt2-tiny", "--data", "brown",
              "--strategy", "ddp", "--world-size", "2", "--batch-size", "2", "--seq-len", "64",
              "--max-steps", str(steps), "--eval-every", str(steps), "--eval-steps", "2",
              "--checkpoint-every", "5", "--max-restarts", "1", "-o", "json")
    return json.loads(out.stdout)["id"]


def wait_terminal(cli, job_id, timeout_s):
    def done():
        job = cli.job(job_id)
        return job if job.get("state") in ("SUCCEEDED", "FAILED", "CANCELLED") else None
    return dpt.wait_for(f"{job_id} to end", done, timeout_s, interval_s=2)


def check_restart(stack, cli, stages):
    stages.begin("restart shardtraind during a job")
    job_id = train(cli, 60, "e2e-restart")
    dpt.wait_for(f"{job_id} to pass its first checkpoint",
                 lambda: int(cli.job(job_id).get("last_step", {}).get("step", 0)) >= 7,
                 JOB_TIMEOUT_S, interval_s=2)
    stack.compose("restart", "shardtraind", timeout=180)
    wait_daemon(cli)
    job = cli.job(job_id)  # the record survived in the volume
    print(f"{job_id} after the restart: {job.get('state')}")
    job = wait_terminal(cli, job_id, JOB_TIMEOUT_S)
    state = job.get("state")
    if state == "SUCCEEDED":
        print(f"ok    {job_id} resumed and succeeded after the coordinator restarted")
    elif state == "FAILED" and "INVALID_SPEC" in json.dumps(job.get("failure", {})):
        raise dpt.TestFailure(f"{job_id} refused its own files after the restart: "
                              f"{json.dumps(job)[:2000]}")
    elif state == "FAILED" and job.get("state_reason"):
        print(f"ok    {job_id} failed with its reason after the restart: "
              f"{job['state_reason']}")
    else:
        raise dpt.TestFailure(f"{job_id} after the restart: {json.dumps(job)[:2000]}")


def check_tls(stack, build_dir, tmp, stages):
    stages.begin("TLS override")
    key, cert = os.path.join(tmp, "server.key"), os.path.join(tmp, "server.pem")
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
    for path in (key, cert):  # read by the image's user only
        os.chmod(path, 0o600)
        os.chown(path, 10001, 10001)
    stack.env.update(SHARDTRAIN_TLS_CERT_FILE=cert, SHARDTRAIN_TLS_KEY_FILE=key)
    files = stack.files + ["docker-compose.tls.yml"]
    stack.compose("up", "-d", "shardtraind", files=files, timeout=180)
    tls = Cli(build_dir, stack, tls_ca=cert)
    wait_daemon(tls)
    listed = tls("list", "-o", "json")
    print("ok    the CLI lists the jobs over TLS "
          f"({len(json.loads(listed.stdout).get('jobs', []))} jobs)")
    plain = Cli(build_dir, stack)("list", check=False)
    if plain.returncode == 0:
        raise dpt.TestFailure("a plaintext client was answered by the TLS coordinator")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(here, "..", "..", "build"))
    parser.add_argument("--source-dir", default=os.path.join(here, "..", ".."))
    parser.add_argument("--image", help="a coordinator image built beforehand")
    args = parser.parse_args()
    build_dir = os.path.abspath(args.build_dir)
    source_dir = os.path.abspath(args.source_dir)

    tmp = tempfile.mkdtemp(prefix="shardtrain-compose-")
    stages = Stages()
    engine = Engine(tmp)
    stack = None
    failed = False
    try:
        stages.begin("Docker engine")
        engine.start()
        images = build_images(source_dir, build_dir, tmp, stages, args.image)
        stack = Stack(source_dir, tmp, images)
        cli = Cli(build_dir, stack)

        stages.begin("stack up (shardtraind, prometheus)")
        stack.compose("up", "-d", "shardtraind", "prometheus", timeout=300)
        wait_daemon(cli)

        stages.begin("a job through the stack")
        job_id = train(cli, 30, "e2e-first")
        job = wait_terminal(cli, job_id, JOB_TIMEOUT_S)
        if job.get("state") != "SUCCEEDED":
            raise dpt.TestFailure(f"{job_id} did not succeed: {json.dumps(job)[:2000]}")
        print(f"ok    {job_id} succeeded through the published port with the secret's token")

        stages.begin("the stack's Prometheus and the dashboards")
        prometheus = dpt.Prometheus(f"127.0.0.1:{stack.prometheus_port}")
        dpt.wait_for(f"{job_id}'s series in the stack's Prometheus",
                     lambda: prometheus.has(f'shardtrain_val_loss{{job="{job_id}"}}'),
                     120, interval_s=2)
        time.sleep(dpt.MIN_SCRAPED_S)
        passed, dashboard_failures, skipped = dpt.check_dashboards(prometheus, source_dir, job_id)
        print(f"dashboards: {passed} passed, {dashboard_failures} failed, {skipped} skipped")
        if dashboard_failures:
            raise dpt.TestFailure(f"{dashboard_failures} dashboard queries returned no data")

        check_restart(stack, cli, stages)
        check_tls(stack, build_dir, tmp, stages)

        stages.begin("down")
        stack.compose("down", "-v", "--remove-orphans", files=stack.files +
                      ["docker-compose.tls.yml"], timeout=180)
        left = stack.containers()
        if left:
            raise dpt.TestFailure(f"containers left after down: {left}")
        print("ok    down left no container of the project")
        stack = None
    except Skip as reason:
        print(f"skipped: {reason}")
        return SKIP
    except (dpt.TestFailure, OSError, subprocess.SubprocessError) as error:
        print(f"FAIL  {error}")
        failed = True
    finally:
        if stack is not None:
            if failed:
                print(stack.compose("logs", "--tail", "40", check=False).stdout[-6000:])
            stack.compose("down", "-v", "--remove-orphans", check=False, timeout=180,
                          files=stack.files + ["docker-compose.tls.yml"])
        try:
            engine.stop()
        except dpt.TestFailure as error:
            print(f"FAIL  {error}")
            failed = True
        stages.summary()
    if failed:
        print(f"files kept in {tmp}")
        return 1
    shutil.rmtree(tmp, ignore_errors=True)
    print("compose end-to-end: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
