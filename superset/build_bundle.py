"""Write the Superset bundle (superset/bundle/*.yaml) from the definitions below.

    .venv/bin/python superset/build_bundle.py      # rewrites superset/bundle/

The YAML under superset/bundle/ is what is imported (`gpuledger superset import`); this script is
how it is kept consistent: stable UUIDs (uuid5 of the names), dataset columns read from the
migrated schema (a throw-away chDB), every chart placed in its dashboard's `position` with
`meta.chartId`, native filters targeting datasets by UUID. Edit here, re-run, commit both.

Why one file: the definitions (datasets, charts, dashboards) and the writer that ties them together
(UUIDs, chart ids, filter scopes from the datasets' columns) are one artefact, read side by side.

Numbers read like the periodic reports': column headers and units from gpuledger.warehouse.periodic.columns,
raw tables rounded per column, axes titled with their units, money metrics, columns and axes in the
currency of the shipped ledger (gpuledger/ledger_defaults.toml), which `gpuledger superset import` rewrites
to the configured ledger's. The datasets whose rows span definition versions (CURRENCY_DATASETS: the bills,
idle waste, capacity) add money of one definition version's currency only: they carry a `currency` column
(the version's recorded currency, as `report bills`), their money has no fixed symbol, and the Currency
filter of the dashboards that show their money (the cockpit, the algorithm view: one currency, default the
ledger's) keeps those charts to one currency; tables and series group by `currency` too, so a row says its
currency. The filter reaches only the charts that show money: GPU-hours of every currency stay in theirs.
Reclaim suggestions record their own currency (RECORDED_CURRENCY_DATASETS): money without a symbol there too.
A ranking ranks whole things of one currency: the costliest jobs are (cluster, job, currency) summed over the
job's definition versions, not job_cost's rows (one per version).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import tomllib
import uuid
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from gpuledger.warehouse.periodic.columns import column as report_column  # noqa: E402  (headers and units: the same as the reports')
from gpuledger.integrations.superset import currency_column_sql  # noqa: E402  (the import rewrites it per warehouse)

BUNDLE = HERE / "bundle"
NS = uuid.UUID("5f0c6a52-8d8e-4a53-9a57-0b6c1d3a7e11")
DATABASE_NAME = "GPU Ledger"
DATABASE_FILE = "GPU_Ledger"
#: placeholder URI; `gpuledger superset import` replaces it (and each dataset's schema) from settings
PLACEHOLDER_URI = "clickhousedb:///gpuledger?interface=chdb&path=/path/to/chdb"
#: the currency of the shipped ledger: every money metric, column and axis is labelled with it
CURRENCY = tomllib.loads((HERE.parent / "gpuledger" / "ledger_defaults.toml").read_text())["currency"]
CURRENCY_FORMAT = {"symbol": CURRENCY, "symbolPosition": "suffix"}
#: datasets whose rows span definition versions of different currencies: a calculated `currency` column
#: (the version's recorded currency, else the ledger's) and money without a fixed symbol
CURRENCY_DATASETS = ("tenant_daily_bill", "job_cost", "job_cost_by_attempt", "idle_waste_daily", "capacity_daily")
#: datasets whose rows carry the currency they were priced in (a stored `currency` column): money without a
#: fixed symbol too (the watcher labels a suggestion's idle cost with its ledger's currency of the time)
RECORDED_CURRENCY_DATASETS = ("reclaim_suggestions_latest",)
#: datasets whose money is of each row's currency, never one fixed symbol
ROW_CURRENCY_DATASETS = CURRENCY_DATASETS + RECORDED_CURRENCY_DATASETS
#: d3 number format of a column of each unit (gpuledger.periodic.columns): numbers rounded for reading
D3_FORMAT = {"money": ",.2f", "gpu_hours": ",.2f", "seconds": ",.0f", "pct": ".1f", "ratio": ".1%", "count": ",d",
             "score": ".2f", "number": ",.1f"}


def uid(*parts: str) -> str:
    return str(uuid.uuid5(NS, "/".join(parts)))


# --------------------------------------------------------------------------- datasets and metrics
def m(name: str, expression: str, label: str | None = None, fmt: str | None = None, description: str | None = None,
      money: bool = False, of_money: bool = False) -> dict:
    """A metric; `money`: an amount, `of_money`: a ratio of amounts (an idle share). A Currency filter reaches
    the charts that show either; an amount carries the ledger's currency (in the label and Superset's currency
    format) unless its dataset's rows say their currency (ROW_CURRENCY_DATASETS: plain, see `metric_entry`)."""
    return {"metric_name": name, "expression": expression, "label": label, "d3format": fmt, "description": description,
            "money": money, "of_money": of_money}


def metric_entry(dataset: str, metric: dict) -> dict:
    """A metric as the dataset's YAML holds it: money with the ledger's symbol only where its dataset's money
    is all of one currency."""
    symbol = metric["money"] and dataset not in ROW_CURRENCY_DATASETS
    return {"metric_name": metric["metric_name"],
            "verbose_name": f"{metric['label']} ({CURRENCY})" if symbol else metric["label"], "metric_type": None,
            "expression": metric["expression"], "description": metric["description"], "d3format": metric["d3format"],
            "currency": CURRENCY_FORMAT if symbol else None, "extra": {}, "warning_text": None}


