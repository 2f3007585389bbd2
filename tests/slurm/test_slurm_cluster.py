"""`make slurm-check`: the Slurm agent against a real Slurm 22.05 cluster on this host; `make slurm-check-24`:
the same with SLURM_CHROOT set, every Slurm daemon and client from Slurm 24.11.5 in a Debian trixie root
(`slurm-check-26`: Debian testing's; `slurm-check-src`: one built from SchedMD's source, e.g. 23.02, 23.11, 25.05 or 25.11).

Starts scripts/slurm/cluster.sh (munge, MariaDB + slurmdbd, slurmctld, 4 fake 8-GPU nodes), a
Tansu broker, the Faust worker, the sink into chDB, one GPU agent per node (`--backend
sim-slurm`, 1 s ticks: the GPUs Slurm gave a job are busy at its GPULEDGER_SIM_LOAD) and the
Slurm agent (1 s polls). Submits real jobs — completed, exit 3, cancelled, a hung job (0 % load),
an array, a multi-node job, an admin requeue, a job pending for lack of GPUs, a preemption by the
higher-tier partition, a 3-GPU job that starts and ends while the agent is paused (SIGSTOP: its GPUs from the
PrologSlurmctld record, deploy/slurm/gpuledger-prolog-slurmctld), a 2-GPU job that starts and is requeued
meanwhile, seen pending (held) before (its first attempt's GPUs from its record too), and one submitted, started
and requeued meanwhile (first seen at restart count 1: its first attempt from sacct), and a running job suspended
and resumed meanwhile (told from Slurm's pre_sus_time: its suspended time idle) — and, meanwhile, kills the Slurm agent
(SIGKILL, restarted) and restarts slurmctld; at the end a job leaves squeue (MinJobAge 10 s) while the agent is stopped, and the
restarted agent closes it from sacct, and another is submitted, runs and leaves squeue meanwhile: the restarted
agent recovers it from sacct (`sacct -S`). Then, per job and attempt, the ledger must agree with
Slurm's accounting (sacct): allocated GPU-seconds (usage_raw, allocated_idle + executing) = gres/gpu × (Elapsed +
Suspended) within one poll interval per GPU, and outcome, attempts, tenant (account) and queue (partition) equal.
The ledger runs its bundled definitions except `min_idle_s` = 5 s (instead of 300 s), so the hung
job's idle time shows in a short run. Prints the per-job table (docs/slurm.md shows one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

from gpuledger.embedded.broker import EmbeddedBroker, free_port
from gpuledger.config import Settings
from gpuledger.embedded.processes import ChildProcess, read_topic_records, wait_until_caught_up
from metrics_scrape import sample, scrape

pytestmark = [pytest.mark.slurm, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = ROOT / "scripts" / "slurm" / "cluster.sh"
NODES = ("gpu01", "gpu02", "gpu03", "gpu04")
POLL_S = 1.0
MIN_JOB_AGE_S = 10  # finished jobs leave squeue after this (plus slurmctld's purge interval)
MIN_IDLE_S = 5
#: scripts/slurm/gres.conf.in: a GPU's parts, 32 shards over each of gpu01-03's 8 GPUs, 800 MPS over gpu04's
PARTS_PER_GPU = {"shard": 4, "mps": 100}
CLUSTER = "gpuledger"


def say(text: str) -> None:
    print(f"[slurm-check {time.strftime('%H:%M:%S')}] {text}", flush=True)


def wait_for_topic(settings: Settings, topic: str, satisfied, what: str, timeout_s: float = 120) -> None:
    """Until `satisfied` holds for the (partition, key, value) records in `topic`: waits on what an
    agent has published, not a sleep for what it usually needs (a loaded machine stretches that)."""
    deadline = time.monotonic() + timeout_s
    while not satisfied(read_topic_records(settings, topic)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} on {topic} within {timeout_s:.0f} s")
        time.sleep(0.5)


def lifecycle(records) -> list[tuple[int, dict]]:
    return [(p, orjson.loads(v)) for p, _, v in records]


def sh(*argv: str, timeout: float = 20, check: bool = True) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    return out.stdout


class Cluster:
    def __init__(self, directory: Path):
        self.dir = directory

    def script(self, cmd: str, timeout: float = 900) -> str:
        return sh("bash", str(CLUSTER_SH), cmd, str(self.dir), timeout=timeout)

    def submit(self, *args: str, load: int = 80) -> str:
        out = sh("sbatch", "--parsable", "-o", "/dev/null", "-D", str(self.dir),
                 f"--export=ALL,GPULEDGER_SIM_LOAD={load}", *args)
        return out.strip().split(";")[0]

    def jobs(self) -> dict[str, dict]:
        """squeue's view by canonical id ('3_1' for array tasks); {} while the controller is down."""
        try:
            data = json.loads(sh("squeue", "--json", "--states=all", timeout=10))
        except (RuntimeError, subprocess.TimeoutExpired, ValueError):
            return {}
        out = {}
        for j in data["jobs"]:
            j = {k: plain(v) for k, v in j.items()}
            if j.get("array_task_id") is not None and j.get("array_job_id"):
                out[f"{j['array_job_id']}_{j['array_task_id']}"] = j
            elif not j.get("array_task_string"):
                out[str(j["job_id"])] = j
        return out

    def wait(self, job: str, states: set[str], timeout: float = 90, restarts: int | None = None) -> dict:
        """Until squeue shows the job in one of `states` — or, for final states, sacct does (a finished
        job leaves squeue after MinJobAge)."""
        deadline = time.monotonic() + timeout
        final = states <= {"COMPLETED", "FAILED", "CANCELLED"}
        while time.monotonic() < deadline:
            j = self.jobs().get(job)
            if j and j["job_state"] in states and (restarts is None or j["restart_cnt"] >= restarts):
                return j
            if final and j is None:
                rows = sacct_attempts().get(job, [])
                if rows and rows[-1]["state"] in states and len(rows) > (restarts or 0):
                    return rows[-1]
            time.sleep(0.5)
        last = self.jobs().get(job, {})
        raise TimeoutError(f"job {job} not in {states} after {timeout}s: {last.get('job_state')} "
                           f"({last.get('state_reason')}); GPUs in use per node {self.gpus_in_use()}")

    def gpus_in_use(self) -> dict[str, int | None]:
        """Slurm's own count of each node's allocated GPUs (`scontrol show node -d`: GresUsed)."""
        try:
            text = sh("scontrol", "show", "node", "-d", timeout=10)
        except (RuntimeError, subprocess.TimeoutExpired):
            return {}
        used: dict[str, int | None] = {}
        for block in text.split("NodeName=")[1:]:
            m = re.search(r"GresUsed=gpu(?::[^:\s(]+)?:(\d+)", block)
            used[block.split()[0]] = int(m.group(1)) if m else None
        return used

    def wait_all_gpus_free(self, timeout: float = 60) -> None:
        """Until Slurm counts no GPU in use on any node (finished jobs' epilogs done); a clear failure
        naming the nodes where it keeps counting some (a leak) instead of a later job's pending timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            used = self.gpus_in_use()
            if len(used) == len(NODES) and not any(used.values()):
                return
            time.sleep(0.5)
        raise AssertionError(f"Slurm still counts GPUs in use with every job finished: {used}")


def plain(v):
    """A squeue value as Slurm 22.05 writes it: 24.11 writes numbers as {"set", "infinite", "number"} and
    job_state as [base, flags...] (COMPLETING shown over the base, as 22.05 did)."""
    if isinstance(v, dict) and "number" in v:
        return v["number"] if v.get("set") and not v.get("infinite") else None
    if isinstance(v, list) and v and all(isinstance(x, str) and x.isupper() for x in v):
        return "COMPLETING" if "COMPLETING" in v else v[0]
    return v


def sacct_attempts() -> dict[str, list[dict]]:
    """sacct's allocations, per canonical job id, oldest attempt first (--duplicates lists requeued runs)."""
    text = sh("sacct", "-P", "-n", "--duplicates", "-X", "-o",
              "JobID,JobIDRaw,State,Start,End,Elapsed,AllocTRES,ExitCode,Account,Partition,Suspended", timeout=20)
    out: dict[str, list[dict]] = {}
    for line in text.splitlines():
        f = line.split("|")
        if len(f) < 11:
            continue
        m = re.search(r"gres/gpu=(\d+)", f[6])
        parts = re.search(r"gres/(shard|mps)=(\d+)", f[6])  # a part of one GPU: its parts over the GPU's
        gpus = int(m.group(1)) if m else int(parts.group(2)) / PARTS_PER_GPU[parts.group(1)] if parts else 0
        out.setdefault(f[0], []).append({
            "state": f[2].split()[0], "start": f[3], "end": f[4], "elapsed_s": elapsed_s(f[5]),
            "gpus": gpus, "exit": f[7], "account": f[8], "partition": f[9],
            # Elapsed leaves out the time suspended; the job held its GPUs all along (the ledger bills it idle)
            "suspended_s": elapsed_s(f[10])})
    for rows in out.values():
        rows.sort(key=lambda r: r["start"])
    return out


