"""Carbon of GPU work (issue #15 point 2; docs/carbon.md): grid intensity series in, gCO2e out.

    gpuledger carbon load intensity.csv    # zone (cluster or region), valid_from, gco2e_per_kwh
    gpuledger carbon show                  # the recorded definition and the loaded series

A usage record's carbon is its energy (usage_raw.energy_j, measured at the GPU) x PUE x the grid
intensity of its cluster's zone valid at the record's start (ASOF JOIN on valid_from), else the
definition's default intensity. The definition ([carbon] in the ledger TOML, streams/carbondefs.py)
is recorded in `carbon_definitions` by `gpuledger migrate` and `gpuledger carbon load`; the latest
recorded one applies and its version is named beside every figure. Tables and views: sql/0020.

Energy is summed per hour before the intensity is joined (docs/carbon.md "Closed days"): closed days
from `closed_energy`, which the bill close writes (sql/0023, gpuledger/warehouse/bills.py), open days
from usage_raw; only days whose zone's series changes within an hour (`carbon_record_days`) are worked
out record by record, a closed one only while usage_raw still holds its records (sql/0041). The
definition and the series are applied when a figure is read. The pieces below build the reports'
carbon (gpuledger/warehouse/reports.py), which read the open days' records once for money and carbon.
"""

from __future__ import annotations

import csv
import datetime as dt
import getpass
import io
import math
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from gpuledger.streams.carbondefs import MAX_GCO2E_PER_KWH, CarbonConfigError, CarbonDefinition
from gpuledger.warehouse.client import insert_rows, quoted_database

#: header names a CSV may give the zone column (a cluster's name, or a region [carbon.zones] names)
ZONE_HEADERS = ("zone", "cluster", "region")
#: a valid_from the ledger cannot mean: before 1970 (no usage time, and no warehouse Date, is earlier) or
#: more than a year after the load (a typo of the year, 2206 for 2026: the value would never apply, and the
#: value it stood for would be missing). Forecast series, hours or days ahead, stay well inside.
EPOCH_MS = 0
MAX_AHEAD_MS = 366 * 86_400_000


class CarbonInputError(ValueError):
    """A carbon intensity file the ledger cannot read; the message names the line."""