def shows_money(params: dict, metrics: list[dict]) -> bool:
    """Whether a chart shows money (an amount or a ratio of amounts): a Currency filter must hold it to one
    currency; a chart of GPU-hours alone keeps every currency's hours."""
    flags = {x["metric_name"]: x["money"] or x["of_money"] for x in metrics}
    shown = list(params.get("metrics") or []) + ([params["metric"]] if params.get("metric") else [])
    return any(flags.get(name) for name in shown) or any(
        report_column(col).unit == "money" for col in params.get("all_columns") or [])


LAYERS = {
    "scheduling_utilization": "sum(allocated_gpu_ms) / nullIf(sum(capacity_gpu_ms) - sum(down_gpu_ms), 0)",
    "execution_utilization": "sum(executing_gpu_ms) / nullIf(sum(allocated_gpu_ms), 0)",
    # utilization_hourly's util columns weight util_metric_pct, the [utilization] definition's (sql/0043), as the report
    "hardware_utilization": "sum(util_weighted_gpu_ms) / nullIf(sum(util_gpu_ms), 0) / 100",
}

#: the forecast's series of pending demand, which has no GPU model (gpuledger/warehouse/forecast.py)
FORECAST_PENDING = "(pending: any model)"
#: the forecast rows of the fleet's line: every GPU model's total, pending demand (no model) left out
FLEET_FORECAST = f"kind = 'forecast' AND queue = '*' AND gpu_model != '{FORECAST_PENDING}'"
#: metrics of the 5-minute load tables (per GPU and per node: the same columns)
LOAD_METRICS = [
    m("hardware_util_pct", "sum(util_weighted_gpu_ms) / nullIf(sum(util_gpu_ms), 0)", "Hardware utilization %", ".1f"),
    m("executing_gpus", "sum(executing_gpu_ms) / 300000", "Executing GPUs", ".2f"),
    m("idle_gpus", "sum(idle_gpu_ms) / 300000", "Allocated idle GPUs", ".2f"),
    m("unallocated_gpus", "sum(unallocated_gpu_ms) / 300000", "Unallocated GPUs", ".2f"),
    m("down_gpus", "sum(down_gpu_ms) / 300000", "Down GPUs", ".2f"),
]
#: table -> (description, main time column or None, metrics, tenant-scoped)
DATASETS: dict[str, tuple[str, str | None, list[dict], bool]] = {
    "gpu_current": ("Every GPU as of its last usage slice: state, job, tenant, queue", "last_seen", [
        m("gpus", "count()", "GPUs", ",d"),
    ], False),
    "gpu_load_5m": ("Per-GPU load history in 5-minute buckets", "ts", LOAD_METRICS, False),
    "node_load_5m": ("Per-node load history in 5-minute buckets (sums of the node's GPUs, sql/0024)", "ts",
                     LOAD_METRICS, False),
    "gpu_health_daily": ("Health record per GPU and day: down time, temperature, Xid errors", "day", [
        m("down_hours", "sum(down_seconds) / 3600", "Down hours", ".2f"),
        m("max_temperature", "max(max_temperature_c)", "Max temperature °C", ".1f"),
        m("xid_error_count", "sum(xid_count)", "Xid errors", ",d"),
    ], False),
    "gpu_health_samples": ("GPU health samples (temperature, power, Xid) per tick", "ts", [
        m("max_temperature", "max(temperature_c)", "Max temperature °C", ".1f"),
        m("xid_error_count", "sum(xid_count)", "Xid errors", ",d"),
    ], False),
    "job_util_histogram": ("Executing GPU-time per job attempt by 10-point utilization bucket", None, [
        m("gpu_hours", "sum(gpu_seconds) / 3600", "GPU-hours", ".3f"),
    ], True),
    "job_gpu_balance": ("Per job attempt and GPU: executing / idle time and utilization", None, [
        m("util_pct", "sum(util_weighted_gpu_ms) / nullIf(sum(util_gpu_ms), 0)", "Utilization %", ".1f"),
        m("executing_hours", "sum(executing_gpu_seconds) / 3600", "Executing GPU-hours", ".3f"),
        m("idle_hours", "sum(idle_gpu_seconds) / 3600", "Idle GPU-hours", ".3f"),
    ], True),
    "job_idle_stretches": ("Runs of allocated-but-not-executing time per job attempt and GPU", "stretch_start", [
        m("stretches", "count()", "Idle stretches", ",d"),
        m("idle_gpu_hours", "sum(idle_gpu_seconds) / 3600", "Idle GPU-hours", ".3f"),
    ], True),
    "job_cost_by_attempt": ("Job cost by attempt, GPU model and bill line", "day", [
        # a bill dataset (CURRENCY_DATASETS): one currency only under the algorithm view's Currency filter
        m("cost_sum", "sum(cost)", "Cost", ",.2f", money=True),
        m("gpu_hours_sum", "sum(gpu_hours)", "GPU-hours", ",.3f"),
        m("effective_gpu_hours_sum", "sum(effective_gpu_hours)", "Effective GPU-hours", ",.3f"),
        m("attempts", "uniqExact(attempt)", "Attempts", ",d"),
    ], True),
    "utilization_hourly": ("Ingredients of the three utilization layers per hour, cluster and GPU model", "hour", [
        *(m(k, v, k.replace("_", " ").capitalize(), ".1%") for k, v in LAYERS.items()),
        m("effective_gpu_hours", "sum(executing_effective_gpu_ms) / 3600000", "Effective GPU-hours (executing)", ",.1f"),
        m("cluster_idle_share", "sum(unallocated_gpu_ms) / nullIf(sum(capacity_gpu_ms), 0)", "Cluster idle (share of capacity)", ".1%"),
    ], False),
    "tenant_daily_bill": ("Tenant bill per day: compute / idle / failed-retry", "day", [
        # money of one currency only where the dashboard's Currency filter or a group by currency keeps it so
        m("compute_cost_sum", "sum(compute_cost)", "Compute", ",.2f", money=True),
        m("idle_cost_sum", "sum(idle_cost)", "Idle", ",.2f", money=True),
        m("failed_retry_cost_sum", "sum(failed_retry_cost)", "Failed retry", ",.2f", money=True),
        m("total_cost_sum", "sum(total_cost)", "Total cost", ",.2f", money=True),
        m("idle_share", "sum(idle_cost) / nullIf(sum(total_cost), 0)", "Idle share", ".1%", of_money=True),
        m("effective_gpu_hours", "sum(total_effective_gpu_hours)", "Effective GPU-hours", ",.1f"),
    ], True),
    # a row per definition version (sql/0050): its idle cost is of the row's currency
    "idle_waste_daily": ("Allocated-but-idle GPU-time and cost per day, queue, tenant and definition version", "day", [
        m("idle_gpu_hours_sum", "sum(idle_gpu_hours)", "Idle GPU-hours", ",.2f"),
        m("idle_cost_sum", "sum(idle_cost)", "Idle cost", ",.2f", money=True),
    ], True),
    "job_cost": ("Job cost over all attempts and GPUs, with queue waiting", "first_day", [
        # a job's sums over its rows (one per definition version: sql/0031); attempts are on one row only
        m("cost_sum", "sum(cost)", "Cost", ",.2f", money=True),
        m("job_attempts", "sum(attempts)", "Attempts", ",d"),
        m("job_gpu_hours", "sum(gpu_hours)", "GPU-hours", ",.2f"),
        m("job_effective_gpu_hours", "sum(effective_gpu_hours)", "Effective GPU-hours", ",.2f"),
        m("job_idle_gpu_hours", "sum(idle_gpu_hours)", "Idle GPU-hours", ",.2f"),
    ], True),
    # a row per definition version (sql/0004): its unallocated cost is of the row's currency
    "capacity_daily": ("Capacity per day and GPU model: down + unallocated + allocated idle + executing", "day", [
        m("unallocated_gpu_hours", "sum(unallocated_gpu_seconds) / 3600", "Unallocated GPU-hours", ",.2f"),
        m("unallocated_cost_sum", "sum(unallocated_cost)", "Unallocated cost", ",.2f", money=True),
        m("capacity_gpu_hours", "sum(capacity_gpu_seconds) / 3600", "Capacity GPU-hours", ",.1f"),
    ], False),
    "alerts_latest": ("Behaviour alerts (docs/alerts.md), one row per alert in its latest status", "opened_at", [
        m("alert_count", "count()", "Alerts", ",d"),
        m("open_alert_count", "countIf(status = 'open')", "Open alerts", ",d"),
    ], False),
    # each suggestion's idle cost in the currency it records (`currency`)
    "reclaim_suggestions_latest": ("Reclaim suggestions per queue (docs/alerts.md), latest status", "opened_at", [
        m("suggestion_count", "count()", "Suggestions", ",d"),
        m("named_idle_cost", "sum(idle_cost_micros) / 1e6", "Idle cost of the named jobs", ",.2f", money=True),
    ], False),
    "gpu_cards": ("GPU ID cards (docs/gpu-cards.md): identity, where it sat (cluster/node), first/last seen, repairs, "
                  "down time, Xid, flag (back from repair twice; one UUID on two nodes at once, sql/0048)",
                  "last_seen", [
        m("card_count", "count()", "GPUs", ",d"),
        # flag may hold two findings joined by "; " (sql/0048): count each
        m("flagged_count", "countIf(position(flag, 'suggest lower-priority work') > 0)",
          "Suggested for lower-priority work", ",d"),
        m("at_once_count", "countIf(position(flag, 'nodes at once') > 0)", "Reported by two nodes at once", ",d"),
    ], False),
    "gpu_card_monthly": ("GPU ID card by month: temperature, utilization, power, Xid errors", "month", [
        m("card_avg_temperature", "avg(avg_temperature_c)", "Mean temperature °C", ".1f"),
        m("card_avg_util", "avg(avg_util_pct)", "Mean utilization %", ".1f"),
    ], False),
    "tenant_daily_carbon": ("Carbon of tenants' jobs per day (docs/carbon.md): energy x PUE x grid intensity", "day", [
        m("co2e_kg_sum", "sum(co2e_kg)", "kg CO2e", ",.2f"),
        m("energy_kwh_sum", "sum(energy_kwh)", "GPU energy kWh", ",.1f"),
    ], False),
    # the latest `gpuledger forecast run` (docs/planning.md): every GPU model's total (queue '*'), pending
    # demand (no model) left out of the fleet's line
    "capacity_forecast_latest": ("Capacity forecast (docs/planning.md): daily demand history and next quarter's "
                                 "forecast with its 80 % band, against capacity", "day", [
        m("fleet_demand", f"sumIf(demand_gpu_hours, queue = '*' AND gpu_model != '{FORECAST_PENDING}')",
          "Demand GPU-hours", ",.0f"),
        # none, not 0, on a history day: a line at 0 under the history is no band (as the forecast report)
        m("fleet_demand_lower", f"if(countIf({FLEET_FORECAST}) = 0, NULL, sumIf(lower_gpu_hours, {FLEET_FORECAST}))",
          "Band low GPU-hours", ",.0f"),
        m("fleet_demand_upper", f"if(countIf({FLEET_FORECAST}) = 0, NULL, sumIf(upper_gpu_hours, {FLEET_FORECAST}))",
          "Band high GPU-hours", ",.0f"),
        m("fleet_capacity", f"sumIf(capacity_gpu_hours, queue = '*' AND gpu_model != '{FORECAST_PENDING}')",
          "Capacity GPU-hours", ",.0f"),
    ], False),
}
#: datasets of the algorithm view: every tenant sees only its own rows there (row-level security)
TENANT_SCOPED = [name for name, (_, _, _, scoped) in DATASETS.items() if scoped]


