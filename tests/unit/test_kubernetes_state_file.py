"""The Kubernetes agent's state file: a whole copy plus a journal of what changed (StateFile)."""

from __future__ import annotations

import random
import shutil

import orjson

from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping, JobTrack, PodTrack
from gpuledger.agents.kubernetes_agent import StateFile, load_state


def core_with(pods: int) -> KubernetesLedger:
    core = KubernetesLedger(KubernetesMapping(cluster="k8s"))
    for i in range(pods):
        add_pod(core, i)
    return core


def add_pod(core: KubernetesLedger, i: int) -> None:
    job_id = f"team/job/train-{i}"
    uid = f"uid-{i}"
    core.jobs[job_id] = JobTrack(job_id=job_id, tenant="team", queue="default", attempt=1, live=[uid])
    core.pods[uid] = PodTrack(uid=uid, namespace="team", name=f"train-{i}-0", job_id=job_id, attempt=1,
                              node=f"node-{i}", allocated=True,
                              gpus=[[f"node-{i}", f"GPU-{i:04d}-{g}", g, 1.0, "main", None] for g in range(8)])


def saved(core: KubernetesLedger) -> dict:
    return orjson.loads(core.state_bytes())


def test_changes_go_to_the_journal_and_a_restart_reads_them_back(tmp_path):
    path = tmp_path / "state.json"
    core, rng = core_with(50), random.Random(7)
    files = StateFile(path)
    files.save(core)
    assert files.whole_writes == 1 and load_state(path) == saved(core)
    whole_size = path.stat().st_size
    for step in range(200):
        pick = rng.random()
        if pick < 0.4:
            rng.choice(list(core.pods.values())).started ^= True
        elif pick < 0.6:
            add_pod(core, 1000 + step)
        elif pick < 0.8 and core.pods:
            uid = rng.choice(sorted(core.pods))
            del core.jobs[core.pods.pop(uid).job_id]
        else:
            core.local_queues[f"team/q{rng.randrange(3)}"] = rng.choice(["gold", "silver"])
        core.watermark_ms += 1000
        size_before = files.journal_path.stat().st_size
        files.save(core)
        assert files.journal_path.stat().st_size - size_before < whole_size / 10   # what changed, not the whole
        assert load_state(path) == saved(core), step
    assert files.whole_writes == 1 and files.journal_lines == 200
    assert files.bytes_written == whole_size + files.journal_path.stat().st_size  # the metric's figure
    assert KubernetesLedger(core.mapping, load_state(path)).state_bytes() == core.state_bytes()


def test_a_quiet_cycle_adds_only_the_watermark(tmp_path):
    path = tmp_path / "state.json"
    core, files = core_with(3), StateFile(tmp_path / "state.json")
    files.save(core)
    before = files.journal_path.stat().st_size
    files.save_watermark(9_000)
    assert files.journal_path.stat().st_size - before < 80
    assert load_state(path) == {**saved(core), "watermark_ms": 9_000}


def test_the_whole_state_is_rewritten_once_the_journal_outgrows_it(tmp_path):
    path = tmp_path / "state.json"
    core, files = core_with(4), StateFile(path)
    files.JOURNAL_MIN_BYTES = 0
    files.save(core)
    for step in range(60):
        core.pods["uid-0"].started ^= True
        core.watermark_ms += 1
        files.save(core)
        assert files.journal_path.stat().st_size <= 2 * path.stat().st_size
        assert load_state(path) == saved(core)
    assert files.whole_writes > 2


def test_a_journal_left_from_before_a_rewrite_is_not_read(tmp_path):
    """A crash between the whole state's rename and the journal's truncation leaves the old lines."""
    path = tmp_path / "state.json"
    core = core_with(3)
    files = StateFile(path)
    files.save(core)
    core.pods["uid-1"].started = True
    files.save(core)
    old_journal = tmp_path / "old-journal"
    shutil.copy(files.journal_path, old_journal)
    core.pods["uid-1"].started = False           # changed back, then the whole state is written
    files.save(core, whole=True)
    shutil.copy(old_journal, files.journal_path)  # as if the truncation never happened
    assert load_state(path)["pods"]["uid-1"]["started"] is False