def elapsed_s(text: str) -> int:
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


LEDGER_SCRIPT = r"""
import json, sys
from gpuledger.config import Settings
from gpuledger.warehouse import connect
c = connect(Settings(warehouse="chdb:" + sys.argv[1]))
try:
    usage = c.query(
        "SELECT job_id, attempt, sum(gpu_ms), sumIf(gpu_ms, state = 'executing'), any(tenant), any(queue), "
        "count(), uniqExact(record_id) FROM usage_raw WHERE state IN ('allocated_idle', 'executing') "
        "GROUP BY job_id, attempt").result_rows
    events = c.query("SELECT job_id, attempt, kind, reason, tenant, queue, event_id, requested_gpus FROM job_events "
                     "ORDER BY job_id, attempt, ts_ms").result_rows
    # rows: every record written, copies included (usage_raw folds copies when its parts merge, sql/0022)
    (rows, ids), = c.query("SELECT (SELECT sum(slices) FROM usage_capacity_daily), uniqExact(record_id) "
                           "FROM usage_raw").result_rows
    snaps = c.query("SELECT count() FROM scheduler_snapshots").result_rows[0][0]
    queues = c.query("SELECT queue, max(quota_gpus), max(allocated_gpus), max(pending_jobs) FROM scheduler_snapshots "
                     "GROUP BY queue ORDER BY queue").result_rows
    attempts = c.query("SELECT job_id, attempt, outcome, tenant, queue FROM job_attempts").result_rows
    preempt = c.query("SELECT job_id, by_job_id FROM scheduler_preemptions").result_rows
finally:
    c.close()
print(json.dumps({"usage": usage, "events": events, "rows": rows, "ids": ids, "snapshots": snaps,
                  "queues": queues, "attempts": attempts,
                  "preemptions": preempt}, default=str))
"""