def parse_time_ms(text: str, where: str) -> int:
    """'2026-11-10', '2026-11-10T06:00', '2026-11-10T06:00:00+01:00' or '...Z' -> epoch ms (UTC when no
    offset is given: the ledger's days are UTC days). `where` names the value: "FILE, line 3: valid_from"."""
    value = text.strip()
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise CarbonInputError(f"{where} must be an ISO date or time (e.g. 2026-11-10T06:00Z), got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


def parse_intensity_csv(text: str, source: str = "<csv>", zones: Mapping[str, str] | None = None,
                        now_ms: int | None = None) -> list[dict]:
    """Rows {zone, valid_from_ms, gco2e_per_kwh} of a CSV with a header: one of zone/cluster/region,
    valid_from and gco2e_per_kwh (other columns are ignored). Every bad line is an error, with its
    number: a partly loaded series would price some hours at the default without anyone knowing.
    `zones`: the definition's [carbon.zones]; a row naming a cluster it maps to another zone is an error
    (no figure would ever read that series: the cluster takes its zone's), unless another cluster maps to
    that name. `now_ms`: the load's time (default: the clock); valid_from is at most a year after it."""
    now_ms = _now_ms() if now_ms is None else now_ms
    read_zones = set((zones or {}).values())
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff")))  # a spreadsheet's byte order mark
    header = [h.strip() for h in (reader.fieldnames or [])]
    reader.fieldnames = header
    named = [h for h in ZONE_HEADERS if h in header]
    if len(named) > 1:  # which one the series is named by would be a guess (a cluster's name is not its region)
        raise CarbonInputError(f"{source}: the header names {' and '.join(named)}: name the zone in one column "
                               "only (zone, cluster or region)")
    zone_col = named[0] if named else None
    missing = [name for name, ok in (("zone, cluster or region", zone_col), ("valid_from", "valid_from" in header),
                                     ("gco2e_per_kwh", "gco2e_per_kwh" in header)) if not ok]
    if missing:
        raise CarbonInputError(f"{source}: the header must name {', '.join(missing)}; got {', '.join(header) or 'nothing'}")
    rows, seen = [], {}
    for raw in reader:
        where = f"{source}, line {reader.line_num}"  # the file's line (blank lines and quoted line breaks count)
        if not any((v or "").strip() for v in raw.values() if isinstance(v, str)):
            continue  # a blank line
        zone = (raw.get(zone_col) or "").strip()
        if not zone or not zone.isprintable() or len(zone) > 256:
            raise CarbonInputError(f"{where}: {zone_col} must be a name, got {raw.get(zone_col)!r}")
        if zones and zones.get(zone, zone) != zone and zone not in read_zones:
            raise CarbonInputError(f"{where}: cluster {zone} takes the intensity of zone {zones[zone]} "
                                   f"([carbon.zones]), so a series named {zone} would never be read: name it "
                                   f"{zones[zone]}, or remove the mapping")
        ts = parse_time_ms(raw.get("valid_from") or "", f"{where}: valid_from")
        if not EPOCH_MS <= ts <= now_ms + MAX_AHEAD_MS:
            raise CarbonInputError(f"{where}: valid_from must be within 1970-01-01 and a year after now "
                                   f"({_utc(now_ms).date()}), got {raw.get('valid_from')!r} ({_utc(ts).date()} UTC):"
                                   " a typo of the year?")
        try:
            g = float((raw.get("gco2e_per_kwh") or "").strip())
        except ValueError:
            raise CarbonInputError(f"{where}: gco2e_per_kwh must be a number, got {raw.get('gco2e_per_kwh')!r}") from None
        if not math.isfinite(g) or not 0 <= g <= MAX_GCO2E_PER_KWH:
            raise CarbonInputError(f"{where}: gco2e_per_kwh must be within 0..{MAX_GCO2E_PER_KWH:g} g/kWh, got {g}")
        if (zone, ts) in seen:
            raise CarbonInputError(f"{where}: {zone} from {raw.get('valid_from')} is given twice "
                                   f"(first on line {seen[(zone, ts)]})")
        seen[(zone, ts)] = reader.line_num
        rows.append({"zone": zone, "valid_from_ms": ts, "gco2e_per_kwh": g})
    if not rows:
        raise CarbonInputError(f"{source}: no rows")
    return rows


def _now_ms() -> int:
    return int(dt.datetime.now(dt.timezone.utc).timestamp() * 1000)


def _utc(ms: int) -> dt.datetime:
    """Epoch ms as a UTC time, exact (no float); past what datetime holds (0001-01-01 less an offset), its end."""
    try:
        return dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(milliseconds=ms)
    except OverflowError:
        return (dt.datetime.min if ms < 0 else dt.datetime.max).replace(tzinfo=dt.timezone.utc)


# --------------------------------------------------------------------------- warehouse
def _query(client, sql: str, params: dict | None = None) -> list[dict]:
    return list(client.query(sql, parameters=params or {}).named_results())


def record_definition(client, database: str, carbon: CarbonDefinition) -> bool:
    """Record the [carbon] definition unless the latest recorded one is the same; True when recorded.
    Refuses a version already recorded with other figures (CarbonConfigError), as sync_library refuses a
    changed definition_version: every carbon figure names its carbon_version, which must keep meaning the
    figures it was reported under (a PUE changed under the same name re-labelled every past figure)."""
    db = quoted_database(database)
    columns = "carbon_version, pue, default_gco2e_per_kwh, default_source, zones"
    latest = _query(client, f"SELECT {columns} FROM {db}.carbon_definitions ORDER BY recorded_at DESC LIMIT 1")
    wanted = {"carbon_version": carbon.version, "pue": carbon.pue, "default_gco2e_per_kwh": carbon.default_gco2e_per_kwh,
              "default_source": carbon.default_source, "zones": dict(carbon.zones)}

    def plain(row: dict) -> dict:
        return {k: (dict(v) if k == "zones" else v) for k, v in row.items()}

    if latest and plain(latest[0]) == wanted:
        return False
    same_name = [plain(r) for r in _query(client, f"SELECT DISTINCT {columns} FROM {db}.carbon_definitions "
                                                  "WHERE carbon_version = {v:String}", {"v": carbon.version})]
    if same_name and wanted not in same_name:
        was = same_name[-1]
        changed = ", ".join(f"{k} {was[k]!r} -> {wanted[k]!r}" for k in wanted if was[k] != wanted[k])
        raise CarbonConfigError(
            f"carbon definition {carbon.version!r} is already recorded with other figures ({changed}): set a new "
            "[carbon] version in the ledger config, so carbon figures already reported under it keep their meaning")
    insert_rows(client, "carbon_definitions", [wanted], database=database)
    return True


def unread_zones(client, database: str, carbon: CarbonDefinition, zones: Sequence[str]) -> list[str]:
    """The zones (of a load) no cluster the warehouse has usage of takes its intensity from under `carbon`:
    a misspelt zone, or a cluster not reporting yet; their series prices nothing until one does."""
    db = quoted_database(database)
    clusters = [r["cluster"] for r in _query(client, f"SELECT DISTINCT toString(cluster) AS cluster "
                                                     f"FROM {db}.usage_capacity_daily")]
    read = {carbon.zone_of(c) for c in clusters}
    return sorted(set(zones) - read)


def load_intensity(client, database: str, rows: Sequence[dict], source: str, loaded_by: str | None = None) -> int:
    """Append the rows to carbon_intensity (history kept; the latest load of a zone and time wins).
    carbon_intensity_current takes the value of the greatest loaded_at, so a load is stamped after every
    load stored (a millisecond later at least), not with the server's clock alone: a clock stepped back
    (or a replica's clock behind another's) stamped a correction before the value it corrected, which
    then kept pricing, and two loads in one millisecond left the winner to the engine."""
    by = loaded_by or _user()
    (stamp,) = _query(client, "SELECT toUnixTimestamp64Milli(greatest(now64(3), max(loaded_at) + toIntervalMillisecond(1)))"
                              f" AS ms FROM {quoted_database(database)}.carbon_intensity")
    loaded_at = _utc(int(stamp["ms"]))
    return insert_rows(client, "carbon_intensity",
                       [{**r, "source": source, "loaded_by": by, "loaded_at": loaded_at} for r in rows],
                       database=database)


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return "unknown"


HOUR_MS = 3_600_000


def definition_now(client, database: str) -> dict | None:
    """The carbon definition that applies (the latest recorded), or None: none recorded, or a warehouse
    before sql/0020 (reports then carry no carbon figure)."""
    db = quoted_database(database)
    try:
        rows = _query(client, f"SELECT carbon_version, pue, default_gco2e_per_kwh, zones FROM {db}.carbon_definition_current")
    except Exception as exc:
        if "carbon_" in str(exc) and ("UNKNOWN_TABLE" in str(exc) or "doesn't exist" in str(exc)):
            return None
        raise
    return rows[0] if rows else None


def definition_params(definition: dict | None) -> dict:
    """Query parameters intensity_join_sql reads (neutral values when there is no definition)."""
    d = definition or {"pue": 0.0, "default_gco2e_per_kwh": 0.0, "zones": {}}
    zones = dict(d["zones"])
    return {"carbon_pue": float(d["pue"]), "carbon_default": float(d["default_gco2e_per_kwh"]),
            "carbon_zone_of": sorted(zones), "carbon_zone": [zones[k] for k in sorted(zones)]}


def record_days(client, database: str) -> dict[str, list[dt.date]]:
    """{cluster: days} worked out record by record (carbon_record_days, sql/0023 and 0041: the zone's series
    changes within an hour on those days; a closed day only while usage_raw holds as many rows for it as
    closed_energy counted records, else it is read from closed_energy like other closed days); empty
    without a definition, and wherever series change on the hour."""
    from gpuledger.warehouse.bills import days_by_cluster

    return days_by_cluster(client, f"SELECT cluster, day FROM {quoted_database(database)}.carbon_record_days")


def bucket_sql(record_cond: str) -> str:
    """A usage record's carbon time: its hour's start, or its own start where `record_cond` (the days of
    record_days, days_condition) holds."""
    hour = f"intDiv(start_ms, {HOUR_MS}) * {HOUR_MS}"
    return hour if record_cond == "0" else f"if({record_cond}, start_ms, {hour})"


def intensity_join_sql(db: str, rows_sql: str) -> str:
    """Rows (cluster, start_ms, energy_j, ...) with co2e_g: energy x PUE x the intensity of the cluster's
    zone valid at start_ms (ASOF JOIN), else the default; the definition comes as parameters
    (definition_params)."""
    zone = ("if(has({carbon_zone_of:Array(String)}, cluster), "
            "{carbon_zone:Array(String)}[indexOf({carbon_zone_of:Array(String)}, cluster)], cluster)")
    return f"""
        SELECT x.*, x.energy_j / 3600000 * {{carbon_pue:Float64}}
                    * if(ci.found = 1, ci.gco2e_per_kwh, {{carbon_default:Float64}}) AS co2e_g
        FROM (SELECT *, {zone} AS zone FROM ({rows_sql})) AS x
        ASOF LEFT JOIN (SELECT zone, valid_from_ms, gco2e_per_kwh, toUInt8(1) AS found
                        FROM {db}.carbon_intensity_current) AS ci
        ON x.zone = ci.zone AND x.start_ms >= ci.valid_from_ms"""


def co2e_sql(db: str, rows_sql: str, keys: Sequence[str], sums: str = "") -> str:
    """Per `keys`: energy_kwh and co2e_kg of rows (cluster, start_ms, energy_j, ...) (intensity_join_sql).
    `sums`: more aggregates over the rows, SQL. The sums are exact (whole millijoules of energy and nanograms
    of carbon per row), so a figure does not change with the order the engine adds the rows
    in: a float sum over a job's hours differed in its last digits from one run of a report to the next."""
    key_list = ", ".join(keys)
    more = f", {sums}" if sums else ""
    return (f"SELECT {key_list}, {exact_sum('energy_j', 3, 3_600_000)} AS energy_kwh, "
            f"{exact_sum('co2e_g', 9, 1000)} AS co2e_kg{more} "
            f"FROM ({intensity_join_sql(db, rows_sql)}) GROUP BY {key_list}")


def exact_sum(column: str, decimals: int, divisor: int = 1) -> str:
    """SQL: the sum of a Float64 column divided by `divisor`, each value rounded to `decimals` places and
    added as a whole number (Int128): the same Float64 in any order of the rows."""
    return f"sum(toInt128(round({column} * {10 ** decimals}))) / {10 ** decimals * divisor}"


def show(client, database: str) -> dict[str, list[dict]]:
    db = quoted_database(database)
    return {
        "definition": _query(client, f"SELECT carbon_version, pue, default_gco2e_per_kwh, default_source, "
                                     f"toString(zones) AS zones, recorded_at FROM {db}.carbon_definitions "
                                     "ORDER BY recorded_at DESC LIMIT 1"),
        "intensity": _query(client, f"SELECT zone, fromUnixTimestamp64Milli(valid_from_ms, 'UTC') AS valid_from, "
                                    f"gco2e_per_kwh FROM {db}.carbon_intensity_current ORDER BY zone, valid_from_ms"),
    }


# --------------------------------------------------------------------------- CLI
def cmd_carbon(args) -> int:
    from gpuledger.cli import settings_from_args
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect, connect_readonly
    from gpuledger.warehouse.report_text import render

    settings = settings_from_args(args)
    if args.action == "load":
        if not args.file:
            raise SystemExit("usage: gpuledger carbon load FILE.csv")
        path = Path(args.file)
        carbon = load_ledger_config(settings.ledger_config).carbon
        rows = parse_intensity_csv(path.read_text(encoding="utf-8"), path.name, carbon.zones)
        zones = sorted({r["zone"] for r in rows})
        client = connect(settings)
        try:
            recorded = record_definition(client, settings.database, carbon)
            n = load_intensity(client, settings.database, rows, path.name)
            unread = unread_zones(client, settings.database, carbon, zones)
        finally:
            client.close()
        print(f"loaded {n} intensity value(s) for {', '.join(zones)}; carbon definition {carbon.version}"
              + (" recorded" if recorded else " (already recorded)"))
        if unread:
            print(f"gpuledger: warning: no cluster with usage takes its intensity from {', '.join(unread)} (a cluster's "
                  "zone is its name, or the one [carbon.zones] maps it to): those values price nothing until one "
                  "does", file=sys.stderr)
        return 0
    client = connect_readonly(settings)
    try:
        shown = show(client, settings.database)
    finally:
        client.close()
    for title, rows in shown.items():
        print(f"== {title}", file=sys.stdout)
        print(render(rows, args.format), end="")
    return 0


def register_cli(subparsers) -> Any:
    """`gpuledger carbon load|show` (called from gpuledger/cli.py's build_parser)."""
    help_text = "grid carbon intensity: load a CSV series (zone or cluster or region, valid_from, gco2e_per_kwh), show it"
    p = subparsers.add_parser("carbon", help=help_text, description=help_text + ". docs/carbon.md.")
    p.set_defaults(func=cmd_carbon)
    p.add_argument("action", choices=["load", "show"])
    p.add_argument("file", nargs="?", help="load: the CSV file")
    p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    p.add_argument("--warehouse", help="'chdb', 'chdb:/dir' or http(s)://host:port (default: GPULEDGER_WAREHOUSE)")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")
    return p
