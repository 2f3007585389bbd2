"""The cockpit's numbers agree with the reports without Superset: the bundle's dataset SQL (columns and
metric expressions of superset/bundle/, as Superset would send them) run on a real chDB warehouse.

* Hardware utilization follows the [utilization] definition (docs/accounting.md §2): utilization_hourly
  weights util_metric_pct (sql/0043), as `report utilization` does, not the measured util_pct. Under
  above_threshold (50 %), g1 at 40 % (metric 0) and g2 at 90 % (metric 100) for an hour each: 0.5, where
  the measured mean is 0.65. sql/0043 back-fills the hours already stored, once.
* Money is never added across currencies: definition d1 in USD and d2 in EUR, one GPU-hour each at
  3,600 micros (0.0036). The bill dataset's calculated `currency` column gives each row its version's
  currency, the cockpit's money charts keep to one currency (Currency filter, group by currency), and
  `gpuledger superset import` labels money with the configured ledger's currency.
* A day is a UTC day on a server in any time zone: Superset's time grains cast a column with
  `toDateTime(col)`, which puts a Date at the server's midnight (Europe/Berlin: the evening before, in
  UTC), so a chart whose x-axis is a Date column (a day or a month already) has no time grain. The
  forecast chart's band is none on history days, not a line at 0.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from gpuledger.config import Settings
from gpuledger.integrations.superset import bundle_charts, import_bundle, load_bundle
from gpuledger.warehouse import migrations, reports

from warehouse_helpers import migrated_warehouse, put_usage, usage_record, warehouse_before

pytestmark = pytest.mark.integration

BUNDLE = Path(__file__).resolve().parents[2] / "superset" / "bundle"
DB = "cockpit_numbers"
H = 3_600_000
T0 = 1_709_251_200_000  # 2024-03-01 00:00 UTC


def dataset(name: str) -> dict:
    return yaml.safe_load((BUNDLE / "datasets" / "GPU_Ledger" / f"{name}.yaml").read_text(encoding="utf-8"))


def chart(key: str) -> dict:
    return yaml.safe_load((BUNDLE / "charts" / f"{key}.yaml").read_text(encoding="utf-8"))


def metric(ds: dict, name: str) -> str:
    return {m["metric_name"]: m["expression"] for m in ds["metrics"]}[name]


def column_sql(ds: dict, name: str) -> str:
    """A dataset column as Superset selects it: its expression (schema as the import sets it) or its name."""
    col = {c["column_name"]: c for c in ds["columns"]}[name]
    return (col["expression"] or name).replace("`gpuledger`.", f"`{DB}`.")


# --------------------------------------------------------------------------- hardware utilization
def busy(gpu: str, util: float, metric_pct: float):
    """An hour executing at `util` % measured, `metric_pct` under the definition (as the worker writes it)."""
    rec = usage_record("c1", gpu, T0, T0 + H, "executing", job="j1", tenant="t1")
    return rec.model_copy(update={"util_pct": util, "util_metric_pct": metric_pct})


ABOVE_THRESHOLD = [busy("g1", 40.0, 0.0), busy("g2", 90.0, 100.0)]


def cockpit_hardware_utilization(client) -> float:
    expr = metric(dataset("utilization_hourly"), "hardware_utilization")
    return client.query(f"SELECT {expr} FROM {DB}.utilization_hourly").result_rows[0][0]


def test_cockpit_hardware_utilization_follows_the_definition(tmp_path):
    layers = chart("cockpit__utilization_layers")
    assert "hardware_utilization" in layers["params"]["metrics"]
    assert layers["dataset_uuid"] == dataset("utilization_hourly")["uuid"]
    with migrated_warehouse(tmp_path, DB) as (client, _):
        put_usage(client, DB, ABOVE_THRESHOLD, 0)
        (report,) = reports.fetch(client, DB, "utilization")
        assert report["hardware_utilization"] == pytest.approx(0.5)
        assert cockpit_hardware_utilization(client) == pytest.approx(report["hardware_utilization"])


def test_0043_back_fills_the_stored_hours_once():
    client = warehouse_before("0043", DB, prefix="cockpit-util-")
    try:
        put_usage(client, DB, ABOVE_THRESHOLD, 0)
        assert migrations.migrate(client, DB)[0] == "0043"

        def sums():
            return client.query(f"SELECT sum(gpu_ms), sum(util_weighted_gpu_ms), sum(util_metric_weighted_gpu_ms), "
                                f"sum(util_metric_gpu_ms) FROM {DB}.usage_gpu_hourly").result_rows[0]

        assert sums() == (2 * H, (40 + 90) * H, 100 * H, 2 * H)
        assert cockpit_hardware_utilization(client) == pytest.approx(0.5)
        client.command(f"DELETE FROM {DB}.{migrations.MIGRATIONS_TABLE} WHERE version = '0043'")
        assert migrations.migrate(client, DB) == ["0043"]
        assert sums() == (2 * H, (40 + 90) * H, 100 * H, 2 * H)  # run again: nothing added
        put_usage(client, DB, [busy("g3", 60.0, 100.0)], 1)
        assert sums() == (3 * H, (40 + 90 + 60) * H, 200 * H, 3 * H)  # new records through the view
        assert cockpit_hardware_utilization(client) == pytest.approx(2 / 3)
    finally:
        client.close()


# --------------------------------------------------------------------------- money per currency
def two_currencies(client) -> None:
    client.insert("definitions", [["d1", "f1", json.dumps({"currency": "USD"})], ["d2", "f2", json.dumps({"currency": "EUR"})]],
                  column_names=["definition_version", "fingerprint", "content"], database=DB)
    usd = usage_record("c1", "g1", T0, T0 + H, "executing", job="j1", tenant="t1")
    eur = usage_record("c1", "g2", T0, T0 + H, "executing", job="j2", tenant="t1").model_copy(
        update={"definition_version": "d2"})
    unrecorded = usage_record("c1", "g3", T0, T0 + H, "executing", job="j3", tenant="t2").model_copy(
        update={"definition_version": "d3"})  # a version recorded without a currency: the ledger's
    put_usage(client, DB, [usd, eur, unrecorded], 0)


def cockpit() -> dict:
    return yaml.safe_load((BUNDLE / "dashboards" / "cockpit.yaml").read_text(encoding="utf-8"))


def default_filters(ds: dict) -> str:
    """The WHERE of the cockpit's native filters at their defaults, on dataset `ds` (Superset's extraFormData)."""
    columns = {c["column_name"] for c in ds["columns"]}
    conds = ["1"]
    for flt in cockpit()["metadata"]["native_filter_configuration"]:
        for f in flt["defaultDataMask"]["extraFormData"].get("filters", []):
            if f["col"] in columns:
                assert f["op"] == "IN"
                conds.append(f"{column_sql(ds, f['col'])} IN ({', '.join(repr(v) for v in f['val'])})")
    return " AND ".join(conds)


def test_billed_cost_is_one_currency_as_report_bills(tmp_path):
    bill = dataset("tenant_daily_bill")
    with migrated_warehouse(tmp_path, DB) as (client, _):
        two_currencies(client)
        want: dict[tuple[str, str], float] = {}
        for r in reports.fetch(client, DB, "bills", currency="USD"):
            want[(r["tenant"], r["currency"])] = want.get((r["tenant"], r["currency"]), 0.0) + r["total_cost"]
        assert want == pytest.approx({("t1", "USD"): 0.0036, ("t1", "EUR"): 0.0036, ("t2", "USD"): 0.0036})
        # 'Billed cost' as the cockpit opens: its filters at their defaults (the ledger's currency, USD)
        big = chart("cockpit__total_cost")["params"]
        (got,) = client.query(f"SELECT {metric(bill, big['metric'])} FROM {DB}.tenant_daily_bill "
                              f"WHERE {default_filters(bill)}").result_rows[0]
        assert got == pytest.approx(want[("t1", "USD")] + want[("t2", "USD")])
        # no fixed currency on money that may be another one: the filter says which
        assert not big.get("currency_format") and "USD" not in big["subheader"]
        assert all(m["currency"] is None for m in bill["metrics"])
        # the filter always holds one currency and reaches every money chart of the cockpit
        (flt,) = [f for f in cockpit()["metadata"]["native_filter_configuration"] if f["name"] == "Currency"]
        assert flt["controlValues"]["enableEmptyFilter"] and not flt["controlValues"]["multiSelect"]
        ids = {n["meta"]["sliceName"]: n["meta"]["chartId"] for n in cockpit()["position"].values()
               if isinstance(n, dict) and n.get("type") == "CHART"}
        for title in ("Billed cost", "Idle share of the bill", "Cost by tenant: compute / idle / failed retry",
                      "Tenant ranking", "Top-10 costly jobs"):
            assert ids[title] in flt["chartsInScope"], title
        # a raw table lists no calculated column: Superset 6.1 selects it as a literal name, unknown to ClickHouse
        calculated = {d["uuid"]: {c["column_name"] for c in d["columns"] if c["expression"]}
                      for d in map(dataset, ("tenant_daily_bill", "job_cost"))}
        for path in (BUNDLE / "charts").glob("*.yaml"):
            c = yaml.safe_load(path.read_text(encoding="utf-8"))
            if c["params"].get("query_mode") == "raw":
                assert not calculated.get(c["dataset_uuid"], set()) & set(c["params"]["all_columns"]), path.name
        # the tenant ranking: one row per tenant and currency, whatever the filter
        assert chart("cockpit__tenant_ranking")["params"]["groupby"] == ["tenant", "currency"]
        rows = client.query(f"SELECT tenant, {column_sql(bill, 'currency')} AS currency, "
                            f"{metric(bill, 'total_cost_sum')} FROM {DB}.tenant_daily_bill GROUP BY tenant, currency").result_rows
        assert {(t, c): v for t, c, v in rows} == pytest.approx(want)


class FakeSuperset:
    """Just what import_bundle calls: the import (its zip kept) and the dashboards' charts."""

    def __init__(self, files):
        self.charts = {slug: [{"slice_name": c["slice_name"]} for c in charts] for slug, charts in bundle_charts(files).items()}
        self.zipped = b""

    def request(self, method, path, payload=None, *, data=None, content_type=None, **_):
        boundary = content_type.split("boundary=")[1].encode()
        part = [p for p in data.split(b"--" + boundary) if b'name="bundle"' in p][0]
        self.zipped = part.split(b"\r\n\r\n", 1)[1].rsplit(b"\r\n", 1)[0]

    def dashboard_charts(self, slug):
        return self.charts[slug]


