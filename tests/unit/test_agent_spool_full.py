"""The scheduler agents on a spool whose disk fills up: a message the spool cannot write
(`Spool.append` returns 0) must never be recorded as published by the agent's state file.

The disk fills up for real: a child process runs the agent with RLIMIT_FSIZE set, so the spool's
`os.write` fails with EFBIG part-way through a poll, as it would with ENOSPC; the limit is lifted
later (the disk has room again). No Kafka is needed: what the state file trusts is the spool."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

UNIT = Path(__file__).resolve().parent

#: In the child: a file can grow to `limit` bytes (the state file fits, the spool's segment fills
#: up after a few messages); SIGXFSZ ignored, so the write fails with EFBIG instead of killing it.
DISK = textwrap.dedent("""
    import json, resource, signal, sys
    sys.path[:0] = [{unit!r}, {tests!r}]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _soft, _hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def disk_full(limit):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, _hard))

    def disk_has_room():
        resource.setrlimit(resource.RLIMIT_FSIZE, (_hard, _hard))
""")


def run_child(body: str, tmp_path: Path) -> dict:
    code = DISK.format(unit=str(UNIT), tests=str(UNIT.parent)) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def spooled(directory: Path) -> list[tuple[str, bytes]]:
    """(route key, value) of every record left in a spool directory."""
    from gpuledger.agents.spool import Spool

    with Spool(directory, fsync="never") as spool:
        return [(r.key.decode(), r.value) for r in spool.read(10_000, max_bytes=1 << 30)]


def test_slurm_poll_with_a_full_spool_disk_fails_and_the_next_poll_publishes_its_events(tmp_path: Path) -> None:
    result = run_child(f"""
        from pathlib import Path
        from test_slurm import FakeSlurm, POLL_MS
        from gpuledger.agents.slurm_agent import SlurmAgent, SpoolSink, load_state
        from gpuledger.config import Settings

        tmp = Path({str(tmp_path)!r})
        settings = Settings(kafka_bootstrap="127.0.0.1:9", data_dir=tmp / "data", agent_spool_dir=tmp / "spool",
                            agent_spool_fsync="never", partitions_job_events=3)
        sink = SpoolSink(settings, "c")
        clock = [POLL_MS["running"]]
        agent = SlurmAgent(cluster="c", state_file=tmp / "state.json", sink=sink, partitions=3, run=FakeSlurm(),
                           clock=lambda: clock[0] / 1000)
        disk_full(2500)   # room for the state file (1 kB), not for the poll's 16 messages (6 kB)
        first = agent.poll_once()
        refused = sink.spool.dropped
        saved_after_first = (tmp / "state.json").exists()
        disk_has_room()
        clock[0] += 10_000   # the same Slurm output, 10 s later
        second = agent.poll_once()
        sink.close(timeout=0)
        print(json.dumps({{"first": first, "second": second, "refused": refused, "failures": agent.failures,
                          "saved_after_first": saved_after_first,
                          "watermark_ms": load_state(tmp / "state.json").watermark_ms}}))
    """, tmp_path)
    assert result["refused"] >= 1, "the disk never filled up: the test proves nothing"
    assert result["first"] is False and result["failures"] == 1, "a poll whose messages were not all spooled succeeded"
    assert not result["saved_after_first"], "the state file was saved over messages the spool refused"
    assert result["second"] is True and result["watermark_ms"] == 1796084031_000  # the second poll's

    from gpuledger.agents.slurm import translate, AgentState
    from gpuledger.schemas.models import JobEvent
    from gpuledger.schemas.wire import decode
    from test_slurm import POLL_MS, squeue

    expected = {e.event_id for e in translate(squeue("running"), AgentState(), cluster="c",
                                              poll_started_ms=POLL_MS["running"]).events}
    records = spooled(tmp_path / "spool" / "slurm-agent-c")
    events = [decode(JobEvent, v).event_id for k, v in records if k.startswith("job-events") and not k.endswith("\x1f")]
    assert set(events) == expected and len(expected) == 12, "job events lost for good on a full spool disk"
    marks = [k for k, _ in records if k.startswith("job-events") and k.endswith("\x1f")]
    # the watermarks come only after every event: none was spooled by the failed poll
    assert len(marks) == 3 and max(i for i, (k, _) in enumerate(records) if k in marks) > max(
        i for i, (k, _) in enumerate(records) if not k.endswith("\x1f") and k.startswith("job-events"))
    assert [k for k, _ in records if k.startswith("scheduler-snapshots")] == ["scheduler-snapshots\x1f\x1fc"]


def test_kubernetes_agent_holds_what_a_full_spool_refused_and_saves_no_state_over_it(tmp_path: Path) -> None:
    result = run_child(f"""
        from pathlib import Path
        import orjson
        from kube.objects import ms
        from kube.scenario import train
        from gpuledger.agents.kubernetes import KubernetesLedger, KubernetesMapping
        from gpuledger.agents.kubernetes_agent import (DeviceSource, KubernetesAgent, SpooledRoutes, decode_route,
                                                       load_state)
        from gpuledger.agents.spool import Spool, SpoolingPublisher

        tmp = Path({str(tmp_path)!r})
        mapping = KubernetesMapping(cluster="k8s", devices_expected=False)
        spool = Spool(tmp / "spool", fsync="never")

        def agent_on(state):
            return KubernetesAgent(KubernetesLedger(mapping, state), SpooledRoutes(SpoolingPublisher(spool)),
                                   job_events_topic="je", snapshots_topic="ss", job_event_partitions=2,
                                   devices=DeviceSource(mapping), state_path=tmp / "state.json", snapshots=False,
                                   clock=lambda: ms(10) / 1000)

        agent = agent_on(None)
        agent.kinds = ["pod"]
        for _ in range(8):  # the segment is larger than the state file will be: the spool fills up first
            spool.append(b"x" * 400, b"filler")
        disk_full(spool.bytes + 500)   # room for the first event, not for the next ones
        agent._handle(("sync", "pod", [train("running", "103")], ms(10) / 1000))
        agent.cycle()
        agent.cycle()
        refused, held = spool.dropped, agent._held()
        saved_while_full = (tmp / "state.json").exists()
        disk_has_room()
        agent.cycle()
        held_after = agent._held()
        # the agent stops; a new one starts on the state file and lists the same pod again
        agent = agent_on(load_state(tmp / "state.json"))
        agent.kinds = ["pod"]
        agent._handle(("sync", "pod", [train("running", "103")], ms(20) / 1000))
        agent.cycle()
        records = spool.read(1000)
        spool.close()
        routed = [(decode_route(r.key), orjson.loads(r.value)) for r in records if r.key != b"filler"]
        print(json.dumps({{"refused": refused, "held": held, "held_after": held_after,
                          "saved_while_full": saved_while_full,
                          "events": [v["event_id"] for (t, k, p), v in routed if k is not None],
                          "first_mark_at": next((i for i, ((t, k, p), v) in enumerate(routed) if k is None), None)}}))
    """, tmp_path)
    assert result["refused"] >= 1, "the disk never filled up: the test proves nothing"
    assert not result["saved_while_full"], "the state file was saved over events the spool refused"
    assert result["held"] >= 2 and result["held_after"] == 0
    events = result["events"]
    kinds = [e.rsplit("/", 1)[-1].split(".")[0] for e in events]  # ids end "<kind>[.<digest>]"
    assert len(events) == len(set(events)) == 3 and sorted(kinds) == ["allocated", "started", "submitted"], \
        f"events lost on a full spool disk: {events}"
    assert result["first_mark_at"] == 3  # the watermark comes after every event
