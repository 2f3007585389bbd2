"""Dashboards as code: import the Superset bundle (superset/bundle/) into a running Superset, pointed at
the configured warehouse, and turn per-tenant grants into Superset row-level security.

Why one file: one integration (Superset's REST API, its bundle and its row-level security) and its
CLI command.

    gpuledger superset import --url http://localhost:8088 --username admin --password admin

- The bundle's database URI is rewritten from the settings: the embedded chDB becomes
  `clickhousedb:///DB?interface=chdb&path=/abs/dir` (clickhouse-connect's SQLAlchemy dialect with its
  chDB interface: install clickhouse-connect and chdb-core next to Superset, and close every other
  process on that directory first: one process per chDB directory), a server becomes
  `clickhousedb://user:…@host:port/DB` (the password travels in the import's `passwords` field, never
  in a message): GPULEDGER_CLICKHOUSE_PASSWORD, else the warehouse URL's (`http://user:pw@host:8123`),
  as the ledger's own client takes it.
  `--database-uri` overrides this when Superset reaches the warehouse under another name.
- Each dataset's schema becomes the configured database.
- Money is labelled with the configured ledger's currency: the bundle is built with the shipped ledger's
  (its currency formats, "(USD)" labels and the cockpit's and the algorithm view's Currency filter defaults), and the import writes
  the configured one in their place. The bill datasets' calculated `currency` column
  (`currency_column_sql`: each row's definition version's recorded currency, as `report bills`) falls
  back to it for a version recorded without one, and reads the configured database's `definitions`.
- Superset skips a chart whose dataset is missing without failing the import, so after importing
  every dashboard's charts are counted against the bundle (`verify_import`).
- Row-level security: `--grant ROLE=TENANT[,TENANT]` (or `--grants-from-warehouse`: the active rows of
  the `tenant_access` table) creates the Superset role if missing, gives it read access to the
  tenant-scoped datasets and one "Regular" RLS rule `tenant IN (...)` on them. chDB has no users or
  roles, so ClickHouse row policies are not an option on the embedded engine; Superset RLS works on both.
  With `--grants-from-warehouse` the grants are the whole truth: a role that has a rule from an earlier
  import but no active grant now (every tenant revoked, `active = 0`) keeps its rule with the clause
  `1 = 0` (no rows); deleting the rule would let the role's dataset access read every tenant.
- Errors (no bundle, Superset unreachable or refusing) are one line, `gpuledger: error: ...`; the
  bundle and the warehouse are checked before Superset is asked anything.

Only the standard library talks to Superset (urllib, a cookie jar for the CSRF session).
"""

from __future__ import annotations

import argparse
import http.cookiejar
import io
import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from gpuledger.config import Settings
from gpuledger.ledger_files import load_ledger_config


def _default_bundle() -> Path:
    """The checkout's superset/bundle, or the copy an installed wheel carries (gpuledger/superset_bundle)."""
    package = Path(__file__).resolve().parents[1]  # gpuledger/ (this file is gpuledger/integrations/superset.py)
    checkout = package.parent / "superset" / "bundle"
    return checkout if checkout.is_dir() else package / "superset_bundle"


DEFAULT_BUNDLE = _default_bundle()
DATABASE_FILE = "databases/GPU_Ledger.yaml"
MASKED = "XXXXXXXXXX"
RLS_PREFIX = "gpuledger tenant access: "
#: datasets carrying a `tenant` column that tenant roles may read, each filtered to the role's tenants
TENANT_SCOPED_DATASETS = (
    "job_util_histogram", "job_gpu_balance", "job_idle_stretches", "job_cost_by_attempt",
    "tenant_daily_bill", "idle_waste_daily", "job_cost",
)


class SupersetError(RuntimeError):
    """Superset refused a request, or the import did not produce what the bundle describes."""


# --------------------------------------------------------------------------- the bundle
def warehouse_password(settings: Settings) -> str:
    """The password the ledger's own client logs in with (warehouse.connect: clickhouse-connect takes the
    DSN's when none is configured): GPULEDGER_CLICKHOUSE_PASSWORD, else the warehouse URL's."""
    configured = settings.clickhouse_password.get_secret_value()
    if configured or settings.embedded_warehouse_dir is not None:
        return configured
    return urllib.parse.unquote(urllib.parse.urlsplit(settings.warehouse).password or "")


