#!/usr/bin/env python3
"""Benchmark of the distributed mode: a dispatcher, RabbitMQ and 2 workers (2 slots each).

Measures, for N runs with two trivial stages each (implement: write a file; review: print
APPROVED):
  - submission to first container: from the start of POST /v1/runs to the Docker `create`
    event of the run's first container (nanosecond timestamps from `docker events`), p50/p99,
    both for 20 runs submitted one at a time to an idle cluster and for the N-run burst;
  - throughput: runs per second from the first submission to the last run's end;
  - the baseline: the same 2N containers (same image, commands, mounts) created, started,
    waited for and removed straight through the Docker Engine API, as many at a time as slots;
  - peak resident memory (VmHWM) of the dispatcher and of each worker.

Run: scripts/services.sh && scripts/build-images.sh && cargo build --release &&
     python3 scripts/bench-cluster.py [N [WORKERS [SLOTS]]]   (default 50 runs, 2 workers, 2 slots)

The slots in all (WORKERS x SLOTS) are also the baseline's parallelism. BENCH_LOG sets the
services' FORGEPOOL_LOG (default "warn,lapin=off"). BENCH_FOOTPRINT=1 also samples, as root,
the physical pages the dispatcher and the first worker hold together (/proc/PID/pagemap),
each counted once: summed RSS counts twice the code both map from the same binary.
"""
import concurrent.futures
import http.client
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

from benchsetup import write_skill_and_agents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.environ.get("FORGEPOOL_BIN", os.path.join(ROOT, "target", "release", "forgepool"))
IMAGE = "forgepool-test-agent:dev"
IMPLEMENT = ["/bin/sh", "-c", "echo change > /workspace/feature.txt"]
REVIEW = ["/bin/sh", "-c", "echo APPROVED"]


class DockerSocket(http.client.HTTPConnection):
    def __init__(self):
        super().__init__("localhost", timeout=60)

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect("/var/run/docker.sock")


def docker(method, path, body=None):
    connection = DockerSocket()
    payload = json.dumps(body).encode() if body is not None else None
    connection.request(method, "/v1.41" + path, body=payload, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    if response.status >= 300:
        raise RuntimeError(f"{method} {path}: {response.status} {data[:200]}")
    return json.loads(data) if data else None


def baseline_stage(command, workspace):
    started = time.perf_counter()
    host = {"NetworkMode": "none", "CapDrop": ["ALL"], "SecurityOpt": ["no-new-privileges"], "PidsLimit": 512,
            "Memory": 128 << 20, "MemorySwap": 128 << 20, "NanoCpus": 500_000_000, "Init": True}
    if workspace:
        host["Binds"] = [f"{workspace}:/workspace:rw"]
    created = docker("POST", "/containers/create", {"Image": IMAGE, "Cmd": command, "User": "0:0", "HostConfig": host,
                                                    "Labels": {"forgepool.bench": "baseline"}})
    docker("POST", f"/containers/{created['Id']}/start")
    docker("POST", f"/containers/{created['Id']}/wait")
    docker("DELETE", f"/containers/{created['Id']}?force=true")
    return time.perf_counter() - started


def baseline(n, parallel):
    workspace = tempfile.mkdtemp(prefix="forgepool-baseline-")

    def one_run(_):
        baseline_stage(IMPLEMENT, workspace)
        baseline_stage(REVIEW, None)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(one_run, range(n)))
    return time.perf_counter() - started


