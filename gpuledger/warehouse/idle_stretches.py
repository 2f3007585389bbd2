"""Idle stretches of worked-out days (sql/0028): the bill close keeps each closed day's stretches in
idle_stretches_daily, so the job_idle_stretches view sorts only the open days' idle records (and the
pieces that touch midnight) into runs instead of every day's.

A day is worked out again whenever its number of idle records (job_idle_segments) differs from the one
its stretches were made of (idle_stretch_days): a late record, or a day not worked out yet. The day's
stretches are then written with a new version, with a deleted row for each stretch that is gone
(ReplacingMergeTree(version, is_deleted)), and its record count last, so a run that dies half-way is
redone by the next one.

The views count each idle record once (sql/0037: job_idle_segments keeps every copy the sink delivers).
The record count here is of rows, copies included: a copy that arrives makes its day worked out again,
to the same stretches."""

from __future__ import annotations

import datetime as dt
import time
from typing import Sequence

COLUMNS = "cluster, day, tenant, queue, job_id, attempt, node, gpu_uuid, gpu_model, start_ms, end_ms, gpu_ms"
DAY = "cluster = {cluster:String} AND day = {day:Date}"


def _counts(client, sql: str, params: dict) -> dict[dt.date, int]:
    return {day: int(n) for day, n in client.query(sql, parameters=params).result_rows}


def refresh(client, db: str, cluster: str, days: Sequence[dt.date], version: int | None = None) -> list[dt.date]:
    """Work out again the days of `days` whose idle records changed since their stretches were written
    (or that have none written); returns those days."""
    if not days:
        return []
    version = version or time.time_ns() // 1000
    params = {"cluster": cluster, "days": sorted(days)}
    where = "cluster = {cluster:String} AND day IN {days:Array(Date)} GROUP BY day"
    now = _counts(client, f"SELECT day, count() FROM {db}.job_idle_segments WHERE {where}", params)
    done = _counts(client, f"SELECT day, argMax(segments, version) FROM {db}.idle_stretch_days WHERE {where}", params)
    changed = [d for d in params["days"] if done.get(d) != now.get(d, 0)]
    for day in changed:
        p = {"cluster": cluster, "day": day, "version": version}
        # stretches that are gone: a deleted row each; then the day's stretches, then its record count
        client.command(f"""
            INSERT INTO {db}.idle_stretches_daily
            SELECT {COLUMNS}, {{version:UInt64}}, 1 FROM {db}.idle_stretches_daily FINAL
            WHERE {DAY} AND (job_id, attempt, gpu_uuid, start_ms) NOT IN
                (SELECT job_id, attempt, gpu_uuid, start_ms FROM {db}.job_idle_day_stretches WHERE {DAY})""",
                       parameters=p)
        client.command(f"INSERT INTO {db}.idle_stretches_daily SELECT {COLUMNS}, {{version:UInt64}}, 0 "
                       f"FROM {db}.job_idle_day_stretches WHERE {DAY}", parameters=p)
        client.command(f"INSERT INTO {db}.idle_stretch_days VALUES ({{cluster:String}}, {{day:Date}}, "
                       f"{now.get(day, 0)}, {{version:UInt64}})", parameters=p)
    return changed