def database_uri(settings: Settings, *, masked_password: bool = True) -> str:
    """The SQLAlchemy URI by which Superset reaches the configured warehouse (clickhouse-connect dialect)."""
    from gpuledger.warehouse.client import shown_url

    db = settings.database
    chdb_dir = settings.embedded_warehouse_dir
    if chdb_dir is not None:
        return f"clickhousedb:///{db}?" + urllib.parse.urlencode({"interface": "chdb", "path": str(chdb_dir)})
    url = urllib.parse.urlsplit(settings.warehouse)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise SupersetError(f"cannot point Superset at warehouse {shown_url(settings.warehouse)!r} "
                            "(it takes chdb, chdb:/dir or http(s)://host:port)")
    port = url.port or (8443 if url.scheme == "https" else 8123)
    user = urllib.parse.quote(settings.clickhouse_user, safe="")
    password = warehouse_password(settings)
    auth = user
    if password:
        auth += ":" + (MASKED if masked_password else urllib.parse.quote(password, safe=""))
    query = "?secure=true" if url.scheme == "https" else ""
    return f"clickhousedb://{auth}@{url.hostname}:{port}/{db}{query}"


def load_bundle(bundle: Path = DEFAULT_BUNDLE) -> dict[str, dict]:
    """Every YAML file of the bundle, by its path relative to the bundle folder."""
    bundle = Path(bundle)
    if not (bundle / "metadata.yaml").is_file():
        raise SupersetError(f"{bundle} is not a Superset bundle (no metadata.yaml)")
    files = {}
    for p in sorted(bundle.rglob("*.yaml")):
        try:
            files[p.relative_to(bundle).as_posix()] = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise SupersetError(f"cannot read the bundle's {p}: {' '.join(str(exc).split())}") from None
    return files


def bundle_charts(files: Mapping[str, dict]) -> dict[str, list[dict]]:
    """Dashboard slug -> the chart files it places (in position order)."""
    charts = {f["uuid"]: f for name, f in files.items() if name.startswith("charts/")}
    out = {}
    for name, dash in files.items():
        if name.startswith("dashboards/"):
            out[dash["slug"]] = [charts[node["meta"]["uuid"]] for node in dash["position"].values()
                                 if isinstance(node, dict) and node.get("type") == "CHART"]
    return out


def currency_column_sql(database: str, fallback: str) -> str:
    """The currency of a row's definition version (a dataset's calculated column): its recorded currency
    (reports.definition_currencies: the latest recorded content's), else `fallback`, the ledger's."""
    recorded = (f"(SELECT CAST((groupArray(v), groupArray(c)), 'Map(String, String)') FROM (SELECT toString(definition_version) "
                f"AS v, argMax(JSONExtractString(content, 'currency'), recorded_at) AS c FROM `{database}`.`definitions` GROUP BY v))")
    return f"ifNull(nullIf({recorded}[toString(definition_version)], ''), '{fallback}')"


def bundle_currency(files: Mapping[str, dict]) -> str | None:
    """The currency the bundle's money is labelled with (superset/build_bundle.py: the shipped ledger's): a
    money metric's symbol, else the value the dashboards' Currency filters open with (the money of datasets
    whose rows say their currency has no symbol)."""
    for name, data in files.items():
        if name.startswith("datasets/"):
            for metric in data.get("metrics") or []:
                if metric.get("currency"):
                    return metric["currency"]["symbol"]
    for name, data in files.items():
        if name.startswith("dashboards/"):
            for flt in (data.get("metadata") or {}).get("native_filter_configuration") or []:
                for f in ((flt.get("defaultDataMask") or {}).get("extraFormData") or {}).get("filters") or []:
                    if f.get("col") == "currency" and f.get("val"):
                        return f["val"][0]
    return None


def _relabel(value: Any, word: re.Pattern, currency: str) -> Any:
    """`value` with the bundle's currency code, as a word in any string, replaced by `currency`."""
    if isinstance(value, str):
        return word.sub(currency, value)
    if isinstance(value, list):
        return [_relabel(v, word, currency) for v in value]
    if isinstance(value, dict):
        return {k: _relabel(v, word, currency) for k, v in value.items()}
    return value