def git(*args, cwd=None):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def spawn(args, env, log):
    process = subprocess.Popen([BINARY, *args], env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    line = process.stdout.readline()
    address = line.strip().split("listening on ")[-1]
    threading.Thread(target=lambda: process.stdout.read(), daemon=True).start()
    return process, address


def peak_rss_mb(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def resident_pages(pid):
    """The physical pages `pid` has in memory (from /proc/PID/pagemap; needs root): a set of
    page frame numbers, so that pages two processes share (the same binary's code, libc) can
    be counted once."""
    frames = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if "[vsyscall]" in line:
                continue
            pagemap.seek(start // 4096 * 8)
            data = pagemap.read((end - start) // 4096 * 8)
            for (entry,) in struct.iter_unpack("<Q", data):
                if entry >> 63 & 1:
                    frames.add(entry & ((1 << 55) - 1))
    return frames


class Footprint(threading.Thread):
    """Samples, twice a second, the memory the dispatcher and the first worker hold together,
    each physical page counted once (summed RSS counts the binary's code twice: both run the
    same file). Keeps the largest sample, in MB."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids, self.peak, self.running = pids, 0.0, True

    def run(self):
        while self.running:
            try:
                union = set()
                for pid in self.pids:
                    union |= resident_pages(pid)
                self.peak = max(self.peak, len(union) * 4096 / 1e6)
            except OSError:
                pass
            time.sleep(0.5)


class Proportional(threading.Thread):
    """Samples, five times a second, the proportional set size (PSS: each shared page divided
    among the processes that map it) of the dispatcher and the first worker from
    /proc/PID/smaps_rollup. Keeps the largest sum, in MB, and the split of that sample."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids, self.peak, self.split, self.running = pids, 0.0, {}, True

    def run(self):
        while self.running:
            try:
                sample = {pid: smaps_rollup(pid) for pid in self.pids}
                total = sum(fields.get("Pss", 0) for fields in sample.values()) / 1000
                if total > self.peak:
                    self.peak, self.split = total, sample
            except OSError:
                pass
            time.sleep(0.2)


def smaps_rollup(pid):
    """The kB fields of /proc/PID/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def percentile(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(round((len(values) - 1) * p / 100)))]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    worker_count = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    slots = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    work = tempfile.mkdtemp(prefix="forgepool-bench-")
    print(f"work folder: {work}", flush=True)
    bare = os.path.join(work, "repo.git")
    git("init", "--quiet", "--bare", "--initial-branch=main", bare)
    seed = os.path.join(work, "seed")
    git("clone", "--quiet", bare, seed)
    with open(os.path.join(seed, "README.md"), "w") as f:
        f.write("bench\n")
    git("add", "-A", cwd=seed)
    git("-c", "user.name=b", "-c", "user.email=b@b", "commit", "--quiet", "-m", "start", cwd=seed)
    git("push", "--quiet", "origin", "HEAD:main", cwd=seed)
    _, agents = write_skill_and_agents(work, IMAGE, IMPLEMENT, REVIEW)
    prefix = "bench" + uuid.uuid4().hex[:8]
    env = dict(os.environ, FORGEPOOL_AMQP_PREFIX=prefix, FORGEPOOL_ALLOWED_URL_SCHEMES="https,ssh,file", FORGEPOOL_JOB_KEY=os.environ.get("FORGEPOOL_JOB_KEY", "bench-cluster-job-key-0123456789"), FORGEPOOL_LOG=os.environ.get("BENCH_LOG", "warn,lapin=off"))

    creates = {}
    events = subprocess.Popen(["docker", "events", "--format", "{{json .}}", "--filter", "type=container",
                               "--filter", "event=create", "--filter", f"label=forgepool.cluster={prefix}"],
                              stdout=subprocess.PIPE, text=True)

    def read_events():
        for line in events.stdout:
            event = json.loads(line)
            run_id = event.get("Actor", {}).get("Attributes", {}).get("forgepool.run_id")
            if run_id and run_id not in creates:
                creates[run_id] = event["timeNano"]

    threading.Thread(target=read_events, daemon=True).start()

    dispatcher, address = spawn(["dispatcher", "--listen", "127.0.0.1:0", "--skills", os.path.join(work, "skills"),
                                 "--agents", agents, "--database", os.path.join(work, "runs.db")], env,
                                os.path.join(work, "dispatcher.log"))
    workers = [spawn(["worker", "--metrics-addr", "127.0.0.1:0", "--worker-id", f"{prefix}-{i}", "--concurrency", str(slots),
                      "--workspace", os.path.join(work, f"ws{i}"), "--agents", agents], env, os.path.join(work, f"worker{i}.log"))[0]
               for i in range(worker_count)]
    time.sleep(2)
    # The sampler reads page tables twice a second: it costs CPU, so only when asked.
    footprint = Footprint([dispatcher.pid, workers[0].pid])
    if os.environ.get("BENCH_FOOTPRINT") == "1":
        footprint.start()
    proportional = Proportional([dispatcher.pid, workers[0].pid])
    proportional.start()
    base = f"http://{address}"
    submitted = {}
    first = time.time()
    for k in range(n):
        body = json.dumps({"ticket": f"BENCH-{k + 1}", "skill": "implement-task", "brief": "bench",
                           "repository": {"url": f"file://{bare}", "ref": "main"}}).encode()
        started_ns = time.time_ns()
        request = urllib.request.Request(base + "/v1/runs", data=body, headers={"Content-Type": "application/json"})
        run_id = json.loads(urllib.request.urlopen(request).read())["run_id"]
        submitted[run_id] = started_ns
    while True:
        listing = json.loads(urllib.request.urlopen(base + "/v1/runs?limit=500").read())
        states = [r["state"] for r in listing["runs"]]
        if len(states) == n and all(s in ("delivered", "delivered_with_warnings", "blocked", "failed", "cancelled") for s in states):
            break
        time.sleep(0.05)
    elapsed = time.time() - first
    failed = [s for s in states if s != "delivered"]

    # Idle latency: one run at a time, so no run waits for a slot.
    idle = []
    for k in range(20):
        body = json.dumps({"ticket": f"IDLE-{k + 1}", "skill": "implement-task", "brief": "bench",
                           "repository": {"url": f"file://{bare}", "ref": "main"}}).encode()
        started_ns = time.time_ns()
        request = urllib.request.Request(base + "/v1/runs", data=body, headers={"Content-Type": "application/json"})
        run_id = json.loads(urllib.request.urlopen(request).read())["run_id"]
        while True:
            state = json.loads(urllib.request.urlopen(f"{base}/v1/runs/{run_id}").read())["state"]
            if state in ("delivered", "delivered_with_warnings", "blocked", "failed", "cancelled"):
                break
            time.sleep(0.05)
        time.sleep(0.2)
        if run_id in creates:
            idle.append((creates[run_id] - started_ns) / 1e6)
    footprint.running = False
    if footprint.is_alive():
        footprint.join()
    proportional.running = False
    proportional.join()
    for name, pid in [("dispatcher", dispatcher.pid), ("worker0", workers[0].pid)]:
        with open(f"/proc/{pid}/smaps") as source, open(os.path.join(work, f"{name}.smaps"), "w") as kept:
            kept.write(source.read())
    memory = {"dispatcher": peak_rss_mb(dispatcher.pid)}
    for i, worker in enumerate(workers):
        memory[f"worker {i}"] = peak_rss_mb(worker.pid)
    for process in [dispatcher, *workers]:
        process.terminate()
    for process in [dispatcher, *workers]:
        process.wait(timeout=60)
    events.terminate()

    latencies = [(creates[r] - s) / 1e6 for r, s in submitted.items() if r in creates]
    base_elapsed = baseline(n, worker_count * slots)
    print(f"runs: {n} (2 stages each), not delivered: {len(failed)}")
    print(f"submission to first container, idle cluster: p50 {percentile(idle, 50):.1f} ms, "
          f"p99 {percentile(idle, 99):.1f} ms ({len(idle)} samples)")
    print(f"workers: {worker_count} with {slots} slots each")
    print(f"submission to first container, {n} submitted at once to {worker_count * slots} slots: p50 {percentile(latencies, 50):.1f} ms, "
          f"p99 {percentile(latencies, 99):.1f} ms (mean {statistics.mean(latencies):.1f} ms; queueing included)")
    print(f"forgepool: {elapsed:.2f} s, {n / elapsed:.2f} runs/s")
    print(f"baseline (same {2 * n} containers straight through the Docker API, {worker_count * slots} at a time): "
          f"{base_elapsed:.2f} s, {n / base_elapsed:.2f} runs/s")
    print(f"throughput ratio forgepool/baseline: {(n / elapsed) / (n / base_elapsed):.2f}")
    for name, mb in memory.items():
        print(f"peak resident memory of {name}: {mb:.1f} MB")
    together = f"; largest sample of the pages they hold together, each counted once: {footprint.peak:.1f} MB" \
        if footprint.peak else " (BENCH_FOOTPRINT=1 also samples the pages they hold together)"
    print(f"dispatcher + worker 0: summed peak RSS {memory['dispatcher'] + memory['worker 0']:.1f} MB{together}")
    if proportional.peak:
        parts = ", ".join(
            f"{name} {fields.get('Pss', 0) / 1000:.1f} (anonymous {fields.get('Pss_Anon', 0) / 1000:.1f}, file {fields.get('Pss_File', 0) / 1000:.1f})"
            for name, fields in zip(["dispatcher", "worker 0"], proportional.split.values()))
        print(f"dispatcher + worker 0: peak summed PSS {proportional.peak:.1f} MB ({parts}); smaps kept in {work}")


if __name__ == "__main__":
    main()
