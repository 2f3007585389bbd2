"""The dashboards with the real thing: Superset (its own venv, SQLite metadata) over the embedded chDB
filled by the real pipeline. Imports the bundle through `gpuledger superset import`, checks that
every chart of every dashboard exists and answers, that chart numbers (chart-data API) equal the
ledger's own reports for the same data, that two tenant roles see only their own rows (Superset
row-level security), and screenshots each dashboard in headless Chromium (build/screenshots/), and
the periodic HTML reports (inventory, monthly, weekly, job) of the same data beside them.

Runs only with GPULEDGER_SUPERSET_CHECK=1; scripts/superset_check.sh installs what it needs
(Superset venv, chromium, playwright-core) and sets it: `make superset-check`.
"""

from __future__ import annotations

import datetime as dt

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.superset,
    pytest.mark.skipif(os.environ.get("GPULEDGER_SUPERSET_CHECK") != "1",
                       reason="Superset end-to-end check: run `make superset-check` (scripts/superset_check.sh), "
                              "which installs Superset and Chromium under build/ and sets GPULEDGER_SUPERSET_CHECK=1"),
]

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
WORK = BUILD / "superset-check"
SUPERSET_VENV = Path(os.environ.get("GPULEDGER_SUPERSET_VENV", BUILD / "superset-venv"))
NODE_MODULES = Path(os.environ.get("GPULEDGER_SCREENSHOT_NODE_MODULES", BUILD / "screenshot-node" / "node_modules"))
SCREENSHOTS = BUILD / "screenshots"
REPORTS = BUILD / "reports"  # the periodic HTML reports of the check's data
ADMIN = ("admin", "admin-e2e")
TENANT_USERS = {"alice": "tenant_a", "bob": "tenant_b"}  # user -> role
REL = 1e-6