def test_import_labels_money_with_the_configured_currency(tmp_path):
    defaults = (Path(__file__).resolve().parents[2] / "gpuledger" / "ledger_defaults.toml").read_text()
    assert 'currency = "USD"' in defaults
    (tmp_path / "eur.toml").write_text(defaults.replace('currency = "USD"', 'currency = "EUR"'))
    settings = Settings(warehouse=f"chdb:{tmp_path / 'chdb'}", database="ledger", data_dir=tmp_path,
                        ledger_config=tmp_path / "eur.toml")
    api = FakeSuperset(load_bundle(BUNDLE))
    import_bundle(api, settings, bundle=BUNDLE)
    with zipfile.ZipFile(io.BytesIO(api.zipped)) as zf:
        text = {n: zf.read(n).decode() for n in zf.namelist() if not n.endswith("metadata.yaml")}
    assert [n for n, t in text.items() if "USD" in t] == []
    # the datasets whose rows span definition versions (CURRENCY_DATASETS): each row's currency, the ledger's by default
    for name in ("tenant_daily_bill", "job_cost", "job_cost_by_attempt", "idle_waste_daily", "capacity_daily"):
        bill = yaml.safe_load(text[f"gpuledger_bundle/datasets/GPU_Ledger/{name}.yaml"])
        expr = {c["column_name"]: c["expression"] for c in bill["columns"]}["currency"]
        assert "`ledger`.`definitions`" in expr and expr.endswith("'EUR')"), name
    for dashboard in ("cockpit", "algorithm"):
        (flt,) = [f for f in yaml.safe_load(text[f"gpuledger_bundle/dashboards/{dashboard}.yaml"])["metadata"]
                  ["native_filter_configuration"] if f["name"] == "Currency"]
        assert flt["defaultDataMask"]["filterState"]["value"] == ["EUR"], dashboard


