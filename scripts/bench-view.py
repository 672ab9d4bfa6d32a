#!/usr/bin/env python3
"""The web view's page-load benchmark (docs/BENCHMARKS.md): a SQLite store holding 10,000 runs,
one of them with 200 review cycles and 100,000 log lines, served by a release dispatcher; Debian's
Chromium (driven by Playwright, scripts/browser-tools.sh) loads `/` and that run's page, cold
each time, and the median of the runs is printed.

Usage: FORGEPOOL_BIN=target/release/forgepool scripts/bench-view.py [RUNS=10000] [REPEATS=7]
Needs RabbitMQ (scripts/services.sh): the dispatcher connects to it, though no job is run.
"""
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("FORGEPOOL_BIN", os.path.join(ROOT, "target/release/forgepool"))
RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 7
CYCLES = 200
LOG_LINES = 100_000
STATES = ["delivered", "delivered_with_warnings", "failed", "blocked", "cancelled"]


def job(run_id, ticket, at):
    return {
        "schema_version": 1, "run_id": run_id, "ticket": ticket, "project": "shop",
        "skill": "implement-task", "step": "implement_task", "brief": "Add the feature " * 20,
        "repository": {"url": "file:///r.git"}, "commands": [], "skill_md": "s", "review": None,
        "repair_budget": 2,
        "implementer": {"name": "claude", "image": "i", "command": [], "env": [], "network": "none",
                        "memory_bytes": 1 << 30, "cpus": 1.0, "timeout_seconds": 600, "user": None},
        "reviewer": None, "final_reviewer": None, "warnings": [], "submitted_at": at,
    }


def event(run_id, at, kind):
    return json.dumps({"schema_version": 1, "event_id": str(uuid.uuid4()), "run_id": run_id,
                       "time": at, **kind})


def cycle_record(n):
    verdict = "approved" if n == CYCLES else "rejected"
    feedback = "" if n == CYCLES else (
        f"Cycle {n}: **error handling** is still missing in `process_data()`.\n\n"
        "- add a test for the empty input\n- handle `None`\n")
    return {"step": "implement_task", "file": f"review_cycle_{n}.json", "cycle": n,
            "max_cycles": CYCLES, "verdict": verdict, "feedback": feedback,
            "content": {"cycle": n, "verdict": verdict}, "origin": "forgepool"}


def fill(path):
    """The store: migrated by the dispatcher itself, then filled with plain SQL."""
    db = sqlite3.connect(path)
    c = db.cursor()
    big = str(uuid.uuid4())
    for i in range(RUNS):
        run_id = big if i == RUNS - 1 else str(uuid.uuid4())
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (RUNS - i) * 60))
        state = "running" if run_id == big else STATES[i % len(STATES)]
        c.execute("INSERT INTO runs (run_id, ticket, state, job, result, published, created_at, updated_at)"
                  " VALUES (?, ?, ?, ?, NULL, 1, ?, ?)",
                  (run_id, f"SHOP-{i}", state, json.dumps(job(run_id, f"SHOP-{i}", at)), at, at))
        c.execute("INSERT INTO state_history (run_id, state, reason, time) VALUES (?, 'queued', 'accepted', ?)",
                  (run_id, at))
        c.execute("INSERT INTO state_history (run_id, state, reason, time) VALUES (?, ?, 'done', ?)",
                  (run_id, state, at))
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for n in range(1, CYCLES + 1):
        record = cycle_record(n)
        c.execute("INSERT INTO cycles (run_id, step, file, cycle, body) VALUES (?, ?, ?, ?, ?)",
                  (big, "implement_task", record["file"], n, json.dumps(record)))
        rows.append(("stage_started", event(big, at, {"type": "stage_started", "stage": "review",
                                                      "round": n, "cycle": n})))
        rows.append(("stage_finished", event(big, at, {
            "type": "stage_finished", "stage": "review", "round": n, "cycle": n, "exit_code": 0,
            "duration_seconds": 12.5, "outcome": "completed"})))
        rows.append(("cycle", event(big, at, {"type": "cycle", "cycle": record})))
        for line in range(LOG_LINES // CYCLES):
            rows.append(("log", event(big, at, {"type": "log", "stage": "review", "stream": "stdout",
                                                "text": f"cycle {n}: line {line} of the reviewer's output\n"})))
    c.executemany("INSERT INTO events (event_id, run_id, kind, time, body) VALUES (?, ?, ?, ?, ?)",
                  [(json.loads(body)["event_id"], big, kind, at, body) for kind, body in rows])
    db.commit()
    db.close()
    return big


def main():
    work = tempfile.mkdtemp(prefix="forgepool-bench-view-")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from benchsetup import write_skill_and_agents
    skills, agents = write_skill_and_agents(work, "busybox", ["true"], ["true"])
    store = os.path.join(work, "runs.db")
    env = dict(os.environ, FORGEPOOL_AMQP_PREFIX=f"bv{uuid.uuid4().hex[:8]}",
               FORGEPOOL_JOB_KEY="bench-view-key-0123456789abcdef0123", FORGEPOOL_LOG="warn",
               FORGEPOOL_ALLOWED_URL_SCHEMES="https,ssh,file")
    args = [BIN, "dispatcher", "--listen", "127.0.0.1:18089", "--skills", skills,
            "--agents", agents, "--database", store]
    # The first start migrates the empty store; then it is filled and the dispatcher restarted.
    first = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3)
    first.terminate()
    first.wait()
    started = time.time()
    big = fill(store)
    print(f"store: {RUNS} runs, one with {CYCLES} cycles and {LOG_LINES} log lines "
          f"({os.path.getsize(store) / 1e6:.0f} MB, filled in {time.time() - started:.0f} s)")
    dispatcher = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(3)
        node = subprocess.run(
            ["node", os.path.join(ROOT, "scripts/bench-view.js")],
            env=dict(os.environ, NODE_PATH=os.path.join(ROOT, ".tools/browser/node_modules"),
                     URL="http://127.0.0.1:18089", RUN=big, REPEATS=str(REPEATS)),
            check=True)
    finally:
        dispatcher.terminate()
        dispatcher.wait()


if __name__ == "__main__":
    main()
