#!/usr/bin/env python3
"""Soak of the distributed mode's exactly-once rules (docs/RELIABILITY.md).

100 runs (by default) on 3 workers with 2 slots each, a PostgreSQL store, and chaos while they
run: a random worker is killed with SIGKILL every 5 to 15 s (and a new one started), RabbitMQ is
restarted once, PostgreSQL is stopped for 10 s once, and one worker, which reaches RabbitMQ
through a TCP proxy, is cut off from it for 150 s (bytes dropped both ways, nothing closed, as a
dropped route does) and then healed. Each run's implementer sleeps 1 to 4 s
and writes a random nonce, so a second execution would make a different commit; the origin's
`post-receive` hook logs every branch update. At the end it prints:
  - runs lost: runs not `delivered` (anything else, or not finished in time);
  - duplicate pushes: updates of a run's branch beyond the first;
  - extra stage executions: stage containers started beyond two per run (a killed worker's
    stage runs again on the next one: these are expected, and explained in RELIABILITY.md);
  - leftover containers: forgepool containers of this soak still on the engine.
It exits 1 when a run was lost, pushed twice, or a container was left.

Run: scripts/services.sh && scripts/build-images.sh && cargo build --release &&
     python3 scripts/soak.py [RUNS [MINUTES]]        (scripts/soak.sh does all of it)
"""
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid

from benchsetup import write_skill_and_agents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.join(ROOT, "target", "release", "forgepool")
IMAGE = "forgepool-test-agent:dev"
IMPLEMENT = ["/bin/sh", "-c", "sleep $((RANDOM % 4 + 1)); cat /proc/sys/kernel/random/uuid > /workspace/nonce.txt; echo change >> /workspace/feature.txt"]
REVIEW = ["/bin/sh", "-c", "sleep 1; echo APPROVED"]
TERMINAL = ("delivered", "delivered_with_warnings", "blocked", "failed", "cancelled")


def run(*args, **kwargs):
    return subprocess.run(list(args), check=True, capture_output=True, text=True, **kwargs)


def spawn(args, env, log):
    process = subprocess.Popen([BINARY, *args], env=env, stdout=subprocess.PIPE, stderr=open(log, "a"), text=True)
    line = process.stdout.readline()
    threading.Thread(target=lambda: process.stdout.read(), daemon=True).start()
    return process, line.strip().split("listening on ")[-1]


class Proxy:
    """A TCP proxy to RabbitMQ that can cut its connections off (bytes dropped both ways,
    nothing closed) and heal them (the old connections are closed, new ones forwarded)."""

    def __init__(self, target):
        self.target, self.cut, self.epoch = target, False, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            client, _ = self.listener.accept()
            threading.Thread(target=self.connection, args=(client,), daemon=True).start()

    def wait_heal(self, epoch):
        while self.epoch == epoch:
            time.sleep(0.2)

    def connection(self, client):
        epoch = self.epoch
        if self.cut:
            self.wait_heal(epoch)
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=self.pipe, args=(source, sink, epoch), daemon=True).start()

    def pipe(self, source, sink, epoch):
        source.settimeout(0.5)
        while self.epoch == epoch:
            try:
                data = source.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data:
                if self.cut:
                    self.wait_heal(epoch)
                break
            if not self.cut:
                try:
                    sink.sendall(data)
                except OSError:
                    break
        for end in (source, sink):
            try:
                end.close()
            except OSError:
                pass

    def sever(self):
        self.cut = True

    def heal(self):
        self.cut, self.epoch = False, self.epoch + 1


