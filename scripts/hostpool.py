"""A pool whose workers run on the share-nothing hosts of scripts/hosts.sh, for the soak on
hosts (soak-hosts.py) and the scale benchmark (bench-hosts.py): a repository whose
`post-receive` hook logs every branch update, the dispatcher on this machine, and workers
started in their hosts' namespaces, each with its own Docker engine and /tmp, reaching the
broker over the hosts' bridge. The work folder is under /var/tmp: a host's /tmp is its own."""
import json
import os
import subprocess
import tempfile
import threading
import urllib.request
import uuid

from benchsetup import write_skill_and_agents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.environ.get("FORGEPOOL_BIN", os.path.join(ROOT, "target", "release", "forgepool"))
HOSTS = os.path.join(ROOT, "scripts", "hosts.sh")
IMAGE = "forgepool-test-agent:dev"
TERMINAL = ("delivered", "delivered_with_warnings", "blocked", "failed", "cancelled")


def run(*args, **kwargs):
    return subprocess.run(list(args), check=True, capture_output=True, text=True, **kwargs)


def hosts(*args):
    """scripts/hosts.sh ARGS; its output."""
    return run(HOSTS, *args).stdout.strip()


def get(url):
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()


class Pool:
    """A dispatcher on this machine and workers on hosts 1..count."""

    def __init__(self, name, count, implement, review, cluster=False, database=None):
        self.count = count
        self.work = tempfile.mkdtemp(prefix=f"forgepool-{name}-", dir="/var/tmp")
        print(f"work folder: {self.work}", flush=True)
        hosts("up", str(count))
        for host in range(1, count + 1):
            hosts("load", str(host), IMAGE)
        self.bare = os.path.join(self.work, "repo.git")
        run("git", "init", "--quiet", "--bare", "--initial-branch=main", self.bare)
        seed = os.path.join(self.work, "seed")
        run("git", "clone", "--quiet", self.bare, seed)
        with open(os.path.join(seed, "README.md"), "w") as f:
            f.write(f"{name}\n")
        run("git", "add", "-A", cwd=seed)
        run("git", "-c", "user.name=s", "-c", "user.email=s@s", "commit", "--quiet", "-m", "start", cwd=seed)
        run("git", "push", "--quiet", "origin", "HEAD:main", cwd=seed)
        self.pushes = os.path.join(self.work, "pushes.log")
        hook = os.path.join(self.bare, "hooks", "post-receive")
        with open(hook, "w") as f:
            f.write(f"#!/bin/sh\nwhile read old new ref; do echo \"$ref $old $new\" >> '{self.pushes}'; done\n")
        os.chmod(hook, 0o755)
        self.skills, self.agents = write_skill_and_agents(self.work, IMAGE, implement, review)
        self.prefix = name.replace("-", "") + uuid.uuid4().hex[:8]
        self.database = database or os.path.join(self.work, "runs.db")
        main_url = ("amqp://guest:guest@127.0.0.1:5681/%2f,127.0.0.1:5682,127.0.0.1:5683" if cluster
                    else "amqp://guest:guest@127.0.0.1:5672/%2f")
        self.env = dict(os.environ, FORGEPOOL_AMQP_PREFIX=self.prefix, FORGEPOOL_AMQP_URL=main_url,
                        FORGEPOOL_ALLOWED_URL_SCHEMES="https,ssh,file",
                        FORGEPOOL_JOB_KEY=os.environ.get("FORGEPOOL_JOB_KEY", "hosts-job-key-0123456789abcdef"),
                        FORGEPOOL_LOG=os.environ.get("POOL_LOG", "info,lapin=off"))
        self.host_url = hosts("amqp-url", "cluster") if cluster else hosts("amqp-url")
        self.workers = {}
        self.started = 0
        self.dispatcher, address = self.spawn([BINARY, "dispatcher", "--listen", "127.0.0.1:0", "--skills",
                                               self.skills, "--agents", self.agents, "--database", self.database],
                                              self.env, "dispatcher.log")
        self.base = f"http://{address}"

    def spawn(self, command, env, log):
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=open(os.path.join(self.work, log), "a"), text=True)
        line = process.stdout.readline()
        threading.Thread(target=lambda: process.stdout.read(), daemon=True).start()
        return process, line.strip().split("listening on ")[-1]

    def start_worker(self, host, slots):
        """Starts a worker on `host`; returns its number."""
        self.started += 1
        n = self.started
        env = dict(self.env, FORGEPOOL_AMQP_URL=self.host_url)
        process, _ = self.spawn([HOSTS, "exec", str(host), BINARY, "worker", "--metrics-addr", "127.0.0.1:0",
                                 "--worker-id", f"{self.prefix}-h{host}-{n}", "--concurrency", str(slots),
                                 "--drain-seconds", "5", "--agents", self.agents], env, f"worker{n}-h{host}.log")
        self.workers[n] = (host, process)
        return n

    def submit(self, ticket):
        body = json.dumps({"ticket": ticket, "skill": "implement-task", "brief": "pool on hosts",
                           "repository": {"url": f"file://{self.bare}", "ref": "main"}}).encode()
        request = urllib.request.Request(self.base + "/v1/runs", data=body,
                                         headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(request, timeout=30).read())["run_id"]

    def states(self):
        listing = json.loads(get(self.base + "/v1/runs?limit=500"))
        return {r["run_id"]: r["state"] for r in listing["runs"]}

    def branch_updates(self):
        updates = {}
        if os.path.exists(self.pushes):
            for line in open(self.pushes):
                ref = line.split()[0]
                updates[ref] = updates.get(ref, 0) + 1
        return updates

    def stage_executions(self, ids):
        executions = 0
        for run_id in ids:
            try:
                # The timeline is bounded JSON; the event stream stays open for a run not ended.
                executions += get(f"{self.base}/v1/runs/{run_id}/timeline?log_lines=0").count('"type":"stage_started"')
            except Exception:
                pass
        return executions

    def leftovers(self):
        """Per host: this pool's containers on its engine, and folders left in its /tmp
        (workspaces; the repository cache stays by design)."""
        left = {}
        for host in range(1, self.count + 1):
            containers = hosts("exec", str(host), "docker", "ps", "-aq", "--filter",
                               f"label=forgepool.cluster={self.prefix}").split()
            # The cache and the gateway's socket folder are the host's state; run folders
            # and their owners' lock files are not.
            listed = hosts("exec", str(host), "sh", "-c",
                           "ls -A /tmp/forgepool 2>/dev/null; ls -A /tmp/forgepool/.owners 2>/dev/null || true").split()
            folders = [f for f in listed if f not in (".cache", ".gateway", ".owners")]
            left[host] = (containers, folders)
        return left

    def stop(self):
        processes = [p for _, p in self.workers.values()] + [self.dispatcher]
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