# --------------------------------------------------------------------------- charts
def axes(x_title: str, y_title: str, money: bool = False) -> dict:
    """Axis titles (with units) of an ECharts chart; money axes and tooltips in the ledger's currency."""
    params = {"x_axis_title": x_title, "x_axis_title_margin": 30, "y_axis_title": y_title, "y_axis_title_margin": 50,
              "y_axis_title_position": "Left"}
    return {**params, "currency_format": CURRENCY_FORMAT} if money else params


def ts_chart(viz: str, x: str, grain: str | None, metrics: list[str], groupby=(), fmt=None, **extra) -> dict:
    """A time series; `grain` None on a Date x-axis (a day or a month already): Superset's grains cast the
    column with toDateTime(), which puts a Date at the server's midnight, not the UTC day's."""
    params = {"viz_type": viz, "x_axis": x, "time_grain_sqla": grain, "metrics": metrics, "groupby": list(groupby),
              "adhoc_filters": [], "row_limit": 10000, "show_legend": True, "legendOrientation": "top",
              "rich_tooltip": True, "x_axis_time_format": "smart_date", "truncateYAxis": False,
              "order_desc": True, "comparison_type": "values", "annotation_layers": [], "sort_series_type": "sum"}
    if fmt:
        params["y_axis_format"] = fmt
    params.update(extra)
    return params