def _log(msg: str) -> None:
    print(f"[superset-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def ledger():
    """Fill a chDB with the real pipeline, add health samples and two tenant grants, compute the
    ledger's own reports, and release the directory for Superset."""
    from gpuledger.warehouse import reports
    from gpuledger.warehouse.periodic import commands as periodic_reports
    from gpuledger.agents.simcluster import SimSpec, simulate
    from gpuledger.config import Settings
    from gpuledger.embedded.pipeline import run_embedded
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.integrations.superset import read_grants
    from gpuledger.warehouse import connect, insert_rows

    t0 = time.monotonic()
    data = WORK / "data"
    shutil.rmtree(data, ignore_errors=True)
    settings = Settings(data_dir=data, warehouse="chdb", topic_prefix="e2e.", worker_app_id="e2e-worker")
    # the demo's cluster (8 nodes, 6 h, seed 7): it raises every alert rule and a reclaim suggestion, so
    # every chart has rows (tests/unit/test_watch_demo.py)
    spec = SimSpec()
    run_embedded(settings, simulate(spec), log=_log)
    _log(f"pipeline done in {time.monotonic() - t0:.0f} s")
    client = connect(settings)
    try:
        db = settings.database
        tenants = [r[0] for r in client.query(
            f"SELECT tenant FROM `{db}`.job_cost GROUP BY tenant ORDER BY sum(cost) DESC LIMIT 2").result_rows]
        insert_rows(client, "tenant_access", [{"principal": role, "tenant": t}
                                              for role, t in zip(TENANT_USERS.values(), tenants)], database=db)
        top_job = client.query(f"SELECT job_id FROM `{db}`.job_cost ORDER BY cost DESC, job_id LIMIT 1").result_rows[0][0]
        # The cockpit's forecast chart reads stored runs; 2 h of data is no history to forecast from
        # (forecast.MIN_DAYS), so one run is made from a 4-week series here, through the same code.
        from gpuledger.warehouse.forecast import forecast_rows
        start = dt.date(2026, 10, 5)
        series = {("A100-80GB", "batch"): {start + dt.timedelta(days=i): 100.0 + 10 * (i % 7) for i in range(28)}}
        insert_rows(client, "capacity_forecast", forecast_rows(series, {"A100-80GB": 192.0}), database=db)
        expected = {
            # each row in its version's currency, the ledger's where none was recorded (as `report bills`)
            "bills": reports.fetch(client, db, "bills", currency=load_ledger_config(settings.ledger_config).currency),
            "jobs": reports.fetch(client, db, "jobs"),
            "top10": reports.fetch(client, db, "jobs", limit=10),
            "util_day": reports.fetch(client, db, "utilization", by="day"),
            "capacity": reports.fetch(client, db, "capacity"),
            "job_report": periodic_reports.build_report(client, db, "job", job_id=top_job),
            "html_reports": _html_reports(client, db, top_job, load_ledger_config(settings.ledger_config).currency),
            "top_job": top_job,
            "gpus": client.query(f"SELECT uniqExact(gpu_uuid) FROM `{db}`.usage_raw").result_rows[0][0],
            "grants": read_grants(client, db),
            "tenants": tenants,
        }
    finally:
        client.close()
    assert len(expected["grants"]) == 2
    return settings, expected


def _html_reports(client, db: str, job_id: str, currency: str) -> dict[str, str]:
    """Every periodic report as its HTML page; the job report of the costliest job."""
    from gpuledger.warehouse.periodic import commands as pr

    options = {"job": {"job_id": job_id}}
    return {name: pr.render_report(pr.build_report(client, db, name, currency=currency, **options.get(name, {})), "html")
            for name in pr.REPORT_NAMES}


# --------------------------------------------------------------------------- Superset
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _superset_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULEDGER_")}
    env.update(SUPERSET_HOME=str(home), SUPERSET_CONFIG_PATH=str(ROOT / "superset" / "superset_config.py"),
               FLASK_APP="superset", SUPERSET_SECRET_KEY="gpuledger-e2e-only", PYTHONUNBUFFERED="1")
    return env


def _metadata(home: Path, env: dict) -> None:
    """An initialised metadata DB with the admin user; built once and cached under build/."""
    cache = BUILD / "superset-metadata-cache" / "superset.db"
    home.mkdir(parents=True, exist_ok=True)
    if not cache.exists():
        t0 = time.monotonic()
        bin_ = SUPERSET_VENV / "bin" / "superset"
        tmp = cache.parent / "home"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        env2 = {**env, "SUPERSET_HOME": str(tmp)}
        for args in (["db", "upgrade"],
                     ["fab", "create-admin", "--username", ADMIN[0], "--firstname", "GPU", "--lastname", "Ledger",
                      "--email", "admin@example.com", "--password", ADMIN[1]],
                     ["init"]):
            subprocess.run([str(bin_), *args], env=env2, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=600)
        shutil.move(str(tmp / "superset.db"), cache)
        shutil.rmtree(tmp, ignore_errors=True)
        _log(f"Superset metadata initialised in {time.monotonic() - t0:.0f} s (cached at {cache})")
    shutil.copy(cache, home / "superset.db")


@pytest.fixture(scope="module")
def superset(ledger):
    from gpuledger.integrations.superset import wait_until_up

    if not (SUPERSET_VENV / "bin" / "gunicorn").exists():
        pytest.fail(f"no Superset venv at {SUPERSET_VENV}: run scripts/superset_check.sh")
    home = WORK / "home"
    shutil.rmtree(home, ignore_errors=True)
    env = _superset_env(home)
    _metadata(home, env)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (WORK / "superset.log").open("w")
    t0 = time.monotonic()
    # one process, threads: the embedded chDB directory can be held by one process only
    proc = subprocess.Popen([str(SUPERSET_VENV / "bin" / "gunicorn"), "-w", "1", "--threads", "8", "--timeout", "180",
                             "-b", f"127.0.0.1:{port}", "superset.app:create_app()"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(WORK))
    try:
        wait_until_up(url, 180)
        _log(f"Superset up in {time.monotonic() - t0:.0f} s at {url}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def imported(ledger, superset):
    """`gpuledger superset import` (the CLI) with the two tenant grants; then an admin API session."""
    from gpuledger.integrations.superset import SupersetAPI

    settings, expected = ledger
    grants = [f"--grant={role}={','.join(ts)}" for role, ts in expected["grants"].items()]
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "gpuledger.integrations.superset", "superset", "import", "--url", superset,
         "--username", ADMIN[0], "--password", ADMIN[1], "--warehouse", f"chdb:{settings.embedded_warehouse_dir}",
         *grants], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    _log(f"import in {time.monotonic() - t0:.0f} s:\n{out.stdout}")
    return SupersetAPI.login(superset, *ADMIN)


# --------------------------------------------------------------------------- chart queries
def query_for(params: dict, grain: str | None = None) -> dict:
    """The chart-data query a chart's form data stands for."""
    viz = params["viz_type"]
    if viz == "table" and params.get("query_mode") == "raw":
        order = [json.loads(o) for o in params.get("order_by_cols", [])]
        return {"columns": params["all_columns"], "metrics": [], "orderby": [[c, asc] for c, asc in order],
                "row_limit": params["row_limit"]}
    if viz == "table":
        return {"columns": params["groupby"], "metrics": params["metrics"],
                "orderby": [[params["timeseries_limit_metric"], not params["order_desc"]]], "row_limit": params["row_limit"]}
    if viz == "big_number_total":
        return {"columns": [], "metrics": [params["metric"]], "row_limit": 1}
    if viz == "pie":
        return {"columns": params["groupby"], "metrics": [params["metric"]], "row_limit": params["row_limit"]}
    x = params["x_axis"]
    axis = {"columnType": "BASE_AXIS", "sqlExpression": x, "label": x, "expressionType": "SQL"}
    if grain or params.get("time_grain_sqla"):
        axis["timeGrain"] = grain or params["time_grain_sqla"]
    return {"columns": [axis, *params.get("groupby", [])], "metrics": params["metrics"],
            "row_limit": params.get("row_limit", 10000), "orderby": []}


def bundle_charts() -> dict[str, dict]:
    from gpuledger.integrations.superset import load_bundle

    files = load_bundle()
    datasets = {f["uuid"]: f["table_name"] for n, f in files.items() if n.startswith("datasets/")}
    return {f["slice_name"]: {**f, "dataset": datasets[f["dataset_uuid"]]} for n, f in files.items() if n.startswith("charts/")}


def chart_rows(api, title: str, grain: str | None = None, filters: list[dict] | None = None) -> list[dict]:
    chart = bundle_charts()[title]
    ds = api.dataset_ids([chart["dataset"]])[chart["dataset"]]
    return api.chart_data(ds, {**query_for(chart["params"], grain), **({"filters": filters} if filters else {})})


def cockpit_currency_default() -> list[str]:
    """The value the cockpit's Currency filter opens with (the ledger's currency)."""
    from gpuledger.integrations.superset import load_bundle

    cockpit = load_bundle()["dashboards/cockpit.yaml"]
    (flt,) = [f for f in cockpit["metadata"]["native_filter_configuration"] if f["name"] == "Currency"]
    return flt["defaultDataMask"]["filterState"]["value"]


def close(a, b) -> bool:
    return a == pytest.approx(b, rel=REL, abs=1e-9)


# --------------------------------------------------------------------------- the checks
def test_every_chart_of_every_dashboard_exists_and_answers(imported):
    from gpuledger.integrations.superset import bundle_charts as by_dashboard, load_bundle

    api = imported
    files = load_bundle()
    for slug, charts in by_dashboard(files).items():
        names = {c["slice_name"] for c in api.dashboard_charts(slug)}
        assert names == {c["slice_name"] for c in charts}, slug
        for c in charts:
            rows = chart_rows(api, c["slice_name"])
            assert rows, f"{slug}: chart {c['slice_name']!r} returned no rows"


def test_cockpit_numbers_equal_the_ledger_reports(ledger, imported):
    _, exp = ledger
    api = imported
    bills, jobs = exp["bills"], exp["jobs"]
    # cost by tenant, split compute / idle / failed-retry
    got = {r["tenant"]: r for r in chart_rows(api, "Cost by tenant: compute / idle / failed retry")}
    want: dict[str, dict] = {}
    for b in bills:
        w = want.setdefault(b["tenant"], {"compute_cost": 0.0, "idle_cost": 0.0, "failed_retry_cost": 0.0})
        for k in w:
            w[k] += b[k]
    assert set(got) == set(want)
    for t, w in want.items():
        for k, v in w.items():
            assert close(got[t][f"{k}_sum"], v), (t, k)
    # effective GPU-hours delivered = executing effective hours = bills' compute + failed retry
    eff = chart_rows(api, "Effective GPU-hours delivered")[0]["effective_gpu_hours"]
    assert close(eff, sum(b["compute_effective_gpu_hours"] + b["failed_retry_effective_gpu_hours"] for b in bills))
    # money per currency (docs/accounting.md: never two currencies into one total): billed cost under the
    # cockpit's Currency filter at its default (the ledger's currency), the ranking per tenant and currency
    (currency,) = cockpit_currency_default()
    billed = chart_rows(api, "Billed cost", filters=[{"col": "currency", "op": "IN", "val": [currency]}])
    assert close(billed[0]["total_cost_sum"], sum(b["total_cost"] for b in bills if b["currency"] == currency))
    ranking: dict[tuple[str, str], float] = {}
    for b in bills:
        ranking[(b["tenant"], b["currency"])] = ranking.get((b["tenant"], b["currency"]), 0.0) + b["total_cost"]
    got_r = {(r["tenant"], r["currency"]): r["total_cost_sum"] for r in chart_rows(api, "Tenant ranking")}
    assert got_r == pytest.approx(ranking, rel=REL)
    # top-10 costly jobs
    top = chart_rows(api, "Top-10 costly jobs")
    assert [r["job_id"] for r in top] == [j["job_id"] for j in exp["top10"]]
    assert all(close(r["cost_sum"], j["cost"]) for r, j in zip(top, exp["top10"]))
    # idle waste by queue: adds up to the bills' idle line; per queue equals the jobs' idle hours
    idle = chart_rows(api, "Idle waste by queue (GPU-hours)")
    assert close(sum(r["idle_gpu_hours_sum"] for r in idle), sum(b["idle_gpu_hours"] for b in bills))
    by_queue: dict[str, float] = {}
    for j in jobs:
        by_queue[j["queue"]] = by_queue.get(j["queue"], 0.0) + j["idle_gpu_hours"]
    got_q: dict[str, float] = {}
    for r in idle:
        got_q[r["queue"]] = got_q.get(r["queue"], 0.0) + r["idle_gpu_hours_sum"]
    assert got_q == pytest.approx({q: v for q, v in by_queue.items() if v}, rel=REL)
    # the three layers, at the report's daily grain
    layers = chart_rows(api, "Three utilization layers (scheduling, execution, hardware)", grain="P1D")
    assert len(layers) == len(exp["util_day"])
    for r, u in zip(sorted(layers, key=lambda r: r["hour"]), exp["util_day"]):
        for k in ("scheduling_utilization", "execution_utilization", "hardware_utilization"):
            assert close(r[k], u[k]), k
    # cluster idle by GPU model = the capacity report's unallocated time
    cap: dict[str, float] = {}
    for c in exp["capacity"]:
        cap[c["gpu_model"]] = cap.get(c["gpu_model"], 0.0) + c["unallocated_gpu_seconds"] / 3600
    got_c = {r["gpu_model"]: r["unallocated_gpu_hours"] for r in chart_rows(api, "Cluster idle (unallocated GPU-hours) by GPU model")}
    assert got_c == pytest.approx(cap, rel=REL)


def test_operations_and_algorithm_numbers(ledger, imported):
    _, exp = ledger
    api = imported
    assert len(chart_rows(api, "Every GPU: current job and tenant")) == exp["gpus"]
    down = sum(c["down_gpu_seconds"] for c in exp["capacity"]) / 3600
    health = chart_rows(api, "Health record per GPU (down time, temperature, Xid)")
    assert close(sum(r["down_hours"] for r in health), down)
    assert max(r["max_temperature"] for r in health) > 0  # health samples reached the dashboard
    # the job health report and the algorithm charts, for the costliest job
    job, rep = exp["top_job"], exp["job_report"]
    jf = {"col": "job_id", "op": "==", "val": job}
    chart = bundle_charts()["Cost by attempt and GPU model"]
    q = query_for(chart["params"])
    rows = api.chart_data(api.dataset_ids(["job_cost_by_attempt"])["job_cost_by_attempt"], {**q, "filters": [jf]})
    by_attempt: dict[str, float] = {}
    for r in rows:
        by_attempt[r["attempt_label"]] = by_attempt.get(r["attempt_label"], 0.0) + r["cost_sum"]
    want = {f"attempt {c['attempt']}": c["total_cost"] for c in rep.section("Cost by attempt").rows}
    assert by_attempt == pytest.approx(want, rel=REL)
    chart = bundle_charts()["Balance across the job's GPUs (utilization % per GPU)"]
    rows = api.chart_data(api.dataset_ids(["job_gpu_balance"])["job_gpu_balance"],
                          {**query_for(chart["params"]), "columns": ["attempt", "gpu"], "filters": [jf]})
    got = {(r["attempt"], r["gpu"]): r["util_pct"] for r in rows}
    want = {(g["attempt"], g["gpu"]): g["util_pct"] for g in rep.section("Balance across GPUs").rows}
    assert got == pytest.approx(want, rel=REL)


def test_each_tenant_sees_only_its_rows(ledger, imported, superset):
    from gpuledger.integrations.superset import SupersetAPI

    _, exp = ledger
    admin = imported
    roles = {r["name"]: r["id"] for r in admin.list_all("/api/v1/security/roles/")}
    for user, role in TENANT_USERS.items():
        existing = [u for u in admin.list_all("/api/v1/security/users/") if u["username"] == user]
        if not existing:
            admin.request("POST", "/api/v1/security/users/", {
                "username": user, "first_name": user, "last_name": "tenant", "email": f"{user}@example.com",
                "password": f"{user}-pw", "active": True, "roles": [roles["Gamma"], roles[role]]})
    all_tenants = {b["tenant"] for b in exp["bills"]}
    assert len(all_tenants) > 2
    chart = bundle_charts()["Jobs: cost and attempts"]
    for user, role in TENANT_USERS.items():
        (tenant,) = exp["grants"][role]
        api = SupersetAPI.login(superset, user, f"{user}-pw")
        for ds_name in ("job_cost_by_attempt", "job_util_histogram", "job_gpu_balance", "job_idle_stretches"):
            ds = api.dataset_ids([ds_name])[ds_name]
            rows = api.chart_data(ds, {"columns": ["tenant"], "metrics": [], "row_limit": 1000, "orderby": []})
            assert {r["tenant"] for r in rows} == {tenant}, (user, ds_name)
        rows = api.chart_data(api.dataset_ids(["job_cost_by_attempt"])["job_cost_by_attempt"], query_for(chart["params"]))
        want = sum(b["total_cost"] for b in exp["bills"] if b["tenant"] == tenant)
        assert close(sum(r["cost_sum"] for r in rows), want)
    # the admin (no tenant role) still sees every tenant
    rows = admin.chart_data(admin.dataset_ids(["job_cost_by_attempt"])["job_cost_by_attempt"],
                            {"columns": ["tenant"], "metrics": [], "row_limit": 1000, "orderby": []})
    assert {r["tenant"] for r in rows} == all_tenants


def _png_stats(path: Path) -> dict:
    code = ("import json,sys; from PIL import Image; im=Image.open(sys.argv[1]).convert('RGB'); "
            "small=im.resize((400, max(1, im.height*400//im.width))); px=list(small.getdata()); "
            "print(json.dumps({'size': im.size, 'colors': len(set(px)), "
            "'non_white': sum(1 for p in px if min(p) < 235)/len(px)}))")
    out = subprocess.run([str(SUPERSET_VENV / "bin" / "python"), "-c", code, str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_screenshots(ledger, imported, superset):
    from gpuledger.integrations.superset import bundle_charts as by_dashboard, load_bundle

    charts = by_dashboard(load_bundle())
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for old in SCREENSHOTS.glob("gpuledger-*.png"):  # the dashboards' (slugs gpuledger-*)
        old.unlink()
    t0 = time.monotonic()
    out = subprocess.run(["node", str(ROOT / "superset" / "screenshot.js"), superset, *ADMIN, str(SCREENSHOTS), *charts],
                         env={**os.environ, "NODE_PATH": str(NODE_MODULES)}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    _log(f"screenshots in {time.monotonic() - t0:.0f} s")
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {r["slug"] for r in results} == set(charts)
    for r in results:
        assert r["charts"] == len(charts[r["slug"]]), r
        assert r["rendered"] == r["charts"] and not r["errors"], r
        # numbers rounded for reading: no 12.339622222222221 in a table or a big number
        unrounded = [m for text in r["texts"] for m in re.findall(r"\d+\.\d{5,}", text)]
        assert not unrounded, (r["slug"], unrounded[:5])
        if r["slug"] == "gpuledger-cockpit":  # the bill tables say each row's currency
            assert "Currency" in "\n".join(r["texts"]) and "USD" in "\n".join(r["texts"]), r["texts"]
        if r["slug"] == "gpuledger-algorithm":  # money in the Currency filter's currency, each row says it
            assert "Currency" in "\n".join(r["texts"]) and "USD" in "\n".join(r["texts"]), r["texts"]
        stats = _png_stats(Path(r["file"]))
        _log(f"{r['file']}: {stats}")
        if len(r["shots_ink"]) > 2:  # a shot that differed from the next one (screenshot.js says why)
            _log(f"{r['slug']}: {len(r['shots_ink'])} shots taken, ink {r['shots_ink']}")
        assert r["steady"], ("no two shots in a row were the same", r["slug"], r["shots_ink"])
        assert stats["colors"] > 50 and stats["non_white"] > 0.05, (r["file"], stats)


def test_report_screenshots(ledger):
    """The periodic HTML reports as a browser shows them: each page rendered by headless Chromium has
    content (not blank), and the PNGs sit beside the dashboards' in build/screenshots/."""
    _, exp = ledger
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium")
    assert chromium, "no chromium: scripts/superset_check.sh installs it (apt-get install chromium)"
    REPORTS.mkdir(parents=True, exist_ok=True)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name, page in exp["html_reports"].items():
        html, png = REPORTS / f"{name}.html", SCREENSHOTS / f"report-{name}.png"
        html.write_text(page)
        png.unlink(missing_ok=True)
        out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                              "--window-size=1200,2400", f"--screenshot={png}", html.as_uri()],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and png.exists(), out.stderr[-2000:]
        stats = _png_stats(png)
        _log(f"{png}: {stats}")
        # a page with text, tables and coloured plots; a blank or error page has a handful of colours
        assert stats["colors"] > 50 and stats["non_white"] > 0.03, (png, stats)
