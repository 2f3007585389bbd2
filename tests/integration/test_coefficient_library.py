"""The coefficient library and versioned definitions against the real engine (chDB)."""

import shutil
import tomllib
from datetime import date

import pytest

from gpuledger.cli import main
from gpuledger.warehouse.library import add_coefficient, history_rows, sync_library
from gpuledger.ledger_files import BUNDLED_CONFIG, load_ledger_config
from gpuledger.streams.pricing import LedgerConfigError, parse_ledger_config
from gpuledger.warehouse import connect, migrate

pytestmark = pytest.mark.integration


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "ledger.toml"
    shutil.copy(BUNDLED_CONFIG, path)
    return path


def test_add_keeps_history_and_refuses_edits(config):
    ledger = add_coefficient(config, "A100-80GB", 2.6, date(2026, 12, 1))
    a100 = [r for r in history_rows(ledger) if r["model"] == "A100-80GB"]
    assert [(r["coefficient"], r["valid_from"]) for r in a100] == [(2.3, "2020-01-01"), (2.6, "2026-12-01")]
    with pytest.raises(LedgerConfigError, match="append-only"):
        add_coefficient(config, "A100-80GB", 9.9, date(2026, 12, 1))
    with pytest.raises(LedgerConfigError, match="bundled defaults"):
        add_coefficient(BUNDLED_CONFIG, "A100-80GB", 2.6, date(2026, 12, 2))
    with pytest.raises(LedgerConfigError, match="> 0"):
        add_coefficient(config, "A100-80GB", 0, date(2026, 12, 2))


def test_add_refused_by_the_loader_leaves_the_file_as_it_was(config):
    # before: the entry was appended, then the re-read refused it: the file on disk was one that every
    # worker and command refused from then on (here: the baseline card must keep coefficient 1.0)
    before = config.read_bytes()
    with pytest.raises(LedgerConfigError, match="baseline_model 'V100-32GB' must have coefficient 1.0"):
        add_coefficient(config, "V100-32GB", 1.1, date(2026, 12, 1))
    with pytest.raises(LedgerConfigError, match=r"coefficient must be a number > 0 and <= 1000"):
        add_coefficient(config, "A100-80GB", float("inf"), date(2026, 12, 1))
    assert config.read_bytes() == before
    load_ledger_config(config)


def test_add_writes_the_file_atomically(config, monkeypatch):
    """The new file is written aside and renamed over the old one: a crash mid-write never leaves a
    half-written ledger file (the rename failing here stands for the crash)."""
    import os

    before = config.read_bytes()
    config.chmod(0o640)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(LedgerConfigError, match=r"ledger.toml: cannot write the new entry \(disk full\); the file is unchanged"):
        add_coefficient(config, "A100-80GB", 2.6, date(2026, 12, 1))
    assert config.read_bytes() == before
    assert sorted(p.name for p in config.parent.iterdir()) == ["ledger.toml"]  # no temporary file left
    monkeypatch.undo()
    add_coefficient(config, "A100-80GB", 2.6, date(2026, 12, 1))
    assert config.read_bytes().startswith(before) and (config.stat().st_mode & 0o777) == 0o640
    crlf = config.read_bytes().replace(b"\n", b"\r\n")  # a file saved on Windows keeps its line endings
    config.write_bytes(crlf)
    add_coefficient(config, "A100-80GB", 2.7, date(2026, 12, 2))
    assert config.read_bytes().startswith(crlf)