def bar_chart(x: str, metrics: list[str], groupby=(), stack=False, fmt=None, **extra) -> dict:
    params = {"viz_type": "echarts_timeseries_bar", "x_axis": x, "metrics": metrics, "groupby": list(groupby),
              "adhoc_filters": [], "row_limit": 10000, "show_legend": True, "legendOrientation": "top",
              "rich_tooltip": True, "orientation": "vertical", "x_axis_sort_asc": True, "x_axis_sort_series": "name",
              "x_axis_sort_series_ascending": True, "order_desc": True, "truncateYAxis": False,
              "stack": "Stack" if stack else None, "comparison_type": "values", "annotation_layers": []}
    if fmt:
        params["y_axis_format"] = fmt
    params.update(extra)
    return params


def column_config(columns: list[str], symbol: bool = True) -> dict:
    """Per-column number formats of a raw table: rounded for reading, money with its currency (unless `symbol`
    is False: a bill dataset's rows, whose currency the dashboard's Currency filter picks)."""
    config = {}
    for name in columns:
        unit = report_column(name).unit
        if unit in D3_FORMAT:
            config[name] = {"d3NumberFormat": D3_FORMAT[unit],
                            **({"currencyFormat": CURRENCY_FORMAT} if unit == "money" and symbol else {})}
    return config


def table_raw(columns: list[str], order_by: tuple[str, bool], limit: int, symbol: bool = True) -> dict:
    return {"viz_type": "table", "query_mode": "raw", "all_columns": columns, "groupby": [], "metrics": [],
            "percent_metrics": [], "order_by_cols": [f'["{order_by[0]}", {str(order_by[1]).lower()}]'],
            "adhoc_filters": [], "row_limit": limit, "server_pagination": False, "table_timestamp_format": "smart_date",
            "include_search": True, "show_cell_bars": True, "color_pn": True, "column_config": column_config(columns, symbol)}


def table_agg(groupby: list[str], metrics: list[str], sort_by: str, limit: int) -> dict:
    return {"viz_type": "table", "query_mode": "aggregate", "groupby": groupby, "metrics": metrics, "all_columns": [],
            "percent_metrics": [], "timeseries_limit_metric": sort_by, "order_desc": True, "adhoc_filters": [],
            "row_limit": limit, "server_pagination": False, "table_timestamp_format": "smart_date",
            "include_search": False, "show_cell_bars": True, "color_pn": True}