# --------------------------------------------------------------------------- days are UTC days
#: Superset's time grains for ClickHouse (its ClickHouse engine spec, Superset 6.1), those the
#: bundle's charts use
SUPERSET_GRAINS = {None: "{col}", "PT5M": "toDateTime(intDiv(toUInt32(toDateTime({col})), 300)*300)",
                   "PT1H": "toStartOfHour(toDateTime({col}))", "P1D": "toStartOfDay(toDateTime({col}))",
                   "P1M": "toStartOfMonth(toDateTime({col}))"}


def date_axis_charts() -> list[str]:
    """The time-series charts (those with a time grain setting) whose x-axis is a Date column."""
    datasets = {d["uuid"]: d for d in (yaml.safe_load(p.read_text(encoding="utf-8"))
                                       for p in (BUNDLE / "datasets").rglob("*.yaml"))}
    out = []
    for path in sorted((BUNDLE / "charts").glob("*.yaml")):
        c = yaml.safe_load(path.read_text(encoding="utf-8"))
        params = c["params"]
        types = {col["column_name"]: col["type"] for col in datasets[c["dataset_uuid"]]["columns"]}
        if "time_grain_sqla" in params and types[params["x_axis"]].removeprefix("Nullable(").startswith("Date") \
                and "DateTime" not in types[params["x_axis"]]:
            out.append(path.stem)
    return out


