"""A pilot-run estimate worked by hand (issue #15 points 4-6), on chDB filled with a pilot's usage
records, progress reports (line 4) and checkpoint events; then its approval, and the training signals
the job report shows for the same pilot.

The pilot, job "pilot-1" attempt 0, holds two whole A100-80GB (gpu-A, gpu-B) for 10 minutes from T0,
one usage record per GPU and minute, each drawing 300 W (18,000 J a minute) and costing 8,000 micros.
Progress reports at 1..6 minutes: steps 0, 100, 220, 300, 420, 500 (tokens = 2,048 per step,
epoch = step / 1,000); ranks 0 and 1 take 500 and 650 ms a step. A checkpoint from 200 s to 230 s.

Prices (tests/fixtures/unit_ledger.toml): A100-80GB 0.43 + 0.05 = 0.48 USD per GPU-hour, energy
0.12 USD/kWh x PUE 1.4 = 0.168 USD per GPU kWh; coefficient 2.3.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from gpuledger import warehouse
from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config
from gpuledger.schemas.models import JobEvent, JobProgress, UsageBatch, UsageRecord
from gpuledger.sink.rows import PROGRESS, Source, job_event_row, process_message, usage_rows
from gpuledger.warehouse import estimate as est_mod
from gpuledger.warehouse.periodic import commands as pr

pytestmark = pytest.mark.integration  # the real engine (chDB)

DB = "ledger_golden_estimate"
LEDGER = Path(__file__).resolve().parents[1] / "fixtures" / "unit_ledger.toml"
T0 = int(dt.datetime(2026, 11, 2, tzinfo=dt.timezone.utc).timestamp() * 1000)
MIN = 60_000
STEPS = [0, 100, 220, 300, 420, 500]


def usage() -> list[UsageRecord]:
    return [UsageRecord(
        record_id=f"{gpu}/{m}", cluster="c", node="n1", gpu_uuid=gpu, gpu_model="A100-80GB",
        start_ms=T0 + m * MIN, end_ms=T0 + (m + 1) * MIN, state="executing", job_id="pilot-1", attempt=0,
        tenant="t1", queue="q1", share_milli=1000, gpu_ms=MIN, util_pct=90.0, energy_j=18_000.0,
        coefficient=2.3, coefficient_version="A100-80GB@2020-01-01", effective_gpu_ms=round(2.3 * MIN),
        cost_micros=8_000, definition_version="unit-1") for gpu in ("gpu-A", "gpu-B") for m in range(10)]


def progress() -> list[bytes]:
    return [JobProgress(ts_ms=T0 + (i + 1) * MIN, cluster="c", job_id="pilot-1", attempt=0, step=s, tokens=2048 * s,
                        epoch=s / 1000, loss=2.0 - s / 1000,
                        ranks=[{"rank": 0, "step_time_ms": 500.0}, {"rank": 1, "step_time_ms": 650.0}]
                        ).model_dump_json().encode() for i, s in enumerate(STEPS)]


def checkpoint(n: int, seconds: int, kind: str) -> JobEvent:
    return JobEvent(event_id=f"ck{n}", ts_ms=T0 + seconds * 1000, kind=kind, cluster="c", job_id="pilot-1",
                    attempt=0, tenant="t1", queue="q1")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tmp_path_factory.mktemp("estimate") / "chdb"
    c = warehouse.connect(Settings(warehouse=f"chdb:{path}", database=DB))
    try:
        warehouse.migrate(c, DB)
        warehouse.insert_rows(c, "usage_raw", usage_rows(UsageBatch(node="n1", records=usage()), Source("u", 0, 0)),
                              database=DB)
        # line 4 through the sink's own conversion
        rows = [process_message(PROGRESS, raw, Source("p", 0, i))["job_progress"][0] for i, raw in enumerate(progress())]
        warehouse.insert_rows(c, "job_progress", rows, database=DB)
        events = [checkpoint(1, 200, "checkpoint_begin"), checkpoint(2, 230, "checkpoint_end")]
        warehouse.insert_rows(c, "job_events", [job_event_row(e, Source("e", 0, i)) for i, e in enumerate(events)],
                              database=DB)
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("target,value", [("steps", 60_000), ("tokens", 60_000 * 2048), ("epochs", 60)])
def test_pilot_estimate_worked_by_hand(client, target, value):
    ledger = load_ledger_config(LEDGER)
    pilot = est_mod.load_pilot(client, DB, "pilot-1")
    # two whole GPUs; power over the reported span (1..6 min): 18,000 J / 60 s = 300 W
    assert pilot.gpus == {"A100-80GB": 2.0}
    assert pilot.power_w["A100-80GB"] == pytest.approx(300.0)
    e = est_mod.estimate_run(pilot, target, value, ledger, at_ms=T0)
    # 60 epochs x 1,000 steps per epoch; 122,880,000 tokens / 2,048 per step: both 60,000 steps
    assert e.target_steps == pytest.approx(60_000)
    # mean rate: 500 steps in 300 s = 5/3 steps/s. Interval rates (per 60 s): 100, 120, 80, 120, 80 steps
    # = 5/3, 2, 4/3, 2, 4/3; sorted 4/3, 4/3, 5/3, 2, 2: p10 at position 0.4 = 4/3, p90 at 3.6 = 2
    assert e.steps_per_s == pytest.approx(5 / 3)
    assert e.steps_per_s_low == pytest.approx(4 / 3)
    assert e.steps_per_s_high == pytest.approx(2.0)
    # wall time: 60,000 / (5/3) = 36,000 s = 10 h; band 60,000 / 2 = 8.333 h .. 60,000 / (4/3) = 12.5 h
    assert e.wall_hours == pytest.approx(10.0)
    assert (e.wall_hours_low, e.wall_hours_high) == pytest.approx((25 / 3, 12.5))
    # 2 GPUs x 10 h = 20 GPU-hours; x 2.3 = 46 effective; 300 W x 20 h = 6 kWh
    assert e.gpu_hours == pytest.approx(20.0)
    assert e.effective_gpu_hours == pytest.approx(46.0)
    assert e.energy_kwh == pytest.approx(6.0)
    # cost: 20 h x 0.48 = 9.60 + 6 kWh x 0.12 x 1.4 = 1.008 -> 10.608; low (16.667 GPU-h, 5 kWh):
    # 8.00 + 0.84 = 8.84; high (25 GPU-h, 7.5 kWh): 12.00 + 1.26 = 13.26
    assert (e.cost, e.cost_low, e.cost_high) == pytest.approx((10.608, 8.84, 13.26))
    assert e.price_versions == {"A100-80GB": "A100-80GB@2020-01-01"} and e.priced_by_default == []


def test_above_the_threshold_awaits_approval_and_keeps_the_decision(client):
    ledger = load_ledger_config(LEDGER)
    e = est_mod.estimate_run(est_mod.load_pilot(client, DB, "pilot-1"), "steps", 60_000, ledger, at_ms=T0)
    # threshold 12.00 USD: the upper end 13.26 is above it
    row = est_mod.record_pending(client, DB, e, 12.0, now_ms=T0 + 3_600_000)
    pending = est_mod.list_approvals(client, DB, "pending")
    assert [(p["approval_id"], p["estimated_cost_high"], p["threshold_cost"]) for p in pending] == \
        [(row["approval_id"], pytest.approx(13.26), pytest.approx(12.0))]
    decision = est_mod.decide(client, DB, row["approval_id"], "approved", "alice", "budget line 7", T0 + 7_200_000)
    assert decision["status"] == "approved"
    current = est_mod.list_approvals(client, DB)
    assert [(c["status"], c["decided_by"], c["note"]) for c in current] == [("approved", "alice", "budget line 7")]
    history = est_mod.approval_history(client, DB, row["approval_id"])
    assert [(h["status"], h["ts_ms"]) for h in history] == [("pending", T0 + 3_600_000), ("approved", T0 + 7_200_000)]
    with pytest.raises(ValueError, match="already approved"):
        est_mod.decide(client, DB, row["approval_id"], "rejected", "bob", "", T0 + 7_300_000)
    # the message a scheduler admission hook reads
    msg = est_mod.decision_message(decision)
    assert (msg.status, msg.by, msg.cost_high_micros, msg.threshold_micros) == ("approved", "alice", 13_260_000, 12_000_000)


def test_training_signals_in_the_job_report(client):
    s = client.query(f"SELECT steps, tokens, span_cost, cost_per_step, cost_per_million_tokens, checkpoint_seconds "
                     f"FROM {DB}.job_training_signals WHERE job_id = 'pilot-1'").named_results()
    (row,) = list(s)
    # span 1..6 min: 5 records per GPU x 2 GPUs x 8,000 micros = 0.08 USD for 500 steps, 1,024,000 tokens
    assert (row["steps"], row["tokens"]) == (500, 1_024_000)
    assert row["span_cost"] == pytest.approx(0.08)
    assert row["cost_per_step"] == pytest.approx(0.08 / 500)
    assert row["cost_per_million_tokens"] == pytest.approx(0.078125)
    assert row["checkpoint_seconds"] == pytest.approx(30.0)
    report = pr.build_report(client, DB, "job", job_id="pilot-1")
    spread = report.section("Rank step-time spread").rows
    assert [(r["slowest_rank"], r["spread"]) for r in spread] == [(1, pytest.approx(0.3))]
    hints = {h["hint"] for h in report.section("Training hints").rows}
    # slow rank: 30 % >= 20 %; checkpoints: 30 s of the 300 s span = 10 %
    assert hints == {"slow rank", "checkpoint time"}
    assert report.summary["cost_per_step"] == pytest.approx(0.08 / 500)
    assert "Training signals" in pr.render_report(report, "markdown")


# ---------------------------------------------------------------- job ids shared by clusters
# Slurm numbers jobs per cluster: job "shared-1" is the pilot on cluster a (2 A100-80GB, the golden
# pilot's records and reports, its reports naming cluster a); cluster b's unrelated "shared-1" ran on 8
# A100-80GB a week earlier and reported nothing. "shared-2": reports that name no cluster. "shared-3":
# cluster b's job reported too, as attempt 1.
def shared_job(client, job: str, progress_cluster: str | None, offset: int) -> None:
    def recs(cluster: str, gpus: list[str], t0: int) -> list[UsageRecord]:
        return [r.model_copy(update=dict(record_id=f"{job}/{cluster}/{g}/{m}", cluster=cluster, gpu_uuid=g,
                                         job_id=job, start_ms=t0 + m * MIN, end_ms=t0 + (m + 1) * MIN))
                for r in usage()[:1] for g in gpus for m in range(10)]
    records = recs("a", ["gpu-A", "gpu-B"], T0) + recs("b", [f"h{k}" for k in range(8)], T0 - 7 * 86_400_000)
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=records),
                                                          Source("u", 0, offset)), database=DB)
    raws = [JobProgress(ts_ms=T0 + (i + 1) * MIN, cluster=progress_cluster, job_id=job, attempt=0, step=s
                        ).model_dump_json().encode() for i, s in enumerate(STEPS)]
    warehouse.insert_rows(client, "job_progress", [process_message(PROGRESS, raw, Source("p", 0, offset + i))
                                                   ["job_progress"][0] for i, raw in enumerate(raws)], database=DB)


@pytest.fixture(scope="module")
def shared(client):
    shared_job(client, "shared-1", "a", 100)
    shared_job(client, "shared-2", None, 200)
    shared_job(client, "shared-3", "a", 300)
    b_reports = [JobProgress(ts_ms=T0 - 7 * 86_400_000 + (i + 1) * MIN, cluster="b", job_id="shared-3", attempt=1,
                             step=10 * i).model_dump_json().encode() for i in range(4)]
    warehouse.insert_rows(client, "job_progress", [process_message(PROGRESS, raw, Source("p", 0, 400 + i))
                                                   ["job_progress"][0] for i, raw in enumerate(b_reports)], database=DB)
    return client


@pytest.mark.parametrize("job", ["shared-1", "shared-2", "shared-3"])
def test_a_job_id_of_two_clusters_is_refused_without_its_cluster_and_counted_alone_with_it(shared, job):
    ledger = load_ledger_config(LEDGER)
    # merged, the estimate counted 10 GPUs: 100 GPU-hours, cost 53.04 (44.20 .. 66.30)
    with pytest.raises(ValueError, match=f"job {job} ran in clusters a, b: give --cluster"):
        est_mod.load_pilot(shared, DB, job)
    pilot = est_mod.load_pilot(shared, DB, job, cluster="a")
    # shared-3: cluster a's latest attempt (0) and only its reports, not b's attempt 1
    assert (pilot.cluster, pilot.attempt, pilot.gpus, len(pilot.reports)) == ("a", 0, {"A100-80GB": 2.0}, 6)
    assert pilot.power_w["A100-80GB"] == pytest.approx(300.0)
    e = est_mod.estimate_run(pilot, "steps", 60_000, ledger, at_ms=T0)
    # the golden pilot's figures (test_pilot_estimate_worked_by_hand)
    assert e.gpu_hours == pytest.approx(20.0) and e.cluster == "a"
    assert (e.cost, e.cost_low, e.cost_high) == pytest.approx((10.608, 8.84, 13.26))


def test_the_cluster_of_a_job_id_seen_in_one_cluster_is_found(shared):
    # the golden pilot ran only in cluster "c"
    assert est_mod.load_pilot(shared, DB, "pilot-1").cluster == "c"
    # shared-1's reports name cluster a: cluster b's job reported nothing
    with pytest.raises(ValueError, match="job 'shared-1' in cluster 'b' reported no progress"):
        est_mod.load_pilot(shared, DB, "shared-1", cluster="b")
    # shared-2's name none: with --cluster b they are taken as b's, and only b's records are read: b's ran a
    # week before the reports, so the power its GPUs drew in the reported span is unknown (a's records, in
    # the span, are not taken; before, b's 8 GPUs were priced at 0 W)
    with pytest.raises(ValueError, match="job 'shared-2' in cluster 'b' attempt 0: no usage record of its A100-80GB "
                                         "falls within"):
        est_mod.load_pilot(shared, DB, "shared-2", cluster="b")


def test_estimate_command_takes_the_cluster(shared, monkeypatch, capsys):
    from gpuledger import warehouse as wh
    from gpuledger.cli import main

    class Held:  # the module's chDB session (one chDB directory per process), left open by the command
        def __getattr__(self, name):
            return getattr(shared, name)

        def close(self):
            pass

    monkeypatch.setattr(wh, "connect", lambda settings: Held())
    monkeypatch.setenv("GPULEDGER_DATABASE", DB)
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(LEDGER))
    common = ["--target-steps", "60000", "--threshold", "20", "--no-publish"]
    assert main(["estimate", "shared-1", *common]) == 2
    assert "job shared-1 ran in clusters a, b: give --cluster" in capsys.readouterr().err
    assert main(["estimate", "shared-1", "--cluster", "a", *common]) == 0
    out = capsys.readouterr().out
    # upper end 13.26 under the threshold of 20 (merged: 66.30, sent for approval)
    assert "job shared-1 (cluster a) attempt 0" in out and "2 x A100-80GB" in out and "no approval needed" in out


def test_a_pilot_whose_usage_records_miss_its_reported_span_is_refused(client):
    # job late-1's records (the golden pilot's: 0..10 min) end before its first report (20 min), as when
    # the sink is behind: its power read None and was priced as 0 W, an estimate without energy
    records = [r.model_copy(update=dict(record_id="late/" + r.record_id, job_id="late-1")) for r in usage()]
    warehouse.insert_rows(client, "usage_raw", usage_rows(UsageBatch(node="n1", records=records), Source("u", 0, 900)),
                          database=DB)
    raws = [JobProgress(ts_ms=T0 + (20 + i) * MIN, cluster="c", job_id="late-1", attempt=0, step=s
                        ).model_dump_json().encode() for i, s in enumerate(STEPS)]
    warehouse.insert_rows(client, "job_progress", [process_message(PROGRESS, raw, Source("p", 0, 900 + i))
                                                   ["job_progress"][0] for i, raw in enumerate(raws)], database=DB)
    with pytest.raises(ValueError, match="job 'late-1' in cluster 'c' attempt 0: no usage record of its A100-80GB "
                                         "falls within its progress reports"):
        est_mod.load_pilot(client, DB, "late-1")