def big_number(metric: str, fmt: str, subheader: str, money: bool = False) -> dict:
    params = {"viz_type": "big_number_total", "metric": metric, "adhoc_filters": [], "header_font_size": 0.3,
              "subheader_font_size": 0.125, "y_axis_format": fmt, "time_format": "smart_date", "subheader": subheader}
    return {**params, "currency_format": CURRENCY_FORMAT} if money else params


def pie(groupby: list[str], metric: str) -> dict:
    return {"viz_type": "pie", "groupby": groupby, "metric": metric, "adhoc_filters": [], "row_limit": 100,
            "sort_by_metric": True, "show_labels": True, "labels_outside": True, "label_type": "key_value",
            "show_legend": True, "legendOrientation": "top", "donut": True, "number_format": "SMART_NUMBER"}


#: a native filter that always holds one currency, the ledger's unless picked (the import writes the configured one)
ONE_CURRENCY = {"controlValues": {"enableEmptyFilter": True, "defaultToFirstItem": False, "multiSelect": False,
                                  "searchAllOptions": False, "inverseSelection": False},
                "defaultDataMask": {"extraFormData": {"filters": [{"col": "currency", "op": "IN", "val": [CURRENCY]}]},
                                    "filterState": {"value": [CURRENCY], "label": CURRENCY}, "ownState": {}}}

