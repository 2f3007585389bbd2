"""job_cost as sql/0031 defines it (each side LEFT JOINed to the jobs both sides know, so a filter on
cluster or job_id reaches the tables) against 0015's definition (FULL OUTER JOIN of the two sides) on
random jobs: several clusters sharing job ids, jobs with usage under one or two definition versions,
jobs with attempts but no usage yet, usage with no attempt events, attempts with no tenant or queue,
failed and retried attempts, queue waits. Same columns, types and rows; a job read alone equals its
rows in the whole view. Then sql/0038's (the attempt-side columns on one row per job): the same
rows, those columns equal to 0031's on one row of each job and 0 on its other rows."""

from __future__ import annotations

import datetime as dt
import math
import random

import pytest
from warehouse_helpers import warehouse_before

from gpuledger.warehouse.migrations import load_migrations, migrate

pytestmark = pytest.mark.integration

DB = "job_cost_view"
T0 = int(dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc).timestamp() * 1000)
HOUR = 3_600_000
#: attempts, failed_attempts, queue_wait_seconds, queue_wait_gpu_hours: on one row per job since sql/0038
ATTEMPT_SIDE = (5, 6, 18, 19)
USAGE_COLS = ["schema_version", "record_id", "cluster", "node", "gpu_uuid", "gpu_model", "start_ms", "end_ms",
              "state", "job_id", "attempt", "tenant", "queue", "share_milli", "gpu_ms", "util_pct", "energy_j",
              "coefficient", "coefficient_version", "effective_gpu_ms", "cost_micros", "definition_version",
              "kafka_topic", "kafka_partition", "kafka_offset"]
EVENT_COLS = ["schema_version", "event_id", "ts_ms", "kind", "cluster", "job_id", "attempt", "tenant", "queue",
              "priority", "requested_gpus", "gpu_nodes", "gpu_uuids", "gpu_share_milli", "gpu_container_ids",
              "aliases", "reason", "kafka_topic", "kafka_partition", "kafka_offset"]


def write_jobs(client, seed: int) -> None:
    rnd = random.Random(seed)
    usage, events = [], []
    for n in range(60):
        cluster, job = rnd.choice(["c1", "c2"]), f"job-{rnd.randrange(40)}"  # the same id in both clusters
        tenant, queue = rnd.choice(["t1", "t2", ""]), rnd.choice(["q1", "q2", ""])
        attempts = rnd.randint(1, 3)
        has_events, has_usage = rnd.random() < 0.8, rnd.random() < 0.8
        for attempt in range(attempts):
            start = T0 + rnd.randrange(5 * 24) * HOUR
            if has_events:
                gpus = float(rnd.choice([1, 2, 8]))
                queued = start - rnd.randrange(0, 2 * HOUR)
                kinds = [("submitted", queued), ("allocated", start), ("started", start + 1000)]
                kinds.append((rnd.choice(["completed", "failed", "failed", "preempted"]), start + 3 * HOUR))
                for i, (kind, ts) in enumerate(kinds[: rnd.randint(1, 4)]):  # some attempts still running
                    events.append([1, f"e{n}-{attempt}-{i}", ts, kind, cluster, job, attempt, tenant, queue, 0, gpus,
                                   [], [], [], [], {}, "", "jobs", 0, len(events)])
            if has_usage:
                for h in range(rnd.randint(1, 30)):  # some stretches cross midnight
                    ms = rnd.choice([HOUR, HOUR // 2])
                    state = rnd.choice(["executing", "executing", "allocated_idle", "unallocated"])
                    usage.append([1, f"{n}/{attempt}/{h}", cluster, "n1", f"gpu-{n % 7}", "A100", start + h * HOUR,
                                  start + h * HOUR + ms, state, job if state != "unallocated" else "", attempt,
                                  rnd.choice(["t1", "t3"]), rnd.choice(["q1", "q3"]), 1000, ms, None,
                                  rnd.uniform(0, 5e5), 1.0, "v", ms, ms // 7, rnd.choice(["d1", "d1", "d2"]),
                                  "usage", 0, len(usage)])
    for i in range(0, len(usage), 53):  # several blocks: the aggregates merge partial states
        client.insert("usage_raw", usage[i:i + 53], column_names=USAGE_COLS, database=DB)
    client.insert("job_events", events, column_names=EVENT_COLS, database=DB)


def same(a: list[tuple], b: list[tuple]) -> bool:
    """Equal rows; floats (energy sums, whose order of addition the engine chooses) to 1e-12."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all(math.isclose(u, v, rel_tol=1e-12) if isinstance(u, float) else u == v
                                 for u, v in zip(x, y)) for x, y in zip(a, b))


def rows(client, where: str = "1", params: dict | None = None) -> list[tuple]:
    return client.query(f"SELECT * FROM job_cost WHERE {where} ORDER BY cluster, job_id, definition_version",
                        parameters=params or {}).result_rows


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_job_cost_per_job_equals_the_full_join_view(seed):
    client = warehouse_before("0031", DB, prefix="job-cost-view-")  # job_cost as 0015 defines it
    try:
        write_jobs(client, seed)
        old_rows = rows(client)
        old_columns = client.query("DESCRIBE TABLE job_cost").result_rows
        for statement in next(mg for mg in load_migrations() if mg.version == "0031").statements():
            client.command(statement)  # 0031 alone: the same rows as 0015's
        assert client.query("DESCRIBE TABLE job_cost").result_rows == old_columns
        assert same(rows(client), old_rows)
        assert {"0031", "0038"} <= set(migrate(client, DB))
        assert client.query("DESCRIBE TABLE job_cost").result_rows == old_columns
        new_rows = rows(client)
        # 0038: the attempt-side columns on one row of each job (its first version's), 0 on the others
        assert same([tuple(v for i, v in enumerate(r) if i not in ATTEMPT_SIDE) for r in new_rows],
                    [tuple(v for i, v in enumerate(r) if i not in ATTEMPT_SIDE) for r in old_rows])
        carried = {}
        for new, old in zip(new_rows, old_rows):
            if same([tuple(new[i] for i in ATTEMPT_SIDE)], [tuple(old[i] for i in ATTEMPT_SIDE)]):
                carried[(new[0], new[1])] = carried.get((new[0], new[1]), 0) + 1
            else:
                assert all(new[i] == 0 for i in ATTEMPT_SIDE), new
        assert carried == {(r[0], r[1]): 1 for r in new_rows}  # attempts >= 1 on the row that carries them
        # every kind of job is in the data: no usage yet (first_day NULL), no attempt events, two versions
        assert any(r[16] is None for r in new_rows) and any(r[8] == 0 for r in new_rows)
        per_job = {}
        for r in new_rows:
            per_job.setdefault((r[0], r[1]), []).append(r)
        assert any(len(v) > 1 for v in per_job.values())
        for (cluster, job), expected in per_job.items():
            assert same(rows(client, "cluster = {c:String} AND job_id = {j:String}", {"c": cluster, "j": job}), expected)
        ids = sorted({job for _, job in per_job})[:5]
        assert same(rows(client, "job_id IN {ids:Array(String)}", {"ids": ids}), [r for r in new_rows if r[1] in ids])
    finally:
        client.close()
