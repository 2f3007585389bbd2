"""GPU ID cards (issue #15 point 1; docs/gpu-cards.md): one GPU's life story, and the fleet's failure rates.

    gpuledger gpu repair GPU-... --note "replaced HBM stack" --at 2026-11-10T12:00Z
    gpuledger report gpu GPU-...  [--format table|json|markdown|html]
    gpuledger report gpu-fleet    [--format ...]

Sources (sql/0020, sql/0018): `gpu_sightings` (first/last seen, nodes, identity: every inventory report
through a materialized view), `gpu_repairs` (append-only, operator-recorded), `usage_raw` deduplicated
by record id (down time and down episodes, tenants served, delivered busy time per kWh), `gpu_health_hourly`
(temperature, utilization, power and Xid counts by month) and `gpu_health` (per-tick Xid history within
its retention). Reports are the periodic reports' model (gpuledger/warehouse/periodic/), so they render
as text, Markdown and self-contained HTML; JSON is the model's rows as they are.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import statistics
import sys
import uuid as uuidlib
from pathlib import Path
from typing import Any, Iterable

from gpuledger.warehouse.client import insert_rows, quoted_database
from gpuledger.warehouse.periodic.model import Plot, Report, Section

#: a card back from repair this many times is suggested for lower-priority work (shared/PRODUCT.md)
REPAIRS_BEFORE_LOWER_PRIORITY = 2
LOWER_PRIORITY_FLAG = "suggest lower-priority work"
#: characters of the serial that name the vendor's batch (NVIDIA serials: plant, year, week, line)
SERIAL_BATCH_PREFIX = 7
YEAR_MS = 365.25 * 86_400_000
AGE_BUCKETS = ((1, "under 1 year"), (2, "1-2 years"), (3, "2-3 years"), (float("inf"), "3 years or more"))
XID_HISTORY_ROWS = 200
FORMATS = ("table", "json", "markdown", "html")


def _q(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


def _at(ms: int | None) -> dt.datetime | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)


# --------------------------------------------------------------------------- pure figures
def down_episodes(spans: Iterable[tuple[int, int]]) -> int:
    """Separate down stretches in (start_ms, end_ms) records of one GPU: records that touch or overlap
    (a segment cut at a window, consecutive ticks) are one episode."""
    episodes, end = 0, None
    for start, stop in sorted(spans):
        if end is None or start > end:
            episodes += 1
            end = stop
        else:
            end = max(end, stop)
    return episodes


def trend_pct_per_month(values: list[float | None]) -> float | None:
    """Least-squares slope of monthly values (one per consecutive month, None: no data) as percent of
    their mean per month; None with fewer than two months of data. Negative: the card delivers less."""
    points = [(i, v) for i, v in enumerate(values) if v is not None]
    if len(points) < 2:
        return None
    xs, ys = zip(*points)
    mean = statistics.fmean(ys)
    if mean == 0:
        return None
    slope = statistics.linear_regression(xs, ys).slope
    return slope / mean * 100


def vendor_batch(board_part_number: str, serial: str) -> str:
    """The batch a card came in: board part number and serial prefix ('unknown' where the agent read neither)."""
    parts = [p for p in (board_part_number, serial[:SERIAL_BATCH_PREFIX]) if p]
    return " / ".join(parts) if parts else "unknown"


def age_bucket(age_ms: int) -> str:
    years = age_ms / YEAR_MS
    return next(label for limit, label in AGE_BUCKETS if years < limit)


def flag_of(repairs: int) -> str:
    return LOWER_PRIORITY_FLAG if repairs >= REPAIRS_BEFORE_LOWER_PRIORITY else ""


# --------------------------------------------------------------------------- repairs
def record_repair(client, database: str, gpu_uuid: str, note: str, repaired_ms: int, recorded_by: str,
                  *, force: bool = False, now_ms: int | None = None) -> str:
    """Append one repair; returns its id. Refuses a GPU the ledger never saw (a typo would start a
    card of its own) unless `force`, an empty note, and a time in the future."""
    db = quoted_database(database)
    gpu_uuid, note = gpu_uuid.strip(), note.strip()
    if not gpu_uuid or not gpu_uuid.isprintable():
        raise ValueError(f"GPU UUID must be printable text, got {gpu_uuid!r}")
    if not note:
        raise ValueError("--note must say what was repaired")
    now_ms = now_ms if now_ms is not None else int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
    if repaired_ms > now_ms + 60_000:
        raise ValueError(f"--at {_at(repaired_ms):%Y-%m-%d %H:%M} UTC is in the future")
    if not force and not _q(client, f"SELECT 1 FROM {db}.gpu_sightings WHERE gpu_uuid = {{u:String}} LIMIT 1",
                            {"u": gpu_uuid}):
        raise ValueError(f"GPU {gpu_uuid} was never seen by the ledger (a typo?); --force records it anyway")
    repair_id = str(uuidlib.uuid4())
    insert_rows(client, "gpu_repairs", [{"repair_id": repair_id, "gpu_uuid": gpu_uuid, "repaired_ms": repaired_ms,
                                         "note": note, "recorded_by": recorded_by}], database=database)
    return repair_id


# --------------------------------------------------------------------------- one card
def build_card(client, database: str, gpu_uuid: str) -> Report:
    db = quoted_database(database)
    p = {"u": gpu_uuid}
    seen = _q(client, f"""
        SELECT toString(cluster) AS cluster, node, toString(gpu_model) AS gpu_model, serial, board_part_number,
               vbios_version, min(first_seen_ms) AS first_ms, max(last_seen_ms) AS last_ms
        FROM {db}.gpu_sightings WHERE gpu_uuid = {{u:String}}
        GROUP BY cluster, node, gpu_model, serial, board_part_number, vbios_version""", p)
    if not seen:
        raise ValueError(f"no GPU {gpu_uuid} in the warehouse (gpu_sightings); `gpuledger report gpu-fleet` lists the GPUs")
    latest = max(seen, key=lambda r: r["last_ms"])

    def known(key: str) -> str:  # the newest non-empty value: identity is read by agents of every age
        rows = [r for r in seen if r[key]]
        return max(rows, key=lambda r: r["last_ms"])[key] if rows else ""

    first_ms, last_ms = min(r["first_ms"] for r in seen), max(r["last_ms"] for r in seen)
    places: dict[tuple, list[int]] = {}
    for r in seen:
        span = places.setdefault((r["cluster"], r["node"]), [r["first_ms"], r["last_ms"]])
        span[0], span[1] = min(span[0], r["first_ms"]), max(span[1], r["last_ms"])
    placements = [{"cluster": c, "node": n, "first_seen_at": _at(a), "last_seen_at": _at(b)}
                  for (c, n), (a, b) in sorted(places.items(), key=lambda kv: kv[1][0])]

    repairs = _q(client, f"""
        SELECT repaired_ms, note, recorded_by, recorded_at, repair_id FROM {db}.gpu_repairs
        WHERE gpu_uuid = {{u:String}} ORDER BY repaired_ms, recorded_at""", p)
    repair_rows = [{"repaired_at": _at(r["repaired_ms"]), "note": r["note"], "recorded_by": r["recorded_by"],
                    "recorded_at": r["recorded_at"], "repair_id": r["repair_id"]} for r in repairs]

    usage = f"(SELECT * FROM {db}.usage_raw WHERE gpu_uuid = {{u:String}} LIMIT 1 BY cluster, record_id)"
    down = _q(client, f"SELECT start_ms, end_ms, gpu_ms FROM {usage} WHERE state = 'down' ORDER BY start_ms", p)
    by_month_usage = {r["month"]: r for r in _q(client, f"""
        SELECT toStartOfMonth(day) AS month, sumIf(gpu_ms, state = 'down') / 1000 AS down_seconds,
               sumIf(gpu_ms, job_id != '' AND state IN ('executing', 'allocated_idle')) / 3600000 AS allocated_gpu_hours,
               sumIf(util_pct / 100 * gpu_ms, state = 'executing' AND util_pct IS NOT NULL) AS busy_ms,
               sumIf(energy_j, state = 'executing' AND util_pct IS NOT NULL) AS busy_energy_j
        FROM {usage} GROUP BY month""", p)}
    health = {r["month"]: r for r in _q(client, f"""
        SELECT toStartOfMonth(day) AS month, avgMerge(temperature_c) AS avg_temperature_c,
               maxMerge(max_temperature_c) AS max_temperature_c, avgMerge(util_gpu_pct) AS avg_util_pct,
               avgMerge(power_w) AS avg_power_w, sum(xid_count) AS xid_errors
        FROM {db}.gpu_health_hourly WHERE gpu_uuid = {{u:String}} GROUP BY month""", p)}
    # health and usage outlive what sightings recall (sql/0020 back-filled them from 14-day gpu_health)
    spans = [_at(first_ms).date(), _at(last_ms).date(), *health, *by_month_usage]
    months = _month_range(min(spans), max(spans))
    monthly = []
    for m in months:
        u, h = by_month_usage.get(m, {}), health.get(m, {})
        per_kwh = (u["busy_ms"] / u["busy_energy_j"]) if u.get("busy_energy_j") else None  # busy h / kWh
        monthly.append({
            "month": m.strftime("%Y-%m"), "avg_temperature_c": h.get("avg_temperature_c"),
            "max_temperature_c": h.get("max_temperature_c"), "avg_util_pct": h.get("avg_util_pct"),
            "avg_power_w": h.get("avg_power_w"), "xid_errors": h.get("xid_errors", 0),
            "down_seconds": u.get("down_seconds", 0.0), "allocated_gpu_hours": u.get("allocated_gpu_hours", 0.0),
            "busy_hours_per_kwh": per_kwh,
        })
    trend = trend_pct_per_month([r["busy_hours_per_kwh"] for r in monthly])

    xids = _q(client, f"""
        SELECT ts_ms, node, arrayStringConcat(arrayMap(x -> toString(x), xid_errors), ' ') AS xid_codes,
               toString(health) AS health, down_reason
        FROM {db}.gpu_health WHERE gpu_uuid = {{u:String}} AND length(xid_errors) > 0
        ORDER BY ts_ms DESC LIMIT {XID_HISTORY_ROWS}""", p)
    xid_rows = [{"seen_at": _at(r["ts_ms"]), "node": r["node"], "xid_codes": r["xid_codes"], "health": r["health"],
                 "down_reason": r["down_reason"]} for r in xids]
    tenants = _q(client, f"""
        SELECT toString(tenant) AS tenant, uniqExact(cluster, job_id) AS jobs, sum(gpu_ms) / 3600000 AS gpu_hours,
               min(day) AS first_day, max(day) AS last_day
        FROM {usage} WHERE job_id != '' AND state IN ('executing', 'allocated_idle')
        GROUP BY tenant ORDER BY gpu_hours DESC, tenant""", p)

    serial, part = known("serial"), known("board_part_number")
    summary = {
        "gpu_uuid": gpu_uuid, "gpu_model": latest["gpu_model"], "serial": serial, "board_part_number": part,
        "vbios_version": known("vbios_version"), "vendor_batch": vendor_batch(part, serial),
        "first_seen_at": _at(first_ms), "last_seen_at": _at(last_ms), "nodes": len(places),
        "down_seconds": sum(r["gpu_ms"] for r in down) / 1000, "down_episodes": down_episodes(
            (r["start_ms"], r["end_ms"]) for r in down),
        "xid_errors": sum(h["xid_errors"] or 0 for h in health.values()), "repairs": len(repairs),
        "busy_hours_per_kwh_trend_pct_per_month": trend, "flag": flag_of(len(repairs)),
    }
    # the card's flag as the GPU ID cards chart has it (sql/0048: also "reported by N nodes at once")
    carded = _q(client, f"SELECT flag FROM {db}.gpu_cards WHERE gpu_uuid = {{u:String}}", p)
    if carded:
        summary["flag"] = carded[0]["flag"]
    return Report(
        name="gpu", title=f"GPU ID card: {gpu_uuid}",
        period=f"{_at(first_ms):%Y-%m-%d %H:%M} .. {_at(last_ms):%Y-%m-%d %H:%M} UTC", summary=summary,
        sections=[
            Section("Where it sat", placements, note="first and last inventory report from each node"),
            Section("Repairs", repair_rows, note="recorded by operators; append-only"),
            Section("By month", monthly, note="busy hours per kWh: executing GPU time x utilization / its energy "
                                              "(a falling trend: the card delivers less per watt)",
                    plot=Plot("line", "month", ["avg_util_pct"])),
            Section("Xid errors", xid_rows, note=f"per tick, newest first (at most {XID_HISTORY_ROWS}; per-sample "
                                                 "health retention)"),
            Section("Tenants served", tenants, note="executing and allocated-idle GPU time of their jobs"),
        ])


def _month_range(first: dt.date, last: dt.date) -> list[dt.date]:
    out, m = [], first.replace(day=1)
    while m <= last:
        out.append(m)
        m = (m.replace(day=28) + dt.timedelta(days=4)).replace(day=1)
    return out


# --------------------------------------------------------------------------- the fleet
def fleet_rows(client, database: str) -> list[dict]:
    """One row per GPU: model, vendor batch, age known to the ledger, down episodes, repairs, Xid errors."""
    db = quoted_database(database)
    gpus = _q(client, f"""
        SELECT gpu_uuid, argMax(toString(gpu_model), last_seen_ms) AS gpu_model,
               argMaxIf(serial, last_seen_ms, serial != '') AS serial,
               argMaxIf(board_part_number, last_seen_ms, board_part_number != '') AS board_part_number,
               min(first_seen_ms) AS first_ms, max(last_seen_ms) AS last_ms
        FROM (SELECT gpu_uuid, gpu_model, serial, board_part_number, min(first_seen_ms) AS first_seen_ms,
                     max(last_seen_ms) AS last_seen_ms FROM {db}.gpu_sightings
              GROUP BY gpu_uuid, gpu_model, serial, board_part_number)
        GROUP BY gpu_uuid ORDER BY gpu_uuid""")
    # down episodes as down_episodes counts them, in the engine (2 M down records at 100 M records:
    # 0.2 s, against 2.7 s to bring them into Python); a down record is whole-GPU: it ends at start + gpu_ms
    episodes = {r["gpu_uuid"]: r["n"] for r in _q(client, f"""
        SELECT gpu_uuid, countIf(start_ms > covered_until) AS n FROM (
            SELECT gpu_uuid, start_ms, max(start_ms + toInt64(gpu_ms)) OVER (
                PARTITION BY gpu_uuid ORDER BY start_ms ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS covered_until
            FROM {db}.gpu_down_records FINAL)
        GROUP BY gpu_uuid""")}
    repairs = {r["gpu_uuid"]: r["n"] for r in _q(
        client, f"SELECT gpu_uuid, count() AS n FROM {db}.gpu_repairs GROUP BY gpu_uuid")}
    xids = {r["gpu_uuid"]: r["n"] for r in _q(
        client, f"SELECT gpu_uuid, sum(xid_count) AS n FROM {db}.gpu_health_hourly GROUP BY gpu_uuid")}
    out = []
    for g in gpus:
        age = g["last_ms"] - g["first_ms"]
        out.append({"gpu_uuid": g["gpu_uuid"], "gpu_model": g["gpu_model"],
                    "vendor_batch": vendor_batch(g["board_part_number"], g["serial"]), "age": age_bucket(age),
                    "observed_ms": age, "down_episodes": int(episodes.get(g["gpu_uuid"], 0)),
                    "repairs": repairs.get(g["gpu_uuid"], 0), "xid_errors": int(xids.get(g["gpu_uuid"], 0))})
    return out


def failure_rates(gpus: list[dict], by: str) -> list[dict]:
    """Failure figures of GPUs grouped by `by` (gpu_model, vendor_batch or age): a GPU failed when it
    went down or was repaired; failures per GPU-year = down episodes / the GPU-years the ledger saw."""
    groups: dict[str, list[dict]] = {}
    for g in gpus:
        groups.setdefault(g[by], []).append(g)
    rows = []
    for key, members in groups.items():
        failed = sum(1 for g in members if g["down_episodes"] or g["repairs"])
        years = sum(g["observed_ms"] for g in members) / YEAR_MS
        episodes = sum(g["down_episodes"] for g in members)
        rows.append({by: key, "gpus": len(members), "failed_gpus": failed, "failed_gpu_share": failed / len(members),
                     "down_episodes": episodes, "observed_gpu_years": years,
                     "failures_per_gpu_year": episodes / years if years > 0 else None,
                     "repairs": sum(g["repairs"] for g in members), "xid_errors": sum(g["xid_errors"] for g in members),
                     "flagged_gpus": sum(1 for g in members if flag_of(g["repairs"]))})
    order = [label for _, label in AGE_BUCKETS]
    return sorted(rows, key=lambda r: (order.index(r[by]),) if by == "age" else (-r["failed_gpu_share"], str(r[by])))


def build_fleet(client, database: str) -> Report:
    gpus = fleet_rows(client, database)
    flagged = [{"gpu_uuid": g["gpu_uuid"], "gpu_model": g["gpu_model"], "vendor_batch": g["vendor_batch"],
                "repairs": g["repairs"], "down_episodes": g["down_episodes"]} for g in gpus if flag_of(g["repairs"])]
    return Report(
        name="gpu-fleet", title="GPU fleet: failure rates", period="everything the warehouse holds",
        summary={"gpus": len(gpus), "failed_gpus": sum(1 for g in gpus if g["down_episodes"] or g["repairs"]),
                 "flagged_gpus": len(flagged)},
        sections=[Section("By model", failure_rates(gpus, "gpu_model")),
                  Section("By vendor batch", failure_rates(gpus, "vendor_batch"),
                          note="board part number / serial prefix, as the agents read them"),
                  Section("By age", failure_rates(gpus, "age"), note="time between first and last sighting"),
                  Section(f"Back from repair {REPAIRS_BEFORE_LOWER_PRIORITY} times or more: {LOWER_PRIORITY_FLAG}",
                          flagged)])


# --------------------------------------------------------------------------- rendering and CLI
def report_json(report: Report) -> str:
    return json.dumps({"name": report.name, "title": report.title, "period": report.period, "summary": report.summary,
                       "sections": [{"title": s.title, "note": s.note, "rows": s.rows} for s in report.sections]},
                      default=lambda v: v.isoformat() if hasattr(v, "isoformat") else str(v), indent=2) + "\n"


def render_card(report: Report, fmt: str) -> str:
    if fmt == "json":
        return report_json(report)
    from gpuledger.warehouse.periodic.render import render_report

    return render_report(report, fmt)


def _parse_at(text: str | None) -> int:
    from gpuledger.warehouse.carbon import CarbonInputError, parse_time_ms

    if text is None:
        return int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)
    try:
        return parse_time_ms(text, "--at")
    except CarbonInputError:  # in the repair command's words, with an example
        raise ValueError(f"--at must be an ISO date or time (e.g. 2026-11-10T12:00Z, UTC unless an offset is "
                         f"given), got {text!r}") from None


def report_command(args, settings) -> int:
    """`gpuledger report gpu UUID` / `gpuledger report gpu-fleet` (gpuledger/cli.py routes them here)."""
    from gpuledger.warehouse import connect_readonly

    if args.format not in FORMATS:
        raise SystemExit(f"report {args.report} is printed as {', '.join(FORMATS)}")
    if args.report == "gpu" and not args.job_id:
        raise SystemExit("usage: gpuledger report gpu GPU_UUID")
    if args.report == "gpu-fleet" and args.job_id:
        raise SystemExit("usage: gpuledger report gpu-fleet (the whole fleet; `report gpu UUID` for one card)")
    from gpuledger.cli import REPORT_FILTER_FLAGS

    given = [flag for name, flag in REPORT_FILTER_FLAGS.items() if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"report {args.report} takes no {', '.join(given)}")
    client = connect_readonly(settings)
    try:
        report = build_card(client, settings.database, args.job_id) if args.report == "gpu" else build_fleet(
            client, settings.database)
    finally:
        client.close()
    text = render_card(report, args.format)
    if getattr(args, "output", None):
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


def cmd_gpu(args) -> int:
    from gpuledger.cli import settings_from_args
    from gpuledger.warehouse import connect

    settings = settings_from_args(args)
    repaired_ms = _parse_at(args.at)  # before the warehouse is opened
    client = connect(settings)
    try:
        repair_id = record_repair(client, settings.database, args.gpu_uuid, args.note or "", repaired_ms,
                                  args.by or _user(), force=args.force)
    finally:
        client.close()
    print(f"recorded repair {repair_id} of {args.gpu_uuid}")
    return 0


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return "unknown"


def register_cli(subparsers) -> Any:
    """`gpuledger gpu repair` (called from gpuledger/cli.py's build_parser)."""
    help_text = "a GPU's ID card: record a repair (append-only, with who and when)"
    p = subparsers.add_parser("gpu", help=help_text, description=help_text + "; `gpuledger report gpu UUID` "
                              "prints the card. docs/gpu-cards.md.")
    p.set_defaults(func=cmd_gpu)
    p.add_argument("action", choices=["repair"])
    p.add_argument("gpu_uuid")
    p.add_argument("--note", required=True, help="what was repaired")
    p.add_argument("--at", help="when the card came back from repair: ISO date or time, UTC unless an offset is "
                                "given (default: now)")
    p.add_argument("--by", help="who records it (default: the login name)")
    p.add_argument("--force", action="store_true", help="record it for a GPU the ledger has never seen")
    p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    p.add_argument("--warehouse", help="'chdb', 'chdb:/dir' or http(s)://host:port (default: GPULEDGER_WAREHOUSE)")
    return p


__all__ = ["build_card", "build_fleet", "down_episodes", "failure_rates", "record_repair", "render_card",
           "trend_pct_per_month", "vendor_batch"]
