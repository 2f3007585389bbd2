"""A progress report sent twice (the same report at a new offset: a client's retry, a replay) through the
real sink (Tansu, run_sink, chDB): job_progress keeps both copies (another offset, another block, so the
insert-deduplication token cannot catch it), and the views built on it count the report once
(sql/0047: a report is its (cluster, job, attempt, time, step)). Before, job_training_signals and
job_rank_step_times counted every copy. The golden pilot of test_golden_estimate.py: reports at 1..6
minutes, steps 0..500, ranks 0 and 1, 2 GPUs x 10 minutes of usage."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from gpuledger import warehouse
from gpuledger.schemas.models import UsageBatch
from gpuledger.schemas.wire import encode
from gpuledger.topics import create_topics
from test_golden_estimate import progress, usage
from warehouse_helpers import run_until_caught_up

pytestmark = pytest.mark.integration


def figures(settings) -> dict:
    client = warehouse.connect(settings)
    db = settings.database

    def one(sql: str):
        return client.query(sql.format(db=db)).result_rows[0]

    try:
        return {
            "stored": one("SELECT count() FROM {db}.job_progress")[0],
            "signals": one("SELECT reports, steps, round(span_cost, 6), round(span_gpu_hours, 6) "
                           "FROM {db}.job_training_signals WHERE job_id = 'pilot-1'"),
            "rank_reports": one("SELECT groupArray(reports) FROM "
                                "(SELECT reports FROM {db}.job_rank_step_times ORDER BY rank)")[0],
            "window_reports": one("SELECT sum(reports), sum(steps) FROM {db}.job_progress_windows")[0:2],
            "deltas": one("SELECT count(), sum(d_step) FROM {db}.job_progress_deltas WHERE job_id = 'pilot-1'"),
        }
    finally:
        client.close()


def test_a_progress_report_sent_twice_counts_once(settings) -> None:
    create_topics(settings)
    t = settings.topics
    producer = Producer(settings.kafka_client_config())
    producer.produce(t.usage, encode(UsageBatch(node="n1", records=usage())), key=b"n1", partition=0)
    reports = progress()
    for raw in reports + [reports[2], reports[5]]:  # reports 3 and 6 sent again, at new offsets
        producer.produce(t.job_progress, raw, key=b"pilot-1")
    assert producer.flush(30) == 0
    run_until_caught_up(settings)

    once = {"signals": (6, 500, 0.08, round(10 / 60, 6)), "rank_reports": [6, 6], "window_reports": (5, 500),
            "deltas": (6, 500)}
    got = figures(settings)
    assert got["stored"] == 8  # both copies are in the table, as the sink received them
    assert {k: v for k, v in got.items() if k != "stored"} == once, "a report sent twice counted twice"

    # a replay of the whole topic (every report again, at new offsets), read by the sink restarted
    for raw in reports:
        producer.produce(t.job_progress, raw, key=b"pilot-1")
    assert producer.flush(30) == 0
    run_until_caught_up(settings)
    again = figures(settings)
    assert again["stored"] == 14
    assert {k: v for k, v in again.items() if k != "stored"} == once, "a replay of the topic counted reports again"