def build_zip(files: Mapping[str, dict], uri: str, database: str, currency: str | None = None) -> bytes:
    """The bundle as Superset's import zip, its database URI and dataset schemas set, its money labelled
    with `currency` (None: as built) and its calculated currency columns reading `database`."""
    shipped = bundle_currency(files)
    word = re.compile(rf"\b{re.escape(shipped)}\b") if shipped and currency and currency != shipped else None
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            data = dict(data)
            if name.startswith("databases/"):
                data["sqlalchemy_uri"] = uri
            else:
                if word is not None:
                    data = _relabel(data, word, currency)
                if name.startswith("datasets/"):
                    data["schema"] = database
                    data["columns"] = [{**c, "expression": currency_column_sql(database, currency or shipped or "")}
                                       if c.get("column_name") == "currency" and c.get("expression") else c
                                       for c in data.get("columns") or []]
            zf.writestr(f"gpuledger_bundle/{name}", yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    return buf.getvalue()


# --------------------------------------------------------------------------- the API
def rison(value: Any) -> str:
    """Just enough Rison (Superset's `q=` encoding) for filters and paging."""
    if value is True:
        return "!t"
    if value is False:
        return "!f"
    if value is None:
        return "!n"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        if value and all(c.isalnum() or c in "-_./~" for c in value) and not value[0].isdigit() and value[0] != "-":
            return value
        return "'" + value.replace("!", "!!").replace("'", "!'") + "'"
    if isinstance(value, (list, tuple)):
        return "!(" + ",".join(rison(v) for v in value) + ")"
    if isinstance(value, dict):
        return "(" + ",".join(f"{k}:{rison(v)}" for k, v in value.items()) + ")"
    raise TypeError(f"cannot rison-encode {type(value).__name__}")


@dataclass
class SupersetAPI:
    """A logged-in session on Superset's REST API (JWT + CSRF token and its session cookie)."""

    url: str
    token: str
    csrf: str
    opener: urllib.request.OpenerDirector

    @classmethod
    def login(cls, url: str, username: str, password: str, *, timeout_s: float = 30) -> "SupersetAPI":
        url = url.rstrip("/")
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        api = cls(url, "", "", opener)
        body = api.request("POST", "/api/v1/security/login",
                           {"username": username, "password": password, "provider": "db", "refresh": False},
                           timeout_s=timeout_s)
        api.token = body["access_token"]
        api.csrf = api.request("GET", "/api/v1/security/csrf_token/")["result"]
        return api

    def request(self, method: str, path: str, payload: Any = None, *, q: Any = None, data: bytes | None = None,
                content_type: str | None = None, timeout_s: float = 120) -> Any:
        url = self.url + path + (f"?q={urllib.parse.quote(rison(q))}" if q is not None else "")
        headers = {"Accept": "application/json", "Referer": self.url + "/"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.csrf:
            headers["X-CSRFToken"] = self.csrf
        if payload is not None:
            data, content_type = json.dumps(payload).encode(), "application/json"
        if content_type:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self.opener.open(req, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise SupersetError(f"{method} {path} -> HTTP {exc.code}: {detail}") from None
        except urllib.error.URLError as exc:
            raise SupersetError(f"cannot reach Superset at {self.url}: {exc.reason}") from None
        return json.loads(raw) if raw else None

    def list_all(self, path: str, filters: list[dict] | None = None) -> list[dict]:
        out, page = [], 0
        while True:
            q: dict[str, Any] = {"page": page, "page_size": 100}
            if filters:
                q["filters"] = filters
            body = self.request("GET", path, q=q)
            out.extend(body["result"])
            if len(out) >= body.get("count", 0) or not body["result"]:
                return out
            page += 1

    # ---- lookups
    def dataset_ids(self, names: Iterable[str]) -> dict[str, int]:
        wanted = set(names)
        found = {d["table_name"]: d["id"] for d in self.list_all("/api/v1/dataset/") if d["table_name"] in wanted}
        missing = sorted(wanted - set(found))
        if missing:
            raise SupersetError(f"datasets missing in Superset: {', '.join(missing)}")
        return found

    def dashboard_charts(self, slug: str) -> list[dict]:
        return self.request("GET", f"/api/v1/dashboard/{urllib.parse.quote(slug)}/charts")["result"]

    def chart_data(self, dataset_id: int, query: dict) -> list[dict]:
        body = self.request("POST", "/api/v1/chart/data", {
            "datasource": {"id": dataset_id, "type": "table"}, "force": True,
            "queries": [query], "result_format": "json", "result_type": "full",
        })
        result = body["result"][0]
        if result.get("error"):
            raise SupersetError(f"chart data failed: {result['error']}")
        return result["data"]


def wait_until_up(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(1)
    raise SupersetError(f"Superset at {url} did not answer /health within {timeout_s:.0f} s ({last})")


def _multipart(fields: Mapping[str, str], files: Mapping[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    out = io.BytesIO()
    for name, value in fields.items():
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, (filename, content) in files.items():
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                  "Content-Type: application/zip\r\n\r\n".encode())
        out.write(content + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def import_bundle(api: SupersetAPI, settings: Settings, *, bundle: Path = DEFAULT_BUNDLE,
                  uri: str | None = None) -> dict[str, list[str]]:
    """Import (overwriting) the bundle pointed at the settings' warehouse; returns, per dashboard slug,
    the chart names Superset now has on it. Raises SupersetError when a chart is missing."""
    files = load_bundle(bundle)
    password = warehouse_password(settings)
    currency = load_ledger_config(settings.ledger_config).currency
    zipped = build_zip(files, uri or database_uri(settings), settings.database, currency)
    fields: dict[str, str] = {}
    if uri is None and settings.embedded_warehouse_dir is None and password:
        fields["passwords"] = json.dumps({DATABASE_FILE: password})
    data, ctype = _multipart(fields, {"bundle": ("gpuledger_bundle.zip", zipped)})
    api.request("POST", "/api/v1/assets/import/", data=data, content_type=ctype)
    return verify_import(api, files)


def verify_import(api: SupersetAPI, files: Mapping[str, dict]) -> dict[str, list[str]]:
    found = {}
    problems = []
    for slug, charts in bundle_charts(files).items():
        names = sorted(c["slice_name"] for c in api.dashboard_charts(slug))
        found[slug] = names
        missing = sorted({c["slice_name"] for c in charts} - set(names))
        if missing:
            problems.append(f"{slug}: {', '.join(missing)}")
    if problems:
        raise SupersetError("imported dashboards lack charts (their datasets did not import?): " + "; ".join(problems))
    return found


# --------------------------------------------------------------------------- tenant access (RLS)
def read_grants(client, database: str) -> dict[str, list[str]]:
    """Active grants of the warehouse's `tenant_access` table: principal (Superset role) -> tenants."""
    rows = client.query(
        f"SELECT principal, tenant FROM `{database}`.tenant_access FINAL WHERE active = 1 ORDER BY principal, tenant"
    ).result_rows
    grants: dict[str, list[str]] = {}
    for principal, tenant in rows:
        grants.setdefault(principal, []).append(tenant)
    return grants


def _sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _role_id(api: SupersetAPI, name: str) -> int:
    for role in api.list_all("/api/v1/security/roles/"):
        if role["name"] == name:
            return role["id"]
    return api.request("POST", "/api/v1/security/roles/", {"name": name})["id"]


def _datasource_permissions(api: SupersetAPI, dataset_ids: Mapping[str, int]) -> list[int]:
    """Ids of the `datasource_access` permission on each dataset (Superset names the resource
    `[database].[table](id:N)`)."""
    suffixes = {f"].[{name}](id:{i})" for name, i in dataset_ids.items()}
    ids = []
    for pv in api.list_all("/api/v1/security/permissions-resources/"):
        perm = (pv.get("permission") or {}).get("name")
        view = (pv.get("view_menu") or {}).get("name", "")
        if perm == "datasource_access" and any(view.endswith(s) for s in suffixes):
            ids.append(pv["id"])
    return ids


#: the clause of a role whose every grant was revoked: no rows (its dataset access alone would read all)
NO_ROWS = "1 = 0"


def apply_tenant_access(api: SupersetAPI, grants: Mapping[str, Iterable[str]],
                        datasets: Iterable[str] = TENANT_SCOPED_DATASETS, *,
                        revoke_others: bool = False) -> dict[str, str]:
    """For each role: create it if missing, let it read the tenant-scoped datasets, and keep one RLS
    rule `tenant IN (...)` on them for it (created or updated). With `revoke_others` (the grants are all
    there are: the warehouse's), a role with a rule of ours but no tenant granted gets `NO_ROWS`.
    Returns role -> clause."""
    dataset_ids = api.dataset_ids(datasets)
    perms = _datasource_permissions(api, dataset_ids)
    rules = {r["name"]: r["id"] for r in api.list_all("/api/v1/rowlevelsecurity/")}
    wanted = {role: sorted(set(tenants)) for role, tenants in grants.items()}
    if revoke_others:
        for name in rules:
            if name.startswith(RLS_PREFIX) and not wanted.get(name[len(RLS_PREFIX):]):
                wanted[name[len(RLS_PREFIX):]] = []
    applied = {}
    for role, tenants in sorted(wanted.items()):
        if not tenants and RLS_PREFIX + role not in rules:
            continue  # nothing granted, nothing to take back
        role_id = _role_id(api, role)
        api.request("POST", f"/api/v1/security/roles/{role_id}/permissions", {"permission_view_menu_ids": perms})
        clause = f"tenant IN ({', '.join(_sql_string(t) for t in tenants)})" if tenants else NO_ROWS
        body = {"name": RLS_PREFIX + role, "filter_type": "Regular", "tables": sorted(dataset_ids.values()),
                "roles": [role_id], "clause": clause, "group_key": "tenant",
                "description": "GPU Ledger: this role sees only these tenants' rows"}
        if body["name"] in rules:
            api.request("PUT", f"/api/v1/rowlevelsecurity/{rules[body['name']]}", body)
        else:
            api.request("POST", "/api/v1/rowlevelsecurity/", body)
        applied[role] = clause
    return applied


# --------------------------------------------------------------------------- health samples
# --------------------------------------------------------------------------- CLI
def _parse_grants(values: Iterable[str]) -> dict[str, list[str]]:
    grants: dict[str, list[str]] = {}
    for value in values:
        role, sep, tenants = value.partition("=")
        if not sep or not role.strip() or not tenants.strip():
            raise SystemExit(f"--grant takes ROLE=TENANT[,TENANT...], got {value!r}")
        grants.setdefault(role.strip(), []).extend(t.strip() for t in tenants.split(",") if t.strip())
    return grants


def cmd_superset_import(args) -> int:
    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = Path(args.data_dir)
    if getattr(args, "warehouse", None):
        overrides["warehouse"] = args.warehouse
    settings = Settings(**overrides)
    grants = _parse_grants(args.grant or [])
    try:
        return _superset_import(args, settings, grants)
    except SupersetError as exc:  # a message for people (the CLI prints a SystemExit's string on one line)
        raise SystemExit(" ".join(str(exc).split())) from None


def _superset_import(args, settings: Settings, grants: dict[str, list[str]]) -> int:
    load_bundle(Path(args.bundle))  # no bundle, no warehouse Superset can reach: said before Superset is asked
    if args.database_uri is None:
        database_uri(settings)
    if args.grants_from_warehouse:
        from gpuledger.warehouse import connect

        client = connect(settings)
        try:
            for role, tenants in read_grants(client, settings.database).items():
                grants.setdefault(role, []).extend(tenants)
        finally:
            client.close()
    if args.wait:
        wait_until_up(args.url, args.wait)
    api = SupersetAPI.login(args.url, args.username, args.password)
    found = import_bundle(api, settings, bundle=Path(args.bundle), uri=args.database_uri)
    for slug, names in found.items():
        print(f"{slug}: {len(names)} charts")
    if grants or args.grants_from_warehouse:  # the warehouse's grants: revocations too, even of the last one
        for role, clause in apply_tenant_access(api, grants, revoke_others=args.grants_from_warehouse).items():
            print(f"row-level security: role {role}: {clause}")
    return 0


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add `superset import` to the gpuledger command line."""
    import os

    p = subparsers.add_parser("superset", help="Superset dashboards as code",
                              description="Superset dashboards as code (superset/bundle)")
    sub = p.add_subparsers(dest="superset_command", required=True)
    imp = sub.add_parser("import", help="import the dashboards into a running Superset, pointed at the configured warehouse",
                         description="import the dashboards into a running Superset, pointed at the configured warehouse")
    imp.set_defaults(func=cmd_superset_import)
    imp.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
    imp.add_argument("--warehouse", help="'chdb', 'chdb:/dir' or http(s)://host:port (default: GPULEDGER_WAREHOUSE)")
    imp.add_argument("--url", default=os.environ.get("SUPERSET_URL", "http://localhost:8088"), help="Superset base URL")
    imp.add_argument("--username", default=os.environ.get("SUPERSET_ADMIN_USERNAME", "admin"))
    imp.add_argument("--password", default=os.environ.get("SUPERSET_ADMIN_PASSWORD", "admin"))
    imp.add_argument("--bundle", default=os.environ.get("GPULEDGER_SUPERSET_BUNDLE", str(DEFAULT_BUNDLE)),
                     help="bundle folder (default: the checkout's superset/bundle, else the one installed with gpuledger)")
    imp.add_argument("--database-uri", help="SQLAlchemy URI Superset should use instead of the one derived from the settings")
    imp.add_argument("--grant", action="append", metavar="ROLE=TENANT[,TENANT]",
                     help="row-level security: this Superset role sees only these tenants (repeatable)")
    imp.add_argument("--grants-from-warehouse", action="store_true",
                     help="also apply the active grants of the warehouse's tenant_access table; a role with "
                          "a rule from an earlier import and no active grant now sees no rows")
    imp.add_argument("--wait", type=float, default=0, metavar="S", help="wait up to S seconds for Superset to answer first")
    return p


if __name__ == "__main__":  # pragma: no cover - `python -m gpuledger.integrations.superset import ...`
    parser = argparse.ArgumentParser(prog="python -m gpuledger.integrations.superset")
    register_cli(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
