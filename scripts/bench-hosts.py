#!/usr/bin/env python3
"""Scale across hosts (docs/BENCHMARKS.md): runs per minute of one worker host against four,
the same slots each, with the dispatcher, the broker and the store shared.

Each host (scripts/hosts.sh: its own Docker engine, /tmp and address) runs one worker with
SLOTS slots; agents wait rather than compute (the implementer sleeps IMPLEMENT_S seconds, the
reviewer REVIEW_S), so the pool, not the agents, is what is measured. For each host count it
submits WAVES x hosts x SLOTS runs at once and measures runs per minute from the first
submission to the last run's end, with the machine's CPU use over that time (a scale that
falls short names the part that limits it: the CPU time of the dispatcher, the workers, the
Docker engines and the broker, from /proc).

Run (as root): scripts/services.sh && scripts/build-images.sh && cargo build --release &&
     python3 scripts/bench-hosts.py [SLOTS [WAVES]]     (default 4 slots, 3 waves)
"""
import os
import sys
import time

from hostpool import Pool, TERMINAL, hosts

IMPLEMENT_S = int(os.environ.get("IMPLEMENT_S", "20"))
REVIEW_S = int(os.environ.get("REVIEW_S", "10"))


def cpu_seconds_by_part():
    """CPU seconds used so far by each part of the pool, from /proc."""
    parts = {"forgepool": 0.0, "docker": 0.0, "rabbitmq": 0.0, "git": 0.0, "other": 0.0}
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        used = (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / ticks
        if name.startswith("forgepool"):
            parts["forgepool"] += used
        elif name in ("dockerd", "containerd", "containerd-shim", "runc", "docker-init") or name.startswith("containerd"):
            parts["docker"] += used
        elif name in ("beam.smp", "erl_child_setup", "epmd"):
            parts["rabbitmq"] += used
        elif name.startswith("git"):
            parts["git"] += used
        else:
            parts["other"] += used
    return parts


def busy_cpu():
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def measure(count, slots, waves):
    implement = ["/bin/sh", "-c", f"sleep {IMPLEMENT_S}; cat /proc/sys/kernel/random/uuid > /workspace/nonce.txt"]
    review = ["/bin/sh", "-c", f"sleep {REVIEW_S}; echo APPROVED"]
    pool = Pool(f"bench-hosts{count}", count, implement, review)
    try:
        for host in range(1, count + 1):
            pool.start_worker(host, slots)
        time.sleep(3)
        runs = waves * count * slots
        cpu_before, busy_before = cpu_seconds_by_part(), busy_cpu()
        started = time.time()
        ids = [pool.submit(f"SCALE-{n}") for n in range(runs)]
        states = {}
        while time.time() - started < 1800:
            states = pool.states()
            if len(states) >= runs and all(s in TERMINAL for s in states.values()):
                break
            time.sleep(0.5)
        elapsed = time.time() - started
        busy_after, cpu_after = busy_cpu(), cpu_seconds_by_part()
        delivered = sum(1 for i in ids if states.get(i) == "delivered")
        share = (busy_after[0] - busy_before[0]) / max(1, busy_after[1] - busy_before[1])
        used = {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after}
        return runs, delivered, elapsed, share, used
    finally:
        pool.stop()
        hosts("down")


def main():
    slots = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    waves = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    results = {}
    for count in (1, 4):
        runs, delivered, elapsed, share, used = measure(count, slots, waves)
        per_minute = delivered / elapsed * 60
        results[count] = per_minute
        print(f"{count} host(s) x {slots} slots: {delivered}/{runs} runs delivered in {elapsed:.1f} s = "
              f"{per_minute:.1f} runs/min; machine CPU {share:.0%} busy; CPU seconds by part {used}", flush=True)
    print(f"scale: {results[4] / results[1]:.2f}x the runs per minute of one host (target 3.6x)")


if __name__ == "__main__":
    main()
