"""bench/sizing.py's projection: per GPU-day, times the days each table holds under its retention."""

from gpuledger.config import Settings
from gpuledger.warehouse.storage import TOTAL

from bench.sizing import project


def _stored(table: str, rows: int, size: int) -> dict:
    return {"table": table, "rows": rows, "bytes_on_disk": size}


def test_tables_are_projected_to_the_days_they_hold():
    settings = Settings(retention_health_days=14, retention_usage_days=100, retention_bills_days=0)
    stored = [_stored("usage_raw", 4_000, 80_000), _stored("gpu_health", 9_000, 160_000),
              _stored("usage_by_job_daily", 40, 2_000), _stored("job_gpu_usage", 60, 1_200),
              _stored("gpu_latest", 8, 400), _stored("usage_gpu_5m", 0, 0), _stored(TOTAL, 13_108, 243_600)]
    out = project(stored, gpus=8, days=2, settings=settings)
    by = {row["table"]: row for row in out["tables"]}
    assert set(by) == {"usage_raw", "gpu_health", "usage_by_job_daily", "job_gpu_usage", "gpu_latest"}
    assert by["usage_raw"]["rows_per_gpu_day"] == 250 and by["usage_raw"]["bytes_per_gpu_day"] == 5_000
    # partitioned by month: the retention plus the 31 days a month waits for its last day
    assert by["usage_raw"]["days_held"] == 131 and by["usage_raw"]["bytes_per_gpu_held"] == 655_000
    # partitioned by day: one day more
    assert by["gpu_health"]["days_held"] == 15 and by["gpu_health"]["bytes_per_gpu_held"] == 150_000
    assert out["bytes_per_gpu_at_retention"] == 805_000
    # kept (a retention of 0, or kept on purpose): growth per GPU-day, except a table of one row per GPU
    assert by["usage_by_job_daily"]["kept"] == "GPULEDGER_RETENTION_BILLS_DAYS=0" and by["usage_by_job_daily"]["grows"]
    assert by["job_gpu_usage"]["grows"] and not by["gpu_latest"]["grows"]
    assert out["kept_growth_bytes_per_gpu_day"] == 125 + 75
    assert [row["table"] for row in out["tables"]][:2] == ["usage_raw", "gpu_health"]