def test_a_day_axis_shows_the_utc_day_on_a_server_in_another_time_zone(tmp_path):
    assert {"cockpit__capacity_forecast", "operations__gpu_card_monthly"} <= set(date_axis_charts())
    forecast = chart("cockpit__capacity_forecast")["params"]
    ds = dataset("capacity_forecast_latest")
    with migrated_warehouse(tmp_path, DB) as (client, _):
        client.insert("capacity_forecast", [["r1", dt.date(2024, 3, 1), "A100", "*", "history", 10.0, 0.0, 0.0, 20.0, "ets"]],
                      column_names=["run_id", "day", "gpu_model", "queue", "kind", "demand_gpu_hours", "lower_gpu_hours",
                                    "upper_gpu_hours", "capacity_gpu_hours", "method"], database=DB)
        x = SUPERSET_GRAINS[forecast.get("time_grain_sqla")].format(col=forecast["x_axis"])
        rows = client.query(f"SELECT {x} AS x, {metric(ds, 'fleet_demand')} FROM {DB}.capacity_forecast_latest GROUP BY x",
                            settings={"session_timezone": "Europe/Berlin"}).result_rows
    (day, demand), = rows
    assert (day.year, day.month, day.day, getattr(day, "hour", 0)) == (2024, 3, 1, 0) and demand == 10.0
    for stem in date_axis_charts():  # a day or a month already: nothing to cut, no server midnight to move it
        assert chart(stem)["params"].get("time_grain_sqla") is None, stem


def test_the_forecast_band_is_drawn_on_forecast_days_only(tmp_path):
    """The band of the capacity forecast chart is none on a history day, not 0 (a line at 0 under the whole
    history read as a forecast of no demand), as the forecast report's weekly rows."""
    forecast = chart("cockpit__capacity_forecast")["params"]
    ds = dataset("capacity_forecast_latest")
    with migrated_warehouse(tmp_path, DB) as (client, _):
        client.insert("capacity_forecast", [
            ["r1", dt.date(2024, 3, 1), "A100", "*", "history", 10.0, 0.0, 0.0, 20.0, "ets"],
            ["r1", dt.date(2024, 3, 2), "A100", "*", "forecast", 12.0, 8.0, 16.0, 20.0, "ets"],
        ], column_names=["run_id", "day", "gpu_model", "queue", "kind", "demand_gpu_hours", "lower_gpu_hours",
                         "upper_gpu_hours", "capacity_gpu_hours", "method"], database=DB)
        metrics = ", ".join(f"{metric(ds, m)} AS `{m}`" for m in forecast["metrics"])
        got = {r["day"]: r for r in client.query(f"SELECT day, {metrics} FROM {DB}.capacity_forecast_latest "
                                                 "GROUP BY day").named_results()}
    history, ahead = got[dt.date(2024, 3, 1)], got[dt.date(2024, 3, 2)]
    assert (history["fleet_demand"], history["fleet_capacity"]) == (10.0, 20.0)
    assert history["fleet_demand_lower"] is None and history["fleet_demand_upper"] is None
    assert (ahead["fleet_demand"], ahead["fleet_demand_lower"], ahead["fleet_demand_upper"]) == (12.0, 8.0, 16.0)