#: dashboard -> (title, slug, description, filters [(column, label, dataset[, overrides])], rows of (chart key, title,
#: dataset, params, width))
#: a node is (cluster, node): two clusters may both have a node001, so the operations charts and tables that list
#: nodes group by and show both, and its Node filter lists the nodes of the clusters the Cluster filter picks
DASHBOARDS = {
    "operations": (
        "GPU Ledger — Operations", "gpuledger-operations",
        "Every GPU with its current job and tenant, its load history and its health record; behaviour alerts "
        "and reclaim suggestions.",
        [("cluster", "Cluster", "gpu_current"),
         ("node", "Node", "gpu_current", {"cascadeParentIds": ["NATIVE_FILTER-operations-cluster"]}),
         ("gpu_model", "GPU model", "gpu_current"),
         ("queue", "Queue", "gpu_current"), ("gpu_uuid", "GPU", "gpu_current")],
        [
            [("gpu_states_now", "GPUs by state (now)", "gpu_current", pie(["state"], "gpus"), 4),
             ("gpus_now", "Every GPU: current job and tenant", "gpu_current",
              table_raw(["cluster", "node", "gpu_uuid", "gpu_model", "state", "job_id", "tenant", "queue", "jobs",
                         "util_pct", "last_seen"], ("node", True), 1000), 8)],
            [("gpu_load_by_node", "Load history: hardware utilization % by cluster and node", "node_load_5m",
              ts_chart("echarts_timeseries_line", "ts", "PT5M", ["hardware_util_pct"], ["cluster", "node"], ".0f",
                       **axes("Time (UTC)", "Hardware utilization (%)")), 6),
             ("gpu_states_history", "GPU states over time (GPUs)", "gpu_load_5m",
              ts_chart("echarts_area", "ts", "PT5M", ["executing_gpus", "idle_gpus", "unallocated_gpus", "down_gpus"],
                       stack="Stack", y_axis_format=".1f", **axes("Time (UTC)", "GPUs")), 6)],
            [("gpu_health_record", "Health record per GPU (down time, temperature, Xid)", "gpu_health_daily",
              table_agg(["cluster", "node", "gpu_uuid", "gpu_model"], ["down_hours", "max_temperature", "xid_error_count"],
                        "down_hours", 1000), 6),
             ("gpu_temperature", "Temperature: max by cluster and node (°C)", "gpu_health_samples",
              ts_chart("echarts_timeseries_line", "ts", "PT5M", ["max_temperature"], ["cluster", "node"], ".0f",
                       **axes("Time (UTC)", "Temperature (°C)")), 6)],
            [("alerts", "Behaviour alerts: drops, low use, stragglers, hangs, GPUs down (latest status)", "alerts_latest",
              table_raw(["opened_at", "closed_at", "status", "rule", "job_id", "tenant", "queue", "gpus", "open_minutes",
                         "message"], ("opened_at", False), 500), 7),
             ("reclaim_suggestions", "Reclaim suggestions per queue", "reclaim_suggestions_latest",
              table_raw(["opened_at", "withdrawn_at", "status", "queue", "execution_rate", "job_ids", "gpus_freed",
                         "waiting_gpus", "waiting_priority", "message"], ("opened_at", False), 200), 5)],
            # the GPU filter above picks one GPU's card: both charts carry gpu_uuid; a card names the cluster and
            # node it was last seen on (the Cluster and Node filters reach it) and every cluster/node it sat in
            [("gpu_cards", "GPU ID cards (pick a GPU with the GPU filter; `gpuledger report gpu UUID` prints it)",
              "gpu_cards", table_raw(["cluster", "node", "gpu_uuid", "gpu_model", "serial", "board_part_number",
                                      "vbios_version", "first_seen", "last_seen", "nodes", "placements", "repairs",
                                      "last_repaired", "flag", "down_seconds", "xid_errors", "max_temperature_c"],
                                     ("repairs", False), 1000), 7),
             ("gpu_card_monthly", "GPU ID card: temperature and utilization by month", "gpu_card_monthly",
              ts_chart("echarts_timeseries_line", "month", None, ["card_avg_temperature", "card_avg_util"], fmt=".0f",
                       **axes("Month (UTC)", "°C / %")), 5)],
        ],
    ),
    "algorithm": (
        "GPU Ledger — Algorithm (job health)", "gpuledger-algorithm",
        "Per job: utilization distribution, balance across its GPUs, idle stretches, cost by GPU model and attempt. "
        "Pick a tenant, a cluster and a job (a job id in two clusters is two jobs). Money is in the currency the "
        "Currency filter picks (the ledger's unless picked): never two currencies in one total.",
        # a job is (cluster, job id), as in the reports: schedulers number jobs per cluster; a GPU is (cluster,
        # node, GPU), so the GPU charts split their bars by cluster (two clusters may share a node name and a
        # GPU label: the old agents' GPU-unreadable-<index> placeholder is the same everywhere); within a
        # cluster the `gpu` label is one GPU's (node/8 characters of the UUID, the whole UUID where two GPUs of
        # the node share those: sql/0050)
        [("tenant", "Tenant", "job_cost_by_attempt"), ("cluster", "Cluster", "job_cost_by_attempt"),
         ("job_id", "Job", "job_cost_by_attempt", {"cascadeParentIds": ["NATIVE_FILTER-algorithm-cluster"]}),
         ("currency", "Currency", "job_cost_by_attempt", ONE_CURRENCY)],
        [
            [("job_list", "Jobs: cost and attempts", "job_cost_by_attempt",
              table_agg(["cluster", "tenant", "job_id", "currency"], ["cost_sum", "gpu_hours_sum", "attempts"],
                        "cost_sum", 500), 5),
             ("job_util_distribution", "Utilization distribution (executing GPU-hours by utilization)", "job_util_histogram",
              bar_chart("util_bucket", ["gpu_hours"], fmt=",.2f", **axes("Utilization bucket", "GPU-hours")), 7)],
            [("job_gpu_balance", "Balance across the job's GPUs (utilization % per GPU)", "job_gpu_balance",
              bar_chart("gpu", ["util_pct"], ["cluster"], fmt=".0f", row_limit=64,
                        **axes("GPU (node/UUID)", "Utilization (%)")), 6),
             # side by side, not stacked: a stack would pile two clusters' GPUs of one label into one bar
             ("job_gpu_time", "Executing vs idle GPU-hours per GPU", "job_gpu_balance",
              bar_chart("gpu", ["executing_hours", "idle_hours"], ["cluster"], fmt=",.2f", row_limit=64,
                        **axes("GPU (node/UUID)", "GPU-hours")), 6)],
            [("job_idle_stretches", "Idle stretches (longest first)", "job_idle_stretches",
              table_raw(["cluster", "job_id", "attempt", "node", "gpu_uuid", "stretch_start", "duration_seconds",
                         "idle_gpu_seconds"],
                        ("duration_seconds", False), 200), 6),
             ("job_cost_by_model_attempt", "Cost by attempt and GPU model", "job_cost_by_attempt",
              bar_chart("attempt_label", ["cost_sum"], ["gpu_model", "currency"], stack=True, fmt=",.2f",
                        **axes("Attempt", "Cost (in the Currency filter's currency)")), 6)],
            [("job_cost_by_line", "Cost by bill line (compute / idle / failed retry)", "job_cost_by_attempt",
              pie(["line"], "cost_sum"), 12)],
        ],
    ),
    "cockpit": (
        "GPU Ledger — Management cockpit", "gpuledger-cockpit",
        "Effective GPU-hours, the three utilization layers, cost by tenant, idle waste, the costliest jobs, cluster idle. "
        "Money is in the currency the Currency filter picks (the ledger's unless picked): never two currencies in one total.",
        [("tenant", "Tenant", "tenant_daily_bill"), ("currency", "Currency", "tenant_daily_bill", ONE_CURRENCY)],
        [
            [("effective_gpu_hours", "Effective GPU-hours delivered", "utilization_hourly",
              big_number("effective_gpu_hours", ",.1f", "GPU-hours executing, in baseline-card hours"), 3),
             ("cluster_idle_share", "Cluster idle", "utilization_hourly",
              big_number("cluster_idle_share", ".1%", "unallocated share of capacity"), 3),
             ("total_cost", "Billed cost", "tenant_daily_bill",
              big_number("total_cost_sum", ",.2f", "compute + idle + failed retry, in the Currency filter's currency"), 3),
             ("idle_share", "Idle share of the bill", "tenant_daily_bill", big_number("idle_share", ".1%", "allocated but not executing"), 3)],
            [("utilization_layers", "Three utilization layers (scheduling, execution, hardware)", "utilization_hourly",
              ts_chart("echarts_timeseries_line", "hour", "PT1H", list(LAYERS), fmt=".0%", y_axis_bounds=[0, 1],
                       **axes("Hour (UTC)", "Utilization (%)")), 12)],
            [("tenant_cost_split", "Cost by tenant: compute / idle / failed retry", "tenant_daily_bill",
              bar_chart("tenant", ["compute_cost_sum", "idle_cost_sum", "failed_retry_cost_sum"], ["currency"], stack=True,
                        fmt=",.0f", **axes("Tenant", "Cost (in the Currency filter's currency)")), 6),
             ("idle_waste_by_queue", "Idle waste by queue (GPU-hours)", "idle_waste_daily",
              bar_chart("queue", ["idle_gpu_hours_sum"], ["tenant"], stack=True, fmt=",.1f",
                        **axes("Queue", "Idle GPU-hours")), 6)],
            # whole jobs: job_cost has a row per definition version, so the table sums a job's rows (an aggregate
            # table, which may group by the calculated currency column; a raw one cannot list it: Superset 6.1
            # selects it as a literal name, which ClickHouse does not know)
            [("top_costly_jobs", "Top-10 costly jobs", "job_cost",
              table_agg(["cluster", "job_id", "tenant", "queue", "currency"],
                        ["cost_sum", "job_attempts", "job_gpu_hours", "job_effective_gpu_hours", "job_idle_gpu_hours"],
                        "cost_sum", 10), 7),
             ("cluster_idle_by_model", "Cluster idle (unallocated GPU-hours) by GPU model", "capacity_daily",
              bar_chart("gpu_model", ["unallocated_gpu_hours"], fmt=",.1f",
                        **axes("GPU model", "Unallocated GPU-hours")), 5)],
            [("tenant_carbon", "Carbon by tenant (kg CO2e; docs/carbon.md)", "tenant_daily_carbon",
              bar_chart("tenant", ["co2e_kg_sum"], fmt=",.1f", **axes("Tenant", "kg CO2e")), 12)],
            [("capacity_forecast", "Capacity forecast: demand, next quarter's 80 % band, capacity (GPU-hours a day; "
              "gpuledger forecast run)", "capacity_forecast_latest",
              ts_chart("echarts_timeseries_line", "day", None, ["fleet_demand", "fleet_demand_lower", "fleet_demand_upper",
                                                                 "fleet_capacity"], fmt=",.0f",
                       **axes("Day (UTC)", "GPU-hours")), 12)],
            [("tenant_ranking", "Tenant ranking", "tenant_daily_bill",
              table_agg(["tenant", "currency"], ["total_cost_sum", "compute_cost_sum", "idle_cost_sum", "failed_retry_cost_sum",
                                                 "idle_share", "effective_gpu_hours"], "total_cost_sum", 100), 12)],
        ],
    ),
}