def read_ledger(chdb_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", LEDGER_SCRIPT, str(chdb_dir)], capture_output=True, text=True,
                         timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading the ledger failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster():
    directory = ROOT / "build" / "slurm-check"
    c = Cluster(directory)
    if directory.exists():
        c.script("stop", timeout=120)
        shutil.rmtree(directory)
    say("starting the Slurm cluster (installs slurm-wlm munge slurmdbd mariadb-server when missing)")
    t0 = time.monotonic()
    os.environ["SLURM_MIN_JOB_AGE"] = str(MIN_JOB_AGE_S)
    for line in c.script("start").splitlines():  # SLURM_CONF; with SLURM_CHROOT also PATH (its wrappers)
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            os.environ[name] = value
    say(f"cluster up in {time.monotonic() - t0:.1f}s")
    try:
        yield c
    finally:
        c.script("stop", timeout=120)


def test_ledger_matches_sacct(cluster, tmp_path):
    started = time.monotonic()
    logs = tmp_path / "logs"
    logs.mkdir()
    with EmbeddedBroker(log_path=logs / "tansu.log") as broker:
        # the bundled definitions, with a quiet GPU counted idle after 5 s instead of 300 s, so the
        # hung job's idle time shows within a short run
        ledger_toml = tmp_path / "ledger.toml"
        defaults = (ROOT / "gpuledger" / "ledger_defaults.toml").read_text()
        assert "min_idle_s = 300" in defaults
        ledger_toml.write_text(defaults.replace("min_idle_s = 300", f"min_idle_s = {MIN_IDLE_S}"))
        s = Settings(kafka_bootstrap=broker.bootstrap, ledger_config=ledger_toml, topic_prefix=f"s{uuid.uuid4().hex[:6]}.",
                     worker_app_id=f"w{uuid.uuid4().hex[:6]}", data_dir=tmp_path / "data",
                     warehouse=f"chdb:{tmp_path / 'chdb'}", partitions_gpu_samples=2, partitions_job_events=2,
                     partitions_usage=2, worker_rebalance_timeout_s=4.0, worker_snapshot_interval_s=1.0,
                     cluster=CLUSTER, agent_spool_fsync="never")
        from gpuledger.topics import create_topics
        from gpuledger.warehouse import connect, migrate
        create_topics(s)
        client = connect(s)
        try:
            migrate(client, s.database)
        finally:
            client.close()
        procs: list[ChildProcess] = []

        def child(name: str, *args: str) -> ChildProcess:
            p = ChildProcess(s, *args, log_path=logs / f"{name}.log").start()
            procs.append(p)
            return p

        try:
            worker = child("worker", "worker")
            sink = child("sink", "sink")
            for node in NODES:
                child(f"gpu-{node}", "agent", "gpu", "--backend", "sim-slurm", "--node", node, "--cluster", CLUSTER,
                      "--interval", "1")
            state_file = tmp_path / "slurm-agent.json"
            # cluster.sh's PrologSlurmctld (deploy/slurm/gpuledger-prolog-slurmctld) records allocations there
            agent_args = ("agent", "slurm", "--cluster", CLUSTER, "--interval", str(POLL_S),
                          "--state-file", str(state_file), "--command-timeout", "8",
                          "--allocations-dir", str(cluster.dir / "allocations"))
            agent = child("slurm-agent", *agent_args)
            # the ledger bills observed time only: a job allocated before its node's first tick would be
            # short of sacct by the gap (a fixed 3-s sleep here once let jobs start 2 s before gpu02's
            # first tick); ticks lie on a whole-second grid, so one read now is at or before any later start
            wait_for_topic(s, s.topics.gpu_samples, lambda recs: set(NODES) <= {k.decode() for _, k, _ in recs if k},
                           "GPU tick from every node")

            say("phase A: completed, exit 3, cancelled, hung, array, multi-node, requeue")
            ok = cluster.submit("-A", "teama", "--gres=gpu:2", "--wrap", "sleep 15")
            fail = cluster.submit("-A", "teamb", "--gres=gpu:1", "--wrap", "sleep 8; exit 3")
            cancel = cluster.submit("-A", "teamc", "--gres=gpu:2", "--wrap", "sleep 60")
            hung = cluster.submit("-A", "teama", "--gres=gpu:1", "--wrap", "sleep 12", load=0)
            array = cluster.submit("-A", "teamb", "--array=0-2", "--gres=gpu:1", "--wrap", "sleep 10")
            multi = cluster.submit("-A", "teamc", "-N", "2", "--gres=gpu:4", "--wrap", "srun sleep 15")
            requeue = cluster.submit("-A", "teama", "--gres=gpu:2", "--wrap", "sleep 10")
            cluster.wait(requeue, {"RUNNING"})
            time.sleep(3)
            sh("scontrol", "requeue", requeue)
            cluster.wait(requeue, {"PENDING"}, restarts=1)
            cluster.wait(cancel, {"RUNNING"})
            time.sleep(2)

            say("the Slurm agent is killed (SIGKILL) and restarted")
            agent.proc.kill()
            agent.proc.wait()
            time.sleep(3)  # events happen while it is down
            sh("scancel", cancel)
            time.sleep(1)
            agent = child("slurm-agent-2", *agent_args)

            time.sleep(3)
            # no job may start in the restart's wake: Slurm 22.05 leaks a node's GPUs (GresUsed stays
            # 2 on an idle node; seen in CI, phase B's 32-GPU job then pends for ever) when a job is
            # allocated on a node right after the restart while one that ended during the downtime
            # is settled there. The requeued job is the one pending job: it runs again first.
            cluster.wait(requeue, {"RUNNING"}, restarts=1, timeout=60)
            say("slurmctld is restarted (state kept)")
            cluster.script("restart-ctld", timeout=60)

            for job in (ok, fail, cancel, hung, multi, requeue, f"{array}_0", f"{array}_1", f"{array}_2"):
                cluster.wait(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120)

            say("parts of GPUs: two jobs on shards (2 and 1 of a GPU's 4) and two on CUDA MPS (50 and 25 of its "
                "100); Slurm puts each pair on one GPU")
            half = cluster.submit("-A", "teama", "--gres=shard:2", "--wrap", "sleep 10")
            quarter = cluster.submit("-A", "teamb", "--gres=shard:1", "--wrap", "sleep 10")
            mps_half = cluster.submit("-A", "teamb", "--gres=mps:50", "--wrap", "sleep 10")
            mps_quarter = cluster.submit("-A", "teama", "--gres=mps:25", "--wrap", "sleep 10")
            pairs = {"shard": (half, quarter), "mps": (mps_half, mps_quarter)}
            held = {kind: [(j["nodes"], j["gres_detail"]) for j in (cluster.wait(job, {"RUNNING"}) for job in jobs)]
                    for kind, jobs in pairs.items()}
            say(f"jobs on parts hold {held}")
            for job in (half, quarter, mps_half, mps_quarter):
                cluster.wait(job, {"COMPLETED"}, timeout=120)

            cluster.wait_all_gpus_free()
            say("phase B: a whole-cluster batch job, a job pending for GPUs, a preemption by prod")
            victim = cluster.submit("-A", "teama", "-N", "4", "--gres=gpu:8", "--wrap", "sleep 15")
            cluster.wait(victim, {"RUNNING"})
            waiter = cluster.submit("-A", "teamb", "--gres=gpu:4", "--wrap", "sleep 8")
            cluster.wait(waiter, {"PENDING"})
            # the agent must see it wait for GPUs (the reason the scheduler gives it) before the preemption
            # frees some: a fixed 3-s sleep lost that race once, on Slurm 23.11 beside a CI run (a reason-less
            # `queued` only, then its allocation 3.7 s after its submission)
            wait_for_topic(s, s.topics.job_events,
                           lambda recs: any(m.get("job_id") == waiter and m.get("kind") == "queued"
                                            and m.get("reason") in ("Resources", "Priority") for _, m in lifecycle(recs)),
                           f"job {waiter} queued for GPUs", timeout_s=60)
            urgent = cluster.submit("-p", "prod", "-A", "teamc", "--gres=gpu:8", "--wrap", "sleep 10")
            cluster.wait(victim, {"PENDING"}, restarts=1, timeout=60)
            for job in (urgent, waiter):
                cluster.wait(job, {"COMPLETED"}, timeout=120)
            cluster.wait(victim, {"COMPLETED"}, restarts=1, timeout=120)

            say("a job on part of a node starts and ends between two polls (the agent paused): its GPUs come from "
                "the record PrologSlurmctld wrote at its allocation")
            # and one the agent has seen pending (held) that starts and is requeued meanwhile: its first attempt's
            # GPUs from its record too
            flash = cluster.submit("-A", "teamb", "--hold", "--gres=gpu:2", "--wrap", "sleep 5")
            # and one seen running that is suspended and resumed meanwhile: told by Slurm's pre_sus_time
            napper = cluster.submit("-A", "teamc", "--gres=gpu:1", "--wrap", "sleep 20")
            # and one seen running that is suspended and cancelled meanwhile: Slurm ends it at the suspend
            snoozer = cluster.submit("-A", "teamb", "--gres=gpu:1", "--wrap", "sleep 60")
            # and, after the pause, one seen suspended, then cancelled: Slurm ends it at the suspend, a time the
            # agent's watermark has passed; the ledger holds it until that watermark
            dozer = cluster.submit("-A", "teama", "--gres=gpu:1", "--wrap", "sleep 60")
            for job in (napper, snoozer, dozer):
                cluster.wait(job, {"RUNNING"})
            wait_for_topic(s, s.topics.job_events,
                           lambda recs: {(m.get("job_id"), m.get("kind")) for _, m in lifecycle(recs)}
                           >= {(flash, "submitted"), (napper, "allocated"), (snoozer, "allocated"), (dozer, "allocated")},
                           f"job {flash} seen pending, {napper}, {snoozer} and {dozer} running")
            # and one no poll saw before its requeue (submitted, started and requeued meanwhile): first seen at restart
            # count 1, its first attempt from sacct, its GPUs from its record
            agent.proc.send_signal(signal.SIGSTOP)
            try:
                brief = cluster.submit("-A", "teamc", "--gres=gpu:3", "--wrap", "sleep 4")
                fresh = cluster.submit("-A", "teama", "--gres=gpu:2", "--wrap", "sleep 5")
                sh("scontrol", "release", flash)
                for job in (flash, fresh):
                    cluster.wait(job, {"RUNNING"})
                time.sleep(1)
                for job in (flash, fresh):
                    sh("scontrol", "requeue", job)
                for job in (flash, fresh):
                    cluster.wait(job, {"PENDING"}, restarts=1)
                sh("scontrol", "suspend", napper)
                sh("scontrol", "suspend", snoozer)
                time.sleep(4)
                sh("scontrol", "resume", napper)
                sh("scancel", snoozer)
                cluster.wait(brief, {"COMPLETED"}, timeout=60)
            finally:
                agent.proc.send_signal(signal.SIGCONT)
            sh("scontrol", "suspend", dozer)
            dozer_suspended = time.time()
            wait_for_topic(s, s.topics.job_events,
                           lambda recs: any(m.get("job_id") == dozer and m.get("kind") == "interrupted"
                                            for _, m in lifecycle(recs)), f"job {dozer} seen suspended")
            time.sleep(3)
            sh("scancel", dozer)
            dozer_cancelled = time.time()
            cluster.wait(snoozer, {"CANCELLED"}, timeout=60)
            cluster.wait(dozer, {"CANCELLED"}, timeout=60)
            for job in (flash, fresh):
                cluster.wait(job, {"COMPLETED"}, restarts=1, timeout=120)
            cluster.wait(napper, {"COMPLETED"}, timeout=120)

            say(f"phase C: a job leaves squeue (MinJobAge {MIN_JOB_AGE_S} s) while the Slurm agent is down")
            gone = cluster.submit("-A", "teamb", "--gres=gpu:2", "--wrap", "sleep 6")
            cluster.wait(gone, {"RUNNING"})
            wait_for_topic(s, s.topics.job_events,  # the agent saw it running, with its GPUs
                           lambda recs: any(m.get("job_id") == gone and m.get("kind") == "allocated"
                                            for _, m in lifecycle(recs)),
                           f"allocation event of job {gone}")
            agent.stop()
            # and one that no poll sees at all: submitted, run and purged while the agent is stopped
            unseen = cluster.submit("-A", "teama", "--gres=gpu:2", "--wrap", "sleep 4")
            cluster.wait(unseen, {"COMPLETED"}, timeout=60)
            deadline = time.monotonic() + 180  # slurmctld purges old jobs about once a minute
            while {gone, unseen} & set(cluster.jobs()) and time.monotonic() < deadline:
                time.sleep(1)
            assert not {gone, unseen} & set(cluster.jobs()), f"job {gone} or {unseen} still in squeue"
            metrics_port = free_port()
            agent = child("slurm-agent-3", *agent_args, "--metrics-port", str(metrics_port))  # closes it from sacct
            time.sleep(3)

            # sacct has every end, and the watermark has passed the last of them
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                acct = sacct_attempts()
                if all(r["end"] not in ("Unknown", "") for rows in acct.values() for r in rows):
                    break
                time.sleep(1)
            # GPU agents first; then the Slurm agent's watermark passes their last tick (the worker
            # holds a tick back until the lifecycle watermark reaches its end)
            for p in procs:
                if p.args[:2] == ("agent", "gpu"):
                    p.stop()
            ticks_end_ms = int(time.time() * 1000)
            wait_for_topic(s, s.topics.job_events,  # watermarks go to every partition
                           lambda recs: {p for p, m in lifecycle(recs) if m.get("type") == "watermark"
                                         and m["ts_ms"] >= ticks_end_ms} >= set(range(s.partitions_job_events)),
                           "lifecycle watermark past the GPU agents' last tick on every partition")
            families = scrape(metrics_port)  # the agent's own view, as Prometheus would scrape it
            own = {"agent": "slurm", "cluster": CLUSTER}
            assert sample(families, "gpuledger_scheduler_watermark_timestamp_seconds", **own) >= ticks_end_ms / 1000
            assert sample(families, "gpuledger_scheduler_polls_total", **own) >= 1
            assert sample(families, "gpuledger_scheduler_state_bytes_written_total", **own) > 0  # saved each poll
            assert sample(families, "gpuledger_scheduler_events_published_total", **own) >= 1  # gone's end, at least
            assert sample(families, "gpuledger_scheduler_gpus_held_by_no_job", **own) == 0  # real gres_used read
            assert sample(families, "gpuledger_agent_spool_records", node=f"slurm-agent-{CLUSTER}") >= 0  # wired
            agent.stop()
            t = s.topics
            say("waiting for the worker and the sink")
            wait_until_caught_up(s, s.worker_app_id, [t.gpu_samples, t.job_events, t.node_allocations],
                                 alive=worker, timeout_s=180)
            from gpuledger.sink.loop import sink_topics
            wait_until_caught_up(s, f"{s.worker_app_id}-sink", sink_topics(s), alive=sink, timeout_s=180)
        finally:
            for p in reversed(procs):
                p.stop()

    ledger = read_ledger(tmp_path / "chdb")
    acct = sacct_attempts()
    names = {ok: "completed", fail: "exit 3", cancel: "cancelled", hung: "hung (0% load)", multi: "multi-node",
             requeue: "admin requeue", f"{array}_0": "array task", f"{array}_1": "array task",
             f"{array}_2": "array task", victim: "preempted, rerun", waiter: "pending for GPUs",
             urgent: "prod (preempts)", gone: "left squeue, agent down", half: "2 of a GPU's 4 shards",
             quarter: "1 of a GPU's 4 shards", mps_half: "50 of a GPU's 100 MPS", mps_quarter: "25 of a GPU's 100 MPS",
             brief: "between polls, part of a node", flash: "requeued between polls", unseen: "came and went, agent down",
             fresh: "submitted, run, requeued between polls", napper: "suspended, resumed between polls",
             snoozer: "suspended, cancelled between polls", dozer: "seen suspended, then cancelled"}
    usage = {(r[0], r[1]): r for r in ledger["usage"]}
    views = {(r[0], r[1]): r for r in ledger["attempts"]}
    events: dict[str, list] = {}
    for e in ledger["events"]:
        events.setdefault(e[0], []).append(e)

    outcome_of = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled",
                  "PREEMPTED": "preempted", "REQUEUED": "preempted"}
    rows, problems = [], []
    for job, label in names.items():
        for attempt, a in enumerate(acct.get(job, [])):
            sacct_gpu_s = a["gpus"] * (a["elapsed_s"] + a["suspended_s"])
            u = usage.get((job, attempt))
            ledger_gpu_s = (u[2] / 1000) if u else 0.0
            exec_s = (u[3] / 1000) if u else 0.0
            ends = [e for e in events.get(job, []) if e[1] == attempt and e[2] in
                    ("completed", "failed", "cancelled", "preempted")]
            outcome = ends[-1][2] if ends else "-"
            reason = (ends[-1][3] or "") if ends else ""
            tenant = {e[4] for e in events.get(job, [])}
            queue = {e[5] for e in events.get(job, [])}
            rows.append((job, label, attempt, a["state"], a["partition"], a["account"], a["gpus"], a["elapsed_s"],
                         a["suspended_s"], sacct_gpu_s, ledger_gpu_s, exec_s, outcome, reason))
            # jobs on parts of one GPU (shards, MPS) split its held part by measured use (docs/accounting.md §5, the
            # default `measured` split), not by their shards: their sum is compared below
            # the job cancelled while seen suspended holds its GPU past sacct's End (compared below)
            if job not in (half, quarter, mps_half, mps_quarter, dozer) \
                    and abs(ledger_gpu_s - sacct_gpu_s) > POLL_S * a["gpus"] + 1e-9:
                problems.append(f"{job}#{attempt}: ledger {ledger_gpu_s} GPU-s, sacct {sacct_gpu_s}")
            if outcome != outcome_of.get(a["state"], "?"):
                problems.append(f"{job}#{attempt}: outcome {outcome}, sacct {a['state']}")
            view = views.get((job, attempt))
            if view is None or (view[2], view[3], view[4]) != (outcome, a["account"], a["partition"]):
                problems.append(f"{job}#{attempt}: job_attempts view says {view}")
            if tenant != {a["account"]} or (a["partition"] not in queue):
                problems.append(f"{job}#{attempt}: tenant {tenant} queue {queue}, sacct {a['account']} {a['partition']}")
        attempts = {e[1] for e in events.get(job, [])}
        if attempts != set(range(len(acct.get(job, [])))):
            problems.append(f"{job}: ledger attempts {sorted(attempts)}, sacct {len(acct.get(job, []))}")

    header = ("job", "what", "att", "sacct state", "partition", "account", "GPUs", "elapsed s", "suspended s", "sacct GPU-s",
              "ledger GPU-s", "executing GPU-s", "ledger outcome", "reason")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    table = ["| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |" for r in (header, *rows)]
    table.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print("\n" + "\n".join(table))
    say(f"usage rows {ledger['rows']} (unique ids {ledger['ids']}), job events {len(ledger['events'])}, "
        f"snapshots {ledger['snapshots']} (per queue: quota, max allocated, max pending {ledger['queues']}), preemptions {ledger['preemptions']}; {time.monotonic() - started:.0f}s")
    (ROOT / "build" / "slurm-check-table.md").write_text("\n".join(table) + "\n")

    # the story happened as planned (a Slurm hiccup would make the comparison above pass on a different story)
    expected = {ok: ["COMPLETED"], fail: ["FAILED"], cancel: ["CANCELLED"], hung: ["COMPLETED"], multi: ["COMPLETED"],
                requeue: ["REQUEUED", "COMPLETED"], victim: ["PREEMPTED", "COMPLETED"], waiter: ["COMPLETED"],
                urgent: ["COMPLETED"], gone: ["COMPLETED"], half: ["COMPLETED"], quarter: ["COMPLETED"],
                mps_half: ["COMPLETED"], mps_quarter: ["COMPLETED"], brief: ["COMPLETED"], unseen: ["COMPLETED"],
                flash: ["REQUEUED", "COMPLETED"], fresh: ["REQUEUED", "COMPLETED"], napper: ["COMPLETED"],
                snoozer: ["CANCELLED"], dozer: ["CANCELLED"],
                **{f"{array}_{i}": ["COMPLETED"] for i in range(3)}}
    assert {j: [a["state"] for a in acct.get(j, [])] for j in expected} == expected
    # the job no poll saw running got the GPUs its PrologSlurmctld record names (without it: none, part of a node)
    assert any("recorded at its allocation by PrologSlurmctld" in (e[3] or "") for e in events[brief]
               if e[2] == "allocated"), events[brief]
    assert any("started and requeued between two polls" in (e[3] or "") for e in events[flash]
               if e[2] == "allocated" and e[1] == 0), events[flash]
    # the job first seen at restart count 1: its first attempt from sacct (or, without its row yet, the requeue time
    # from squeue), its GPUs from its record
    assert any("PrologSlurmctld" in (e[3] or "") for e in events[fresh] if e[2] == "allocated" and e[1] == 0), events[fresh]
    # the job suspended and resumed while the agent was paused: told from pre_sus_time, its suspended time idle (the
    # simulated GPUs stay busy), its executing time sacct's Elapsed (which leaves the suspended time out)
    nap = acct[napper][0]
    assert nap["suspended_s"] >= 3, nap
    assert [e[2] for e in events[napper] if "between two polls" in (e[3] or "")] == ["interrupted", "started"], events[napper]
    assert abs(usage[(napper, 0)][3] / 1000 - nap["gpus"] * nap["elapsed_s"]) <= 2 * POLL_S, (usage[(napper, 0)], nap)
    # the jobs cancelled while suspended: Slurm ends each at its suspend (End = the suspend, Suspended 0). The one no
    # poll saw suspended ends there in the ledger too (checked with the others above), nothing told idle; the one seen
    # suspended holds its GPU, idle, from the suspend up to the agent's watermark, never past the cancel
    assert [e[2] for e in events[snoozer] if e[2] in ("interrupted", "started", "cancelled")] == ["started", "cancelled"], \
        events[snoozer]
    doze = acct[dozer][0]
    assert doze["suspended_s"] == 0, doze
    assert any("ended while suspended" in (e[3] or "") for e in events[dozer] if e[2] == "cancelled"), events[dozer]
    held_s, doze_exec_s = usage[(dozer, 0)][2] / 1000, usage[(dozer, 0)][3] / 1000
    assert doze["elapsed_s"] + 1 <= held_s <= doze["elapsed_s"] + (dozer_cancelled - dozer_suspended) + POLL_S, \
        (usage[(dozer, 0)], doze, dozer_cancelled - dozer_suspended)
    assert abs(doze_exec_s - doze["elapsed_s"]) <= 2 * POLL_S, (usage[(dozer, 0)], doze)
    # the job that came and went while the agent was down was recovered from sacct, its GPUs from its record
    assert [e[3] for e in events[unseen] if e[2] == "submitted"] == ["from sacct: the job came and went while no poll ran"]
    assert any("PrologSlurmctld" in (e[3] or "") for e in events[unseen] if e[2] == "allocated"), events[unseen]
    # the job that left squeue while the agent was down was closed from sacct
    assert any("from sacct" in (e[3] or "") for e in events[gone] if e[2] == "completed"), events[gone]
    waited = [e for e in events[waiter] if e[2] == "queued"]
    assert any(e[3] in ("Resources", "Priority") for e in waited), events[waiter]
    # snapshots: partitions as queues, 32 GPUs each (they share the nodes), the whole cluster allocated
    # once, and the waiting job seen pending
    queues = {q[0]: q[1:] for q in ledger["queues"]}
    assert queues["batch"][0] == 32 and queues["prod"][0] == 32
    assert queues["batch"][1] == 32 and queues["batch"][2] >= 1, queues
    event_ids = [e[6] for e in ledger["events"]]
    assert len(event_ids) == len(set(event_ids)), "an event reached the ledger twice"
    assert ledger["rows"] == ledger["ids"], "a usage record reached the ledger twice"
    assert [victim, urgent] in [list(p) for p in ledger["preemptions"]], ledger["preemptions"]
    # the fake GPUs' load reaches the ledger: the busy job executed all along; the hung one (0 % load)
    # only for the first MIN_IDLE_S seconds (the definition's grace for a short stall), then idle
    assert usage[(ok, 0)][3] == usage[(ok, 0)][2]
    hung_exec_s = usage[(hung, 0)][3] / 1000
    assert hung_exec_s <= MIN_IDLE_S + 2 * POLL_S, f"hung job executing {hung_exec_s} GPU-s"
    # the jobs on shards and on MPS held parts (not whole GPUs), and each pair was billed, together, the parts of
    # GPUs it held (on one GPU, as here, each its measured use and a share of the rest; alone, its share)
    for kind, jobs in pairs.items():
        assert [acct[j][0]["gpus"] for j in jobs] == [0.5, 0.25], (kind, [acct.get(j) for j in jobs])
        assert all(len(d) == 1 and d[0].startswith(f"{kind}:") for _, d in held[kind]), held
        sacct_shared = sum(acct[j][0]["gpus"] * acct[j][0]["elapsed_s"] for j in jobs)
        ledger_shared = sum(usage[(j, 0)][2] / 1000 if (j, 0) in usage else 0.0 for j in jobs)
        assert abs(ledger_shared - sacct_shared) <= POLL_S * 0.75 + 1e-9, (kind, ledger_shared, sacct_shared)
        assert all(usage[(j, 0)][2] > 0 for j in jobs), kind
    # each job's GPUs asked for, in its events (queue wait GPU-hours): sacct's, shards as parts of a GPU
    asked = {j: max(e[7] for e in events.get(j, [(0,) * 8])) for j in names}
    assert asked == {j: acct[j][0]["gpus"] for j in names}, asked
    assert not problems, "\n".join(problems)
