#!/usr/bin/env python3
"""Soak of a pool across hosts and broker nodes (docs/RELIABILITY.md).

100 runs (by default) on three share-nothing worker hosts (scripts/hosts.sh: one worker with 2
slots each, its own Docker engine and /tmp) and the three-node RabbitMQ cluster of
scripts/rabbit-cluster.sh, with a PostgreSQL store, and chaos while they run:
  - the node that leads the jobs queue is killed (SIGKILL of its Erlang VM) and started again;
  - a second node is stopped for 30 s;
  - a random worker is SIGKILLed every 10 to 20 s and started again on its host;
  - one worker host is cut off from the bridge for 60 s (its link down: nothing closed);
  - PostgreSQL is stopped for 10 s.
Each run's implementer sleeps 4 to 11 s (so the runs outlast the chaos) and writes a random nonce, so a second execution would
make a different commit; the origin's `post-receive` hook logs every branch update. At the
end it prints runs lost, duplicate pushes, extra stage executions, and what was left on each
host (containers of this soak, folders in its workspace root). It exits 1 when a run was lost,
pushed twice, or anything was left.

Run (as root): scripts/services.sh && scripts/rabbit-cluster.sh up && scripts/build-images.sh &&
     cargo build --release && python3 scripts/soak-hosts.py [RUNS [MINUTES]]
     (scripts/soak.sh --hosts does all of it)
"""
import os
import random
import subprocess
import sys
import time
import uuid

from hostpool import Pool, TERMINAL, hosts, run

IMPLEMENT = ["/bin/sh", "-c", "sleep $((RANDOM % 8 + 4)); cat /proc/sys/kernel/random/uuid > /workspace/nonce.txt; echo change >> /workspace/feature.txt"]
REVIEW = ["/bin/sh", "-c", "sleep 2; echo APPROVED"]
HOSTS = 3
CLUSTER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rabbit-cluster.sh")
NODE = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


def leader(queue):
    """The cluster node that leads `queue` (1, 2 or 3), or None."""
    for n in (1, 2, 3):
        try:
            out = run("rabbitmqctl", "-q", "-n", f"fp{n}@{NODE}", "list_queues", "name", "leader",
                      "--no-table-headers").stdout
        except subprocess.CalledProcessError:
            continue
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == queue:
                return int(parts[1].split("@")[0][2:])
    return None


def kill_node(n):
    """SIGKILLs node n's Erlang VM, as a machine that died would."""
    pid = open(f"/var/lib/rabbitmq/fp-cluster/n{n}/pid").read().strip()
    subprocess.run(["kill", "-9", pid])


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    minutes = float(sys.argv[2]) if len(sys.argv) > 2 else 25
    database = "soakhosts" + uuid.uuid4().hex[:8]
    run("su", "postgres", "-c", f"createdb -O forgepool {database}")
    pool = Pool("soak-hosts", HOSTS, IMPLEMENT, REVIEW, cluster=True,
                database=f"postgres://forgepool:forgepool@127.0.0.1:5432/{database}")
    for host in range(1, HOSTS + 1):
        pool.start_worker(host, 2)
    ids = [pool.submit(f"SOAK-{k + 1}") for k in range(runs)]
    print(f"submitted {runs} runs", flush=True)

    started = time.time()
    deadline = started + minutes * 60
    chaos = {"worker kills": 0, "leader kills": 0, "node stops": 0, "host partitions": 0, "store outages": 0}
    next_kill = started + random.uniform(10, 20)
    leader_at, stop_at, cut_at, store_at = started + 20, started + 60, started + 100, started + 170
    states = {}
    while time.time() < deadline:
        now = time.time()
        try:
            states = pool.states()
        except Exception:
            pass  # the store or the broker is out: the chaos is working
        if len(states) == runs and all(s in TERMINAL for s in states.values()):
            break
        if now >= next_kill:
            victim = random.choice(list(pool.workers))
            host, process = pool.workers.pop(victim)
            process.kill()
            chaos["worker kills"] += 1
            pool.start_worker(host, 2)
            next_kill = now + random.uniform(10, 20)
        if leader_at and now >= leader_at:
            n = leader(f"{pool.prefix}.jobs") or 1
            print(f"killing node fp{n}, the jobs queue's leader", flush=True)
            kill_node(n)
            time.sleep(5)
            run(CLUSTER, "up")
            chaos["leader kills"] += 1
            leader_at = None
        if stop_at and now >= stop_at:
            n = random.choice([1, 2, 3])
            print(f"stopping node fp{n} for 30 s", flush=True)
            run(CLUSTER, "stop", str(n))
            time.sleep(30)
            run(CLUSTER, "start", str(n))
            chaos["node stops"] += 1
            stop_at = None
        if cut_at and now >= cut_at:
            print("cutting host 1 off for 60 s", flush=True)
            run("ip", "link", "set", "fph1-out", "down")
            time.sleep(60)
            run("ip", "link", "set", "fph1-out", "up")
            chaos["host partitions"] += 1
            cut_at = None
        if store_at and now >= store_at:
            run("pg_ctlcluster", "15", "main", "stop")
            time.sleep(10)
            run("pg_ctlcluster", "15", "main", "start")
            chaos["store outages"] += 1
            store_at = None
        time.sleep(0.5)
    elapsed = time.time() - started
    try:
        states = pool.states()
    except Exception:
        pass
    # Dead workers' containers are removed by the survivors' sweep within a minute.
    time.sleep(75)
    executions = pool.stage_executions(ids)
    pool.stop()
    lost = [i for i in ids if states.get(i) != "delivered"]
    duplicates = sum(count - 1 for count in pool.branch_updates().values() if count > 1)
    left = pool.leftovers()
    print(f"chaos: {chaos}, in {elapsed:.0f} s")
    print(f"runs lost: {len(lost)} of {runs} {[states.get(i) for i in lost][:10]}")
    print(f"duplicate pushes: {duplicates}")
    print(f"extra stage executions: {executions - 2 * (runs - len(lost))} ({executions} stage containers for {runs} runs)")
    for host, (containers, folders) in left.items():
        print(f"host {host}: {len(containers)} containers and {len(folders)} workspace folders left {folders[:5]}")
    dirty = any(c or f for c, f in left.values())
    if os.environ.get("SOAK_KEEP_HOSTS") != "1":
        hosts("down")
    sys.exit(1 if lost or duplicates or dirty else 0)


if __name__ == "__main__":
    main()