# --------------------------------------------------------------------------- writing
def _ch_type_is_dttm(ch_type: str) -> bool:
    base = ch_type.replace("Nullable(", "").replace("LowCardinality(", "")
    return base.startswith(("Date", "DateTime"))


def describe_views() -> dict[str, list[tuple[str, str]]]:
    """Column names and types of every dataset, from a throw-away chDB migrated with the packaged migrations."""
    sys.path.insert(0, str(HERE.parent))
    from gpuledger.config import Settings
    from gpuledger.warehouse import connect, migrate

    tmp = Path(tempfile.mkdtemp(prefix="gpuledger-bundle-"))
    try:
        settings = Settings(warehouse=f"chdb:{tmp / 'chdb'}", data_dir=tmp)
        client = connect(settings)
        try:
            migrate(client, settings.database)
            described = {name: [(r[0], r[1]) for r in client.query(f"DESCRIBE TABLE `{name}`").result_rows] for name in DATASETS}
            for name in CURRENCY_DATASETS:
                described[name].append(("currency", "String"))  # calculated by Superset (dataset_columns)
            return described
        finally:
            client.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dataset_columns(name: str, columns: list[tuple[str, str]]) -> list[dict]:
    """A dataset's columns; a bill dataset's `currency` is calculated (each row's definition version's currency)
    and the money headers of a dataset whose rows say their currency name none."""
    currency = "" if name in ROW_CURRENCY_DATASETS else CURRENCY
    out = []
    for col, typ in columns:
        calculated = name in CURRENCY_DATASETS and col == "currency"
        out.append({"column_name": col, "verbose_name": "Currency" if calculated else report_column(col).header(currency),
                    "is_dttm": _ch_type_is_dttm(typ), "is_active": True,
                    "type": typ, "advanced_data_type": None, "groupby": True, "filterable": True,
                    "expression": currency_column_sql("gpuledger", CURRENCY) if calculated else None,
                    "description": ("the currency of the row's definition version, as recorded (`gpuledger migrate`), "
                                    "else the ledger's" if calculated else None),
                    "python_date_format": None, "extra": {}})
    return out


def dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120), encoding="utf-8")


