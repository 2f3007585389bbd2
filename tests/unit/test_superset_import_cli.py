"""`gpuledger superset import` (gpuledger/integrations/superset.py) without a Superset: a fake of the few
REST calls it makes.

* The warehouse password reaches Superset wherever the ledger takes it from: GPULEDGER_CLICKHOUSE_PASSWORD,
  or the warehouse URL's (`http://user:pw@host:8123`, which the ledger's own client uses when no password
  is set); it travels in the import's `passwords` field, never in a message.
* Errors are one line (`gpuledger: error: ...`, exit 2): a missing bundle is said before Superset is
  asked anything, an unreachable Superset has no traceback.
* Row-level security follows revocations: with --grants-from-warehouse, a role whose every grant was
  revoked (`active = 0` in tenant_access) keeps its rule, which now matches no row; removing the rule
  would let the role's dataset access read every tenant.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import yaml

from gpuledger.cli import main
from gpuledger.config import Settings
from gpuledger.integrations import superset
from gpuledger.integrations.superset import (RLS_PREFIX, SupersetError, apply_tenant_access, bundle_charts,
                                             database_uri, import_bundle, load_bundle)

BUNDLE = Path(__file__).resolve().parents[2] / "superset" / "bundle"


class FakeSuperset:
    """The REST calls the import and the tenant access make: a kept import zip, roles, RLS rules."""

    def __init__(self, rules: dict[str, str] | None = None, roles: dict[str, int] | None = None):
        self.charts = {slug: [{"slice_name": c["slice_name"]} for c in charts]
                       for slug, charts in bundle_charts(load_bundle(BUNDLE)).items()}
        self.roles = dict(roles or {})
        self.rules = {name: {"id": i, "clause": clause} for i, (name, clause) in enumerate((rules or {}).items(), 1)}
        self.fields: dict[str, str] = {}
        self.zipped = b""

    def request(self, method, path, payload=None, *, data=None, content_type=None, **_):
        if path == "/api/v1/assets/import/":
            boundary = content_type.split("boundary=")[1].encode()
            for part in data.split(b"--" + boundary):
                head, _, body = part.partition(b"\r\n\r\n")
                name = head.split(b'name="')[1].split(b'"')[0].decode() if b'name="' in head else None
                if name == "bundle":
                    self.zipped = body.rsplit(b"\r\n", 1)[0]
                elif name:
                    self.fields[name] = body.rsplit(b"\r\n", 1)[0].decode()
            return None
        if method == "POST" and path == "/api/v1/security/roles/":
            self.roles[payload["name"]] = len(self.roles) + 100
            return {"id": self.roles[payload["name"]]}
        if path.startswith("/api/v1/rowlevelsecurity/"):
            if method == "PUT":
                rule_id = int(path.rsplit("/", 1)[1])
                (name,) = [n for n, r in self.rules.items() if r["id"] == rule_id]
                self.rules[name] = {"id": rule_id, "clause": payload["clause"], "roles": payload["roles"]}
            else:
                self.rules[payload["name"]] = {"id": len(self.rules) + 1, "clause": payload["clause"],
                                               "roles": payload["roles"]}
        return {}

    def list_all(self, path, filters=None):
        if path == "/api/v1/security/roles/":
            return [{"name": n, "id": i} for n, i in self.roles.items()]
        if path == "/api/v1/rowlevelsecurity/":
            return [{"name": n, "id": r["id"]} for n, r in self.rules.items()]
        if path == "/api/v1/security/permissions-resources/":
            return [{"id": 1000 + i, "permission": {"name": "datasource_access"},
                     "view_menu": {"name": f"[GPU Ledger].[{n}](id:{i})"}}
                    for i, n in enumerate(superset.TENANT_SCOPED_DATASETS, 1)]
        raise AssertionError(path)

    def dataset_ids(self, names):
        return {n: i for i, n in enumerate(superset.TENANT_SCOPED_DATASETS, 1) if n in set(names)}

    def dashboard_charts(self, slug):
        return self.charts[slug]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("GPULEDGER_WAREHOUSE", "GPULEDGER_LEDGER_CONFIG", "GPULEDGER_DATABASE", "GPULEDGER_CLICKHOUSE_PASSWORD",
                 "GPULEDGER_CLICKHOUSE_PASSWORD_FILE", "GPULEDGER_CLICKHOUSE_USER", "GPULEDGER_SUPERSET_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPULEDGER_DATA_DIR", str(tmp_path / "data"))


# --------------------------------------------------------------------------- the warehouse password
def imported_database(api: FakeSuperset) -> dict:
    with zipfile.ZipFile(io.BytesIO(api.zipped)) as zf:
        return yaml.safe_load(zf.read("gpuledger_bundle/databases/GPU_Ledger.yaml"))


def test_the_password_in_the_warehouse_url_reaches_superset_masked():
    settings = Settings(warehouse="http://default:s3cr%40t@ch.example:8123")  # the ledger's client logs in with it
    api = FakeSuperset()
    import_bundle(api, settings, bundle=BUNDLE)
    assert json.loads(api.fields["passwords"]) == {"databases/GPU_Ledger.yaml": "s3cr@t"}
    uri = imported_database(api)["sqlalchemy_uri"]
    assert uri == "clickhousedb://default:XXXXXXXXXX@ch.example:8123/gpuledger"
    assert "s3cr" not in database_uri(settings)


def test_the_configured_password_wins_over_the_urls_as_in_the_ledgers_client():
    settings = Settings(warehouse="http://default:old@ch.example:8123", clickhouse_password="new")
    api = FakeSuperset()
    import_bundle(api, settings, bundle=BUNDLE)
    assert json.loads(api.fields["passwords"]) == {"databases/GPU_Ledger.yaml": "new"}


def test_a_warehouse_superset_cannot_reach_is_named_without_its_password():
    with pytest.raises(SupersetError) as err:
        database_uri(Settings(warehouse="tcp://ops:s3cret@ch.example:9000"))
    assert "s3cret" not in str(err.value) and "ch.example" in str(err.value)


# --------------------------------------------------------------------------- one-line errors
def one_line_error(capsys, code: int, *needles: str) -> str:
    _, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuledger: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_missing_bundle_is_said_before_superset_is_asked(capsys, tmp_path, monkeypatch):
    def login(*_a, **_k):
        raise AssertionError("logged in to Superset with no bundle to import")

    monkeypatch.setattr(superset.SupersetAPI, "login", login)
    code = main(["superset", "import", "--bundle", str(tmp_path / "nowhere")])
    one_line_error(capsys, code, "nowhere", "no metadata.yaml")


def test_an_unreachable_superset_is_one_line(capsys):
    code = main(["superset", "import", "--url", "http://127.0.0.1:9", "--bundle", str(BUNDLE)])
    one_line_error(capsys, code, "cannot reach Superset at http://127.0.0.1:9")


# --------------------------------------------------------------------------- row-level security
def test_a_role_whose_grants_were_all_revoked_sees_no_rows(capsys, monkeypatch):
    """tenant_a was granted t1 at an earlier import; its grant is revoked in the warehouse since: the
    next import with --grants-from-warehouse must not leave `tenant IN ('t1')` in place."""
    api = FakeSuperset(rules={RLS_PREFIX + "tenant_a": "tenant IN ('t1')", RLS_PREFIX + "tenant_b": "tenant IN ('t2')",
                              "someone else's rule": "queue = 'q'"},
                       roles={"tenant_a": 7, "tenant_b": 8})
    monkeypatch.setattr(superset.SupersetAPI, "login", classmethod(lambda cls, *a, **k: api))
    monkeypatch.setattr(superset, "import_bundle", lambda *a, **k: {})

    class Client:
        def close(self):
            pass

    monkeypatch.setattr("gpuledger.warehouse.connect", lambda settings: Client())
    monkeypatch.setattr(superset, "read_grants", lambda client, database: {"tenant_b": ["t2"]})
    assert main(["superset", "import", "--grants-from-warehouse"]) == 0
    assert api.rules[RLS_PREFIX + "tenant_a"]["clause"] == "1 = 0"
    assert api.rules[RLS_PREFIX + "tenant_a"]["roles"] == [7]
    assert api.rules[RLS_PREFIX + "tenant_b"]["clause"] == "tenant IN ('t2')"
    assert api.rules["someone else's rule"]["clause"] == "queue = 'q'"  # not ours: left alone
    assert "role tenant_a: 1 = 0" in capsys.readouterr().out

    # every grant revoked: the import still applies the revocations
    monkeypatch.setattr(superset, "read_grants", lambda client, database: {})
    assert main(["superset", "import", "--grants-from-warehouse"]) == 0
    assert api.rules[RLS_PREFIX + "tenant_b"]["clause"] == "1 = 0"


def test_explicit_grants_alone_leave_other_roles_rules_alone():
    api = FakeSuperset(rules={RLS_PREFIX + "tenant_a": "tenant IN ('t1')"}, roles={"tenant_a": 7})
    assert apply_tenant_access(api, {"tenant_b": ["t2"]}) == {"tenant_b": "tenant IN ('t2')"}
    assert api.rules[RLS_PREFIX + "tenant_a"]["clause"] == "tenant IN ('t1')"