def get(url):
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 18
    work = tempfile.mkdtemp(prefix="forgepool-soak-")
    print(f"work folder: {work}", flush=True)
    bare = os.path.join(work, "repo.git")
    run("git", "init", "--quiet", "--bare", "--initial-branch=main", bare)
    seed = os.path.join(work, "seed")
    run("git", "clone", "--quiet", bare, seed)
    open(os.path.join(seed, "README.md"), "w").write("soak\n")
    run("git", "add", "-A", cwd=seed)
    run("git", "-c", "user.name=s", "-c", "user.email=s@s", "commit", "--quiet", "-m", "start", cwd=seed)
    run("git", "push", "--quiet", "origin", "HEAD:main", cwd=seed)
    pushes = os.path.join(work, "pushes.log")
    hook = os.path.join(bare, "hooks", "post-receive")
    open(hook, "w").write(f"#!/bin/sh\nwhile read old new ref; do echo \"$ref $old $new\" >> '{pushes}'; done\n")
    os.chmod(hook, 0o755)
    _, agents = write_skill_and_agents(work, IMAGE, IMPLEMENT, REVIEW)
    database = "soak" + uuid.uuid4().hex[:8]
    run("su", "postgres", "-c", f"createdb -O forgepool {database}")
    prefix = "soak" + uuid.uuid4().hex[:8]
    env = dict(os.environ, FORGEPOOL_AMQP_PREFIX=prefix,
               FORGEPOOL_ALLOWED_URL_SCHEMES="https,ssh,file", FORGEPOOL_JOB_KEY=os.environ.get("FORGEPOOL_JOB_KEY", "soak-job-key-0123456789abcdef"),
               FORGEPOOL_LOG=os.environ.get("SOAK_LOG", "info,lapin=off"))
    dispatcher, address = spawn(["dispatcher", "--listen", "127.0.0.1:0", "--skills", os.path.join(work, "skills"),
                                 "--agents", agents, "--database",
                                 f"postgres://forgepool:forgepool@127.0.0.1:5432/{database}"],
                                env, os.path.join(work, "dispatcher.log"))
    base = f"http://{address}"
    workers = {}
    counter = [0]

    proxy = Proxy(("127.0.0.1", 5672))
    amqp = env.get("FORGEPOOL_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    through = dict(env, FORGEPOOL_AMQP_URL=amqp.replace(":5672/", f":{proxy.port}/"))

    def start_worker(worker_env=env):
        counter[0] += 1
        n = counter[0]
        process, _ = spawn(["worker", "--metrics-addr", "127.0.0.1:0", "--worker-id", f"{prefix}-{n}",
                            "--concurrency", "2", "--drain-seconds", "5", "--workspace", os.path.join(work, f"ws{n}"),
                            "--agents", agents], worker_env, os.path.join(work, f"worker{n}.log"))
        workers[n] = process
        return n

    cut_off = start_worker(through)
    for _ in range(2):
        start_worker()
    ids = []
    for k in range(runs):
        body = json.dumps({"ticket": f"SOAK-{k + 1}", "skill": "implement-task", "brief": "soak",
                           "repository": {"url": f"file://{bare}", "ref": "main"}}).encode()
        request = urllib.request.Request(base + "/v1/runs", data=body, headers={"Content-Type": "application/json"})
        ids.append(json.loads(urllib.request.urlopen(request, timeout=30).read())["run_id"])
    print(f"submitted {runs} runs", flush=True)

    started = time.time()
    deadline = started + minutes * 60
    chaos = {"kills": 0, "broker restarts": 0, "store outages": 0, "partitions": 0}
    next_kill = started + random.uniform(5, 15)
    broker_at, store_at = started + 40, started + 90
    # The proxied worker is cut off early (while it has runs), kept out of the kills until it
    # is healed, and healed after 150 s: long enough for the broker to drop it.
    sever_at, heal_at = started + 10, None
    states = {}
    while time.time() < deadline:
        now = time.time()
        try:
            listing = json.loads(get(base + "/v1/runs?limit=500"))
            states = {r["run_id"]: r["state"] for r in listing["runs"]}
        except Exception:
            pass  # the store or the broker is out: the chaos is working
        if len(states) == runs and all(s in TERMINAL for s in states.values()):
            break
        if sever_at and now >= sever_at:
            proxy.sever()
            sever_at, heal_at = None, now + 150
        if heal_at and now >= heal_at:
            proxy.heal()
            chaos["partitions"] += 1
            heal_at = None
        killable = [n for n in workers if n != cut_off or heal_at is None and sever_at is None]
        if now >= next_kill and killable:
            victim = random.choice(killable)
            workers.pop(victim).kill()
            chaos["kills"] += 1
            start_worker()
            next_kill = now + random.uniform(5, 15)
        if broker_at and now >= broker_at:
            run("rabbitmqctl", "stop_app")
            time.sleep(3)
            run("rabbitmqctl", "start_app")
            run("rabbitmqctl", "await_startup")
            chaos["broker restarts"] += 1
            broker_at = None
        if store_at and now >= store_at:
            run("pg_ctlcluster", "15", "main", "stop")
            time.sleep(10)
            run("pg_ctlcluster", "15", "main", "start")
            chaos["store outages"] += 1
            store_at = None
        time.sleep(0.5)
    if heal_at:
        proxy.heal()
        chaos["partitions"] += 1
    elapsed = time.time() - started
    # Dead workers' containers are removed by the survivors' sweep within a minute.
    time.sleep(75)
    for process in list(workers.values()) + [dispatcher]:
        process.terminate()
    for process in list(workers.values()) + [dispatcher]:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()

    lost = [i for i in ids if states.get(i) != "delivered"]
    updates = {}
    if os.path.exists(pushes):
        for line in open(pushes):
            ref = line.split()[0]
            updates[ref] = updates.get(ref, 0) + 1
    duplicates = sum(count - 1 for count in updates.values() if count > 1)
    # Stage containers started, from the dispatcher's log of the events it stored.
    executions = 0
    dispatcher2, address2 = spawn(["dispatcher", "--listen", "127.0.0.1:0", "--skills", os.path.join(work, "skills"),
                                   "--agents", agents, "--database",
                                   f"postgres://forgepool:forgepool@127.0.0.1:5432/{database}"],
                                  env, os.path.join(work, "dispatcher-after.log"))
    for run_id in ids:
        try:
            stream = get(f"http://{address2}/v1/runs/{run_id}/events")
            executions += stream.count('"type":"stage_started"')
        except Exception:
            pass
    dispatcher2.terminate()
    dispatcher2.wait(timeout=60)
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=forgepool.cluster={prefix}"],
                          capture_output=True, text=True).stdout.split()
    print(f"chaos: {chaos}, in {elapsed:.0f} s")
    print(f"runs lost: {len(lost)} of {runs} {[states.get(i) for i in lost][:10]}")
    print(f"duplicate pushes: {duplicates}")
    print(f"extra stage executions: {executions - 2 * (runs - len(lost))} ({executions} stage containers for {runs} runs)")
    print(f"leftover containers: {len(left)}")
    sys.exit(1 if lost or duplicates or left else 0)


if __name__ == "__main__":
    main()