def test_cli_add_list_and_sync(config, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPULEDGER_LEDGER_CONFIG", str(config))
    data = str(tmp_path / "data")
    assert main(["migrate", "--data-dir", data]) == 0
    assert main(["coefficients", "add", "--model", "H200-141GB", "--coefficient", "6.5", "--valid-from", "2026-12-01",
                 "--data-dir", data]) == 0
    capsys.readouterr()
    assert main(["coefficients", "list", "--format", "csv"]) == 0
    assert "H200-141GB,6.5,2026-12-01,H200-141GB@2026-12-01" in capsys.readouterr().out
    from gpuledger.config import Settings

    client = connect(Settings(data_dir=tmp_path / "data"))
    try:
        rows = client.query("SELECT model, coefficient FROM coefficients FINAL WHERE model = 'H200-141GB'").result_rows
    finally:
        client.close()
    assert rows == [("H200-141GB", 6.5)]


def test_a_changed_definition_needs_a_new_version(config, tmp_path):
    from gpuledger.config import Settings

    client = connect(Settings(data_dir=tmp_path / "data"))
    try:
        migrate(client, "gpuledger")
        first = sync_library(client, "gpuledger", load_ledger_config(config))
        assert first["definition_recorded"]
        assert not sync_library(client, "gpuledger", load_ledger_config(config))["definition_recorded"]  # idempotent
        config.write_text(config.read_text().replace("pue = 1.4", "pue = 1.2"))
        with pytest.raises(LedgerConfigError, match="bump definition_version"):
            sync_library(client, "gpuledger", load_ledger_config(config))
        config.write_text(config.read_text().replace('definition_version = "defaults-2026.3"',
                                                     'definition_version = "defaults-2026.3-pue"'))
        assert sync_library(client, "gpuledger", load_ledger_config(config))["definition_recorded"]
    finally:
        client.close()


def test_an_edited_coefficient_needs_a_new_version(config, tmp_path):
    """Records name the coefficient entry they used (MODEL@DAY): an entry edited under the same
    definition_version would make one id stand for two coefficients; under a new version it is the
    documented way to recompute a past period (docs/configuration.md)."""
    from gpuledger.config import Settings

    client = connect(Settings(data_dir=tmp_path / "data"))
    try:
        migrate(client, "gpuledger")
        sync_library(client, "gpuledger", load_ledger_config(config))
        config.write_text(config.read_text().replace("coefficient = 2.3", "coefficient = 2.5"))
        with pytest.raises(LedgerConfigError, match="A100-80GB@2020-01-01 is recorded as 2.3 .* now says 2.5"):
            sync_library(client, "gpuledger", load_ledger_config(config))
        rows = client.query("SELECT coefficient FROM gpuledger.coefficients FINAL WHERE model = 'A100-80GB'").result_rows
        assert rows == [(2.3,)]  # refused before anything was written
        config.write_text(config.read_text().replace('definition_version = "defaults-2026.3"',
                                                     'definition_version = "defaults-2026.3-a100"'))
        assert sync_library(client, "gpuledger", load_ledger_config(config))["definition_recorded"]
        rows = client.query("SELECT coefficient FROM gpuledger.coefficients FINAL WHERE model = 'A100-80GB'").result_rows
        assert rows == [(2.5,)]
    finally:
        client.close()


def test_price_history_is_synced_and_append_only(config, tmp_path):
    """[[prices]] entries are history like coefficients: a new entry needs no new definition version,
    an edited one is refused (docs/accounting.md §4c)."""
    from gpuledger.config import Settings

    client = connect(Settings(data_dir=tmp_path / "data"))
    try:
        migrate(client, "gpuledger")
        assert sync_library(client, "gpuledger", load_ledger_config(config))["prices"] == 6
        with open(config, "a") as f:
            f.write('\n[[prices]]\nmodel = "A100-80GB"\nvalid_from = "2026-12-01"\ndepreciation_per_hour = 0.40\n'
                    'maintenance_per_hour = 0.05\n')
        synced = sync_library(client, "gpuledger", load_ledger_config(config))
        assert synced["prices"] == 7 and not synced["definition_recorded"]  # same definition version, no refusal
        rows = client.query("SELECT version, depreciation_per_hour FROM gpuledger.prices FINAL "
                            "WHERE model = 'A100-80GB' ORDER BY valid_from").result_rows
        assert rows == [("A100-80GB@2020-01-01", 0.43), ("A100-80GB@2026-12-01", 0.40)]
        config.write_text(config.read_text().replace("depreciation_per_hour = 0.40", "depreciation_per_hour = 0.39"))
        with pytest.raises(LedgerConfigError, match="append-only"):
            sync_library(client, "gpuledger", load_ledger_config(config))
    finally:
        client.close()


def test_alerts_and_reclaim_thresholds_need_no_new_definition_version(config, tmp_path):
    """[alerts] and [reclaim] are versioned on their own (docs/alerts.md): a new threshold keeps the
    definition version, also in a warehouse that recorded it with the old fingerprint, which held them."""
    import dataclasses

    from gpuledger.config import Settings

    client = connect(Settings(data_dir=tmp_path / "data"))
    try:
        migrate(client, "gpuledger")
        ledger = load_ledger_config(config)
        # recorded by an older ledger: its fingerprint covered [alerts] and [reclaim]
        assert ledger.legacy_fingerprint != ledger.fingerprint
        assert sync_library(client, "gpuledger", dataclasses.replace(ledger, fingerprint=ledger.legacy_fingerprint))[
            "definition_recorded"]
        assert not sync_library(client, "gpuledger", ledger)["definition_recorded"]  # the legacy one matches
        config.write_text(config.read_text().replace('version = "alerts-1"', 'version = "alerts-2"', 1)
                          .replace('version = "reclaim-1"', 'version = "reclaim-2"', 1))
        changed = load_ledger_config(config)
        assert changed.watch != ledger.watch and changed.fingerprint == ledger.fingerprint
        assert not sync_library(client, "gpuledger", changed)["definition_recorded"]
        config.write_text(config.read_text().replace("pue = 1.4", "pue = 1.2"))
        with pytest.raises(LedgerConfigError, match="bump definition_version"):
            sync_library(client, "gpuledger", load_ledger_config(config))
    finally:
        client.close()


def test_a_dated_price_from_1970_is_append_only_too(config, tmp_path):
    """Only undated [prices.MODEL] tables may replace their recorded row (they are in the fingerprint);
    a [[prices]] entry dated 1970-01-01 is history like any other."""
    from gpuledger.config import Settings

    client = connect(Settings(data_dir=tmp_path / "data"))
    try:
        migrate(client, "gpuledger")
        config.write_text(config.read_text().replace('valid_from = "2020-01-01"\ndepreciation_per_hour',
                                                     'valid_from = "1970-01-01"\ndepreciation_per_hour'))
        sync_library(client, "gpuledger", load_ledger_config(config))
        config.write_text(config.read_text().replace("depreciation_per_hour = 0.43", "depreciation_per_hour = 4.3"))
        with pytest.raises(LedgerConfigError, match="append-only"):
            sync_library(client, "gpuledger", load_ledger_config(config))
        rows = client.query("SELECT version, depreciation_per_hour FROM gpuledger.prices FINAL "
                            "WHERE model = 'A100-80GB'").result_rows
        assert rows == [("A100-80GB@1970-01-01", 0.43)]
        # the undated form belongs to its definition version: a new version may replace the row
        doc = tomllib.loads(BUNDLED_CONFIG.read_text())
        undated = {p["model"]: {"depreciation_per_hour": p["depreciation_per_hour"],
                                "maintenance_per_hour": p["maintenance_per_hour"]} for p in doc["prices"]}
        undated["A100-80GB"]["depreciation_per_hour"] = 4.3
        sync_library(client, "gpuledger", parse_ledger_config(dict(doc, prices=undated, definition_version="v-old")))
        rows = client.query("SELECT version, depreciation_per_hour FROM gpuledger.prices FINAL "
                            "WHERE model = 'A100-80GB'").result_rows
        assert rows == [("A100-80GB@1970-01-01", 4.3)]
    finally:
        client.close()