def test_a_line_cut_short_by_a_crash_is_dropped(tmp_path):
    path = tmp_path / "state.json"
    core, files = core_with(2), StateFile(path)
    files.save(core)
    core.watermark_ms = 5_000
    files.save(core)
    with open(files.journal_path, "ab") as f:
        f.write(b'{"generation":"x","watermark_ms":9')   # never fsynced, never acknowledged
    assert load_state(path)["watermark_ms"] == 5_000
    StateFile(path).save(core)                   # the restarted agent's first save starts afresh
    assert files.journal_path.stat().st_size == 0 and load_state(path) == saved(core)


def test_the_watermark_side_file_of_an_older_agent_is_read_then_retired(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(orjson.dumps({"version": 1, "watermark_ms": 5, "pods": {}, "jobs": {}, "local_queues": {}}))
    side = tmp_path / "state.json.watermark"
    side.write_text("9")
    assert load_state(path)["watermark_ms"] == 9
    core = KubernetesLedger(KubernetesMapping(cluster="k8s"), load_state(path))
    StateFile(path).save(core)
    assert not side.exists() and load_state(path)["watermark_ms"] == 9
    path.unlink()
    side.write_text("11")
    assert load_state(path)["watermark_ms"] == 11 and load_state(tmp_path / "none.json") is None


class _Devices:
    """Every pod's container has one GPU of its own (the PodResources edge is tested elsewhere)."""

    def begin_cycle(self) -> None:
        pass

    def lookup(self, node, namespace, name, host_ip):
        return {"nginx": [f"GPU-{name}"]}


def test_what_a_crash_after_any_cycle_leaves_is_the_agents_state(tmp_path):
    """The agent's own cycles over pods that come, run, end and go, never shut down: after every
    cycle the files hold exactly the core's state, from one whole write and the journal."""
    from gpuledger.agents.kubernetes_agent import KubernetesAgent
    from gpuledger.agents.publisher import ListPublisher
    from kube.objects import gpu_pod, ms

    path, now = tmp_path / "state.json", [ms(0) / 1000]
    agent = KubernetesAgent(KubernetesLedger(KubernetesMapping(cluster="k8s", allowed_lateness_ms=5_000)),
                            ListPublisher(), job_events_topic="e", snapshots_topic="s", job_event_partitions=2,
                            devices=_Devices(), state_path=path, clock=lambda: now[0])
    agent.kinds = ["pod"]

    def pod(i: int, stage: str) -> dict:
        return gpu_pod(f"p{i}-0", f"uid-{i}", job=f"j{i}", stage=stage, created=10 * i, started=10 * i + 4,
                       finished=10 * i + 60)

    agent._handle(("sync", "pod", [pod(i, "pending") for i in range(6)], now[0]))
    steps = [(i, change, stage) for i in range(6)
             for change, stage in (("MODIFIED", "scheduled"), ("MODIFIED", "running"), ("MODIFIED", "succeeded"),
                                   ("DELETED", "succeeded"))]
    random.Random(3).shuffle(steps)
    steps.sort(key=lambda s: ["scheduled", "running", "succeeded"].index(s[2]) + (s[1] == "DELETED"))
    for k in range(len(steps) + 1):
        now[0] += 2
        agent.cycle()
        assert load_state(path) == saved(agent.core), k
        if k < len(steps):
            i, change, stage = steps[k]
            agent._handle(("event", "pod", change, pod(i, stage), now[0]))
    assert agent.state_file.whole_writes == 1 and agent.state_file.journal_lines == len(steps)
    assert not agent.core.pods and agent.published_events >= 6 * 4
