#!/usr/bin/env python3
"""What a big repository costs a run (docs/BENCHMARKS.md, "Big repositories").

Generates a repository of FILES files (50,000 by default, 4 KiB each, about 200 MB) and one of
a single file, then times `forgepool run` with two trivial stages (to the line "Run delivered", when the run's end is
recorded; the process then removes the run's workspace) (an implementer that appends
a line, a reviewer that approves) on each, ROUNDS times (5 by default):
  - one-file repository;
  - big repository on a fresh worker (an empty repository cache each time);
  - big repository with a warm cache (the cache of an earlier run of the same repository).
It prints the median of each, the overheads (big minus one-file) and the peak resident memory
of `forgepool run` (needs GNU time, Debian's `time` package).

Run: scripts/services.sh && scripts/build-images.sh && cargo build --release &&
     python3 scripts/bench-bigrepo.py [FILES [ROUNDS]]

The work folder is mkdtemp's, which only root may open, as a worker's is by default: git
still checks the cached checkout out as the stage user (through `setpriv`, with
CAP_DAC_READ_SEARCH alone). BENCH_OPEN=1 opens it (0755) to compare. BENCH_SHOW=DIR keeps each run's log in DIR (with
FORGEPOOL_LOG=info,forgepool_worker::workspace::git=debug, every git command and its seconds).
"""
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchsetup import write_skill_and_agents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.environ.get("FORGEPOOL_BIN", os.path.join(ROOT, "target", "release", "forgepool"))
IMAGE = "forgepool-test-agent:dev"
IMPLEMENT = ["/bin/sh", "-c", "echo change >> /workspace/feature.txt"]
REVIEW = ["/bin/sh", "-c", "echo APPROVED"]


def run(*args, **kwargs):
    return subprocess.run(list(args), check=True, capture_output=True, **kwargs)


def make_repository(path, files):
    """A bare repository with one commit of `files` files, made with git fast-import."""
    run("git", "init", "--quiet", "--bare", "--initial-branch=main", path)
    stream = bytearray()
    for n in range(files):
        body = (f"file {n}\n" + "x" * 63 + "\n").encode() * 64
        stream += b"blob\nmark :%d\ndata %d\n" % (n + 1, len(body)) + body + b"\n"
    stream += b"commit refs/heads/main\ncommitter bench <b@b> 1700000000 +0000\ndata 5\nstart\n"
    for n in range(files):
        stream += b"M 100644 :%d src/d%03d/f%05d.txt\n" % (n + 1, n % 500, n)
    stream += b"\n"
    subprocess.run(["git", "fast-import", "--quiet"], cwd=path, input=bytes(stream), check=True)
    run("git", "gc", "--quiet", cwd=path)


def main():
    files = int(sys.argv[1]) if len(sys.argv) > 1 else 50_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    work = tempfile.mkdtemp(prefix="forgepool-bigrepo-")
    if os.environ.get("BENCH_OPEN"):
        os.chmod(work, 0o755)
    print(f"work folder: {work}", flush=True)
    big, small = os.path.join(work, "big.git"), os.path.join(work, "small.git")
    began = time.time()
    make_repository(big, files)
    make_repository(small, 1)
    print(f"made a repository of {files} files in {time.time() - began:.1f} s", flush=True)
    _, agents = write_skill_and_agents(work, IMAGE, IMPLEMENT, REVIEW, 'memory = "256m"\n')
    warm_cache = os.path.join(work, "cache-warm")
    counter = [0]
    walls, peaks = [], []

    def one(repository, cache):
        counter[0] += 1
        request = os.path.join(work, f"request{counter[0]}.toml")
        open(request, "w").write(
            f"ticket = \"BIG-{counter[0]}\"\nskill = \"implement-task\"\nbrief = \"bench\"\n"
            f"[repository]\nurl = \"file://{repository}\"\nref = \"main\"\n")
        env = dict(os.environ, FORGEPOOL_CACHE_DIR=cache, FORGEPOOL_LOG=os.environ.get("FORGEPOOL_LOG", "warn"))
        started = time.time()
        memory = os.path.join(work, "memory.txt")
        process = subprocess.Popen(["/usr/bin/time", "-f", "%M", "-o", memory, BINARY, "run", request, "--skills", os.path.join(work, "skills"),
                                    "--agents", agents, "--database", os.path.join(work, "runs.db"),
                                    "--workspace", os.path.join(work, "ws")],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ended, lines = None, []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Run delivered"):
                ended = time.time() - started
        code = process.wait()
        if os.environ.get("BENCH_SHOW"):
            # A folder: each run's whole log is kept there (`FORGEPOOL_LOG` chooses what it holds).
            os.makedirs(os.environ["BENCH_SHOW"], exist_ok=True)
            with open(os.path.join(os.environ["BENCH_SHOW"], f"run{counter[0]}.log"), "w") as kept:
                kept.write(process.stderr.read())
        wall = time.time() - started
        if code != 0 or ended is None:
            print("".join(lines[-20:]), process.stderr.read()[-2000:])
            raise SystemExit(f"forgepool run failed with {code}")
        walls.append(wall)
        peaks.append(int(open(memory).read().split()[-1]) / 1024)
        return ended

    one(big, warm_cache)  # warms the cache (and the page cache for every case alike)
    times = {"one-file": [], "big, fresh worker": [], "big, warm cache": []}
    for n in range(rounds):
        fresh = os.path.join(work, f"cache-fresh-{n}")
        times["one-file"].append(one(small, os.path.join(work, f"cache-small-{n}")))
        times["big, fresh worker"].append(one(big, fresh))
        shutil.rmtree(fresh, ignore_errors=True)
        times["big, warm cache"].append(one(big, warm_cache))
        print(f"round {n + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"process wall time (the workspace removed after the run's end): median {statistics.median(walls):.2f} s")
    peak = max(peaks)
    for name, value in medians.items():
        print(f"median {name}: {value:.2f} s")
    print(f"overhead on a fresh worker: {medians['big, fresh worker'] - medians['one-file']:.2f} s (target 5 s)")
    print(f"overhead with a warm cache: {medians['big, warm cache'] - medians['one-file']:.2f} s (target 1 s)")
    print(f"peak resident memory of `forgepool run` (GNU time's %M; its git children are counted when larger): {peak:.1f} MB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
