"""The coefficient library, the price history and re-billing.

Source of truth: the `[[coefficients]]` and `[[prices]]` entries of the ledger config file (history
kept, each entry valid from its date until the next entry of the same model). `sync_library` copies
both histories and the current definition version into the warehouse (tables `coefficients`,
`prices`, `definitions`); `rebill` recomputes a past period's effective GPU-hours with the
coefficients valid on a chosen date (and, with `cost=True`, its cost with the prices valid then)
into `rebilled_usage`, leaving the original bills as they were. See docs/accounting.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import tomllib
import uuid
from dataclasses import asdict
from datetime import date
from pathlib import Path

from gpuledger.ledger_files import BUNDLED_CONFIG, load_ledger_config
from gpuledger.streams.pricing import (
    JOULES_PER_KWH,
    LedgerConfig,
    LedgerConfigError,
    PriceEntry,
    date_ms,
    parse_ledger_config,
)

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


def history_rows(ledger: LedgerConfig) -> list[dict]:
    """Every coefficient entry, oldest first per model."""
    rows = []
    for model in sorted(ledger.coefficients):
        for entry in ledger.coefficients[model]:
            rows.append({"model": model, "coefficient": entry.coefficient,
                         "valid_from": entry.version.split("@", 1)[1], "version": entry.version})
    return rows


def price_rows(ledger: LedgerConfig) -> list[dict]:
    """Every price entry, oldest first per model (entries of [prices.MODEL] tables: from 1970-01-01)."""
    return [{"model": model, "valid_from": entry.version.split("@", 1)[1], "version": entry.version,
             "depreciation_per_hour": entry.price.depreciation_per_hour,
             "maintenance_per_hour": entry.price.maintenance_per_hour}
            for model in sorted(ledger.price_history) for entry in ledger.price_history[model]]


def prices_as_of(ledger: LedgerConfig, day: date) -> dict[str, PriceEntry]:
    """model -> its own price entry valid at the start of `day` (UTC); 'default' among them."""
    at = date_ms(day, "as-of date")
    out = {}
    for model in ledger.price_history:
        try:
            entry = ledger.price_at(model, at)
        except LedgerConfigError:
            continue  # no price of its own yet on that date
        if entry.model == model:
            out[model] = entry
    return out


def coefficients_as_of(ledger: LedgerConfig, day: date) -> dict[str, tuple[float, str]]:
    """model -> (coefficient, version) valid at the start of `day` (UTC)."""
    at = date_ms(day, "as-of date")
    out = {}
    for model in ledger.coefficients:
        try:
            entry = ledger.coefficient_at(model, at)
        except LedgerConfigError:
            continue  # the model had no coefficient yet on that date
        if entry.model == model:
            out[model] = (entry.coefficient, entry.version)
    return out


def add_coefficient(config_path: Path | None, model: str, coefficient: float, valid_from: date) -> LedgerConfig:
    """Append a coefficient entry to the ledger config file (history is never edited). The new file is
    checked as the workers will load it before it is written, and written atomically (aside, then
    renamed over the old one): a refused entry or a crash never leaves a file every worker refuses."""
    if config_path is None or Path(config_path).resolve() == BUNDLED_CONFIG.resolve():
        raise LedgerConfigError(
            "refusing to edit the bundled defaults: copy gpuledger/ledger_defaults.toml, edit it, and point "
            "GPULEDGER_LEDGER_CONFIG at the copy")
    if not MODEL_NAME.match(model):
        raise LedgerConfigError(f"model name {model!r} is not a valid name (letters, digits, . _ + -)")
    if not coefficient > 0:
        raise LedgerConfigError(f"a coefficient must be > 0, got {coefficient}")
    ledger = load_ledger_config(config_path)
    day = valid_from.isoformat()
    if any(row["model"] == model and row["valid_from"] == day for row in history_rows(ledger)):
        raise LedgerConfigError(f"{model} already has a coefficient valid from {day}; history is append-only")
    path = Path(config_path).resolve()  # a symlinked config: replace its target, not the link
    with open(path, encoding="utf-8", newline="") as f:  # newline="": its line endings are written back as they were
        text = f.read()
    text += ("\n" if text and not text.endswith("\n") else "") + \
        f'\n[[coefficients]]\nmodel = "{model}"\ncoefficient = {coefficient!r}\nvalid_from = "{day}"\n'
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # e.g. the file holds `coefficients = [...]` inline
        raise LedgerConfigError(f"{config_path}: a [[coefficients]] entry cannot be appended ({exc}); "
                                "add it by hand") from None
    new = parse_ledger_config(doc, str(config_path))  # a refused entry is never written
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only directory, a full disk: one line, and the file is as it was
        raise LedgerConfigError(f"{config_path}: cannot write the new entry ({exc.strerror or exc}); the file "
                                "is unchanged") from None
    finally:
        tmp.unlink(missing_ok=True)
    return new


def sync_library(client, database: str, ledger: LedgerConfig) -> dict:
    """Copy the coefficient history and the definition version into the warehouse.

    Refuses a definition version already recorded with different content. A version recorded with the
    legacy fingerprint (which held [alerts] and [reclaim]) still matches: its current fingerprint is
    recorded beside it, so a later change of those tables alone is accepted too."""
    recorded = client.query(
        f"SELECT DISTINCT fingerprint FROM `{database}`.definitions WHERE definition_version = {{v:String}}",
        parameters={"v": ledger.definition_version}).result_rows
    fingerprints = {row[0] for row in recorded}
    if fingerprints and not fingerprints & {ledger.fingerprint, ledger.legacy_fingerprint}:
        raise LedgerConfigError(
            f"definition_version {ledger.definition_version!r} is already recorded with different content; "
            "bump definition_version in the ledger config so old bills keep their meaning")
    rows = history_rows(ledger)
    if fingerprints:  # the version is recorded: its coefficient entries are what its records were priced with
        _refuse_edited_coefficients(client, database, ledger, rows)
    if ledger.fingerprint not in fingerprints:
        content = json.dumps({"definitions": asdict(ledger.definitions), "currency": ledger.currency,
                              "prices": {m: asdict(p) for m, p in ledger.prices.items()},
                              "electricity_price_per_kwh": ledger.electricity_price_per_kwh, "pue": ledger.pue},
                             sort_keys=True)
        client.insert("definitions", [[ledger.definition_version, ledger.fingerprint, content]],
                      column_names=["definition_version", "fingerprint", "content"], database=database)
    if rows:
        client.insert("coefficients",
                      [[r["model"], r["coefficient"], date.fromisoformat(r["valid_from"]), r["version"]] for r in rows],
                      column_names=["model", "coefficient", "valid_from", "version"], database=database)
    prices = sync_prices(client, database, ledger)
    return {"coefficients": len(rows), "prices": prices, "definition_version": ledger.definition_version,
            "definition_recorded": not fingerprints}


def _refuse_edited_coefficients(client, database: str, ledger: LedgerConfig, rows: list[dict]) -> None:
    """A coefficient entry recorded with another value under a definition version already recorded is
    refused: records name the entry (`coefficient_version`, MODEL@DAY), not its value, so one id would
    stand for two coefficients. Recomputing a past period with other coefficients takes a new
    definition_version (docs/configuration.md, `[[coefficients]]`)."""
    recorded = {(m, str(d)): c for m, d, c in client.query(
        f"SELECT model, valid_from, coefficient FROM `{database}`.coefficients FINAL").result_rows}
    for r in rows:
        before = recorded.get((r["model"], r["valid_from"]))
        if before is not None and before != r["coefficient"]:
            raise LedgerConfigError(
                f"coefficient {r['version']} is recorded as {before} but the ledger config now says {r['coefficient']} "
                f"under the same definition_version {ledger.definition_version!r}: add a [[coefficients]] entry with "
                "a later valid_from, or bump definition_version to recompute a past period with it")


def sync_prices(client, database: str, ledger: LedgerConfig) -> int:
    """Copy the price history into the warehouse's `prices` table. A dated entry ([[prices]]) already
    recorded with other values is refused: history is append-only (add an entry with a later
    valid_from), whatever its date (1970-01-01 too). Undated [prices.MODEL] tables belong to their
    definition version instead (a changed one needs a new definition_version, checked by the
    fingerprint): their row is replaced."""
    rows = price_rows(ledger)
    recorded = {(m, str(d)): (dep, maint) for m, d, dep, maint in client.query(
        f"SELECT model, valid_from, depreciation_per_hour, maintenance_per_hour FROM `{database}`.prices FINAL"
    ).result_rows}
    new = []
    for r in rows:
        values = (r["depreciation_per_hour"], r["maintenance_per_hour"])
        before = recorded.get((r["model"], r["valid_from"]))
        if before == values:
            continue
        if before is not None and not ledger.prices_undated:
            raise LedgerConfigError(
                f"price {r['version']} is recorded as depreciation {before[0]}, maintenance {before[1]} per hour but the "
                f"ledger config now says {values[0]}, {values[1]}; price history is append-only: add a [[prices]] entry "
                "with a later valid_from instead of editing this one")
        new.append(r)
    if new:
        client.insert("prices", [[r["model"], date.fromisoformat(r["valid_from"]), r["version"],
                                  r["depreciation_per_hour"], r["maintenance_per_hour"]] for r in new],
                      column_names=["model", "valid_from", "version", "depreciation_per_hour", "maintenance_per_hour"],
                      database=database)
    return len(rows)


def rebill(client, database: str, ledger: LedgerConfig, day_from: date, day_to: date, as_of: date, *,
           cost: bool = False) -> str:
    """Recompute [day_from, day_to] with the coefficients valid on `as_of` (and, with `cost`, its cost
    with the prices valid on `as_of`, under the config's cost definitions and [unpriced] policy);
    returns the rebill id. The original rows keep their cost beside it (original_cost_micros).

    Cost is recomputed at bill grain (day x job attempt x model x state): per row
    round((fixed per hour x GPU-hours + energy kWh x electricity price x PUE) x 1e6), so it can differ
    from the sum of per-record costs by the per-record rounding (under 1 micro per record)."""
    if day_to < day_from:
        raise ValueError(f"--to {day_to} is before --from {day_from}")
    table = coefficients_as_of(ledger, as_of)
    default = table.get("default")
    if default is None:
        raise LedgerConfigError(f"no 'default' coefficient valid on {as_of}")
    rebill_id = f"rb-{as_of.isoformat()}-{uuid.uuid4().hex[:8]}"
    models = sorted(m for m in table if m != "default")
    params = {
        "id": rebill_id, "from": day_from, "to": day_to,
        "models": models, "coefs": [table[m][0] for m in models], "versions": [table[m][1] for m in models],
        "default_coef": default[0], "default_version": default[1],
    }
    flagged = "NOT has({models:Array(String)}, toString(gpu_model))"  # no coefficient of its own
    cost_sql, price_version = "c_micros", "''"
    if cost:
        prices = prices_as_of(ledger, as_of)
        if "default" not in prices:
            raise LedgerConfigError(f"no 'default' price valid on {as_of}")
        priced = sorted(m for m in prices if m != "default")
        terms = {m: ledger.cost_terms_of(prices[m]) for m in [*priced, "default"]}  # (per hour, power?, cooling)
        params.update(
            priced=priced, per_hour=[terms[m][0] for m in priced], price_versions=[prices[m].version for m in priced],
            default_per_hour=terms["default"][0], default_price_version=prices["default"].version,
            # currency per joule of measured energy, PUE included (0 when power is not a cost component)
            per_joule=(ledger.electricity_price_per_kwh * terms["default"][2] / JOULES_PER_KWH
                       if terms["default"][1] else 0.0),
            zero_unpriced=int(ledger.unpriced_policy == "zero"))
        own_price = "has({priced:Array(String)}, toString(gpu_model))"
        per_hour = ("transform(toString(gpu_model), {priced:Array(String)}, {per_hour:Array(Float64)}, "
                    "{default_per_hour:Float64})")
        cost_sql = (f"if(NOT {own_price} AND {{zero_unpriced:UInt8}}, toInt128(0), toInt128(round("
                    f"({per_hour} * g_ms / 3600000 + e_j * {{per_joule:Float64}}) * 1000000)))")
        price_version = ("transform(toString(gpu_model), {priced:Array(String)}, {price_versions:Array(String)}, "
                         "{default_price_version:String})")
        flagged = f"({flagged} OR NOT {own_price})"
    client.command(
        f"""
        INSERT INTO `{database}`.rebilled_usage
            (rebill_id, day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version, gpu_ms,
             coefficient, coefficient_version, effective_gpu_ms, cost_micros, original_cost_micros, energy_j,
             price_version, priced_by_default)
        SELECT {{id:String}}, day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version,
               g_ms,
               transform(toString(gpu_model), {{models:Array(String)}}, {{coefs:Array(Float64)}}, {{default_coef:Float64}}) AS coef,
               transform(toString(gpu_model), {{models:Array(String)}}, {{versions:Array(String)}}, {{default_version:String}}),
               toUInt64(round(g_ms * coef)), {cost_sql}, c_micros, e_j, {price_version}, {flagged}
        FROM
        (
            SELECT day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version,
                   sum(gpu_ms) AS g_ms, sum(cost_micros) AS c_micros, sum(energy_j) AS e_j
            FROM `{database}`.usage_by_job_daily
            WHERE day BETWEEN {{from:Date}} AND {{to:Date}}
            GROUP BY day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version
        )
        """, parameters=params)
    client.insert("rebill_runs", [[rebill_id, day_from, day_to, as_of, cost]],
                  column_names=["rebill_id", "day_from", "day_to", "coefficients_as_of", "cost_recomputed"],
                  database=database)
    return rebill_id


def rebill_bill(client, database: str, rebill_id: str) -> list[dict]:
    """The re-billed tenant bill next to the original one, per day and tenant."""
    result = client.query(
        f"""
        SELECT r.day AS day, r.tenant AS tenant, r.definition_version AS definition_version,
               o.total_effective_gpu_hours AS original_effective_gpu_hours,
               r.total_effective_gpu_hours AS rebilled_effective_gpu_hours,
               r.compute_effective_gpu_hours AS rebilled_compute_effective_gpu_hours,
               r.idle_effective_gpu_hours AS rebilled_idle_effective_gpu_hours,
               r.failed_retry_effective_gpu_hours AS rebilled_failed_retry_effective_gpu_hours,
               r.total_cost_micros AS total_cost_micros,
               o.total_cost_micros AS original_cost_micros,
               r.compute_cost_micros AS rebilled_compute_cost_micros,
               r.idle_cost_micros AS rebilled_idle_cost_micros,
               r.failed_retry_cost_micros AS rebilled_failed_retry_cost_micros,
               r.priced_by_default_gpu_hours AS priced_by_default_gpu_hours
        FROM `{database}`.tenant_daily_rebill AS r
        LEFT JOIN `{database}`.tenant_daily_bill AS o
            ON o.day = r.day AND o.tenant = r.tenant AND o.definition_version = r.definition_version
        WHERE r.rebill_id = {{id:String}}
        ORDER BY day, tenant
        """, parameters={"id": rebill_id})
    return [dict(zip(result.column_names, row)) for row in result.result_rows]