def build(out: Path = BUNDLE) -> None:
    columns = describe_views()
    if out.exists():
        shutil.rmtree(out)
    db_uuid = uid("database", DATABASE_NAME)
    dump(out / "metadata.yaml", {"version": "1.0.0", "type": "assets", "timestamp": "2026-11-30T00:00:00+00:00"})
    dump(out / "databases" / f"{DATABASE_FILE}.yaml", {
        "database_name": DATABASE_NAME, "sqlalchemy_uri": PLACEHOLDER_URI, "cache_timeout": None,
        "expose_in_sqllab": True, "allow_run_async": False, "allow_ctas": False, "allow_cvas": False,
        "allow_dml": False, "allow_file_upload": False, "extra": {"allows_virtual_table_explore": True},
        "uuid": db_uuid, "version": "1.0.0",
    })
    for name, (description, dttm, metrics, _) in DATASETS.items():
        clash = {x["metric_name"] for x in metrics} & {c for c, _ in columns[name]}
        if clash:  # ClickHouse would resolve the column to the metric's alias: nested aggregates
            raise SystemExit(f"{name}: metric names equal to column names: {sorted(clash)}")
        dump(out / "datasets" / DATABASE_FILE / f"{name}.yaml", {
            "table_name": name, "main_dttm_col": dttm, "description": description, "default_endpoint": None,
            "offset": 0, "cache_timeout": None, "schema": "gpuledger", "sql": None, "params": None,
            "template_params": None, "filter_select_enabled": True, "fetch_values_predicate": None, "extra": None,
            "normalize_columns": False, "always_filter_main_dttm": False, "uuid": uid("dataset", name),
            "metrics": [metric_entry(name, x) for x in metrics],
            "columns": dataset_columns(name, columns[name]),
            "version": "1.0.0", "database_uuid": db_uuid,
        })
    for dash_key, (title, slug, description, filters, rows) in DASHBOARDS.items():
        position: dict = {
            "DASHBOARD_VERSION_KEY": "v2",
            "ROOT_ID": {"type": "ROOT", "id": "ROOT_ID", "children": ["GRID_ID"]},
            "GRID_ID": {"type": "GRID", "id": "GRID_ID", "children": [], "parents": ["ROOT_ID"]},
            "HEADER_ID": {"type": "HEADER", "id": "HEADER_ID", "meta": {"text": title}},
        }
        chart_ids: dict[str, tuple[int, str, bool]] = {}
        next_id = 1
        for r, row in enumerate(rows):
            row_id = f"ROW-{dash_key}-{r}"
            position["GRID_ID"]["children"].append(row_id)
            position[row_id] = {"type": "ROW", "id": row_id, "children": [], "parents": ["ROOT_ID", "GRID_ID"],
                                "meta": {"background": "BACKGROUND_TRANSPARENT"}}
            for key, chart_title, dataset, params, width in row:
                chart_uuid = uid("chart", dash_key, key)
                chart_ids[key] = (next_id, dataset, shows_money(params, DATASETS[dataset][2]))
                cid = f"CHART-{dash_key}-{key}"
                position[row_id]["children"].append(cid)
                big = params["viz_type"] == "big_number_total"
                position[cid] = {"type": "CHART", "id": cid, "children": [], "parents": ["ROOT_ID", "GRID_ID", row_id],
                                 "meta": {"chartId": next_id, "uuid": chart_uuid, "width": width,
                                          "height": 30 if big else 60, "sliceName": chart_title}}
                next_id += 1
                dump(out / "charts" / f"{dash_key}__{key}.yaml", {
                    "slice_name": chart_title, "description": None, "certified_by": None, "certification_details": None,
                    "viz_type": params["viz_type"], "params": {**params, "datasource": "", "slice_id": None},
                    "query_context": None, "cache_timeout": None, "uuid": chart_uuid, "version": "1.0.0",
                    "dataset_uuid": uid("dataset", dataset),
                })
        native = []
        for column, label, dataset, *overrides in filters:
            columns_of = {name: {c for c, _ in columns[name]} for name in DATASETS}
            # a Currency filter holds money to one currency: the charts without money keep every currency's rows
            reached = {i for i, ds, money in chart_ids.values()
                       if column in columns_of[ds] and (money or column != "currency")}
            excluded = sorted(i for i, _, _ in chart_ids.values() if i not in reached)
            native.append({
                "id": f"NATIVE_FILTER-{dash_key}-{column}", "name": label, "filterType": "filter_select",
                "targets": [{"datasetUuid": uid("dataset", dataset), "column": {"name": column}}],
                "defaultDataMask": {"extraFormData": {}, "filterState": {}, "ownState": {}},
                "controlValues": {"enableEmptyFilter": False, "defaultToFirstItem": False, "multiSelect": True,
                                  "searchAllOptions": False, "inverseSelection": False},
                "cascadeParentIds": [], "scope": {"rootPath": ["ROOT_ID"], "excluded": excluded},
                "type": "NATIVE_FILTER", "description": "", "chartsInScope": sorted(reached),
                **(overrides[0] if overrides else {}),
            })
        dump(out / "dashboards" / f"{dash_key}.yaml", {
            "dashboard_title": title, "description": description, "css": "", "slug": slug,
            "certified_by": None, "certification_details": None, "published": True,
            "uuid": uid("dashboard", dash_key), "position": position,
            "metadata": {"native_filter_configuration": native, "color_scheme": "supersetColors",
                         "refresh_frequency": 0, "expanded_slices": {}, "label_colors": {},
                         "timed_refresh_immune_slices": [], "cross_filters_enabled": False,
                         "default_filters": "{}", "chart_configuration": {}, "global_chart_configuration": {
                             "scope": {"rootPath": ["ROOT_ID"], "excluded": []}, "chartsInScope": []}},
            "version": "1.0.0",
        })


if __name__ == "__main__":
    build()
    print(f"wrote {BUNDLE}")
