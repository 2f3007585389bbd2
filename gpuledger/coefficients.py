"""The coefficient library and re-billing.

Source of truth: the `[[coefficients]]` entries of the ledger config file (history kept, each
entry valid from its date until the next entry of the same model). `sync_library` copies the
history and the current definition version into the warehouse (tables `coefficients`,
`definitions`); `rebill` recomputes a past period's effective GPU-hours with the
coefficients valid on a chosen date into `rebilled_usage`, leaving the original bills as they
were. See docs/accounting.md."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict
from datetime import date
from pathlib import Path

from gpuledger.streams.pricing import BUNDLED_CONFIG, LedgerConfig, LedgerConfigError, date_ms, load_ledger_config

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")


def history_rows(ledger: LedgerConfig) -> list[dict]:
    """Every coefficient entry, oldest first per model."""
    rows = []
    for model in sorted(ledger.coefficients):
        for entry in ledger.coefficients[model]:
            rows.append({"model": model, "coefficient": entry.coefficient,
                         "valid_from": entry.version.split("@", 1)[1], "version": entry.version})
    return rows


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
    """Append a coefficient entry to the ledger config file (history is never edited)."""
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
    with open(config_path, "a") as f:
        f.write(f'\n[[coefficients]]\nmodel = "{model}"\ncoefficient = {coefficient!r}\nvalid_from = "{day}"\n')
    return load_ledger_config(config_path)


def sync_library(client, database: str, ledger: LedgerConfig) -> dict:
    """Copy the coefficient history and the definition version into the warehouse.

    Refuses a definition version already recorded with different content."""
    recorded = client.query(
        f"SELECT DISTINCT fingerprint FROM `{database}`.definitions WHERE definition_version = {{v:String}}",
        parameters={"v": ledger.definition_version}).result_rows
    fingerprints = {row[0] for row in recorded}
    if fingerprints and ledger.fingerprint not in fingerprints:
        raise LedgerConfigError(
            f"definition_version {ledger.definition_version!r} is already recorded with different content; "
            "bump definition_version in the ledger config so old bills keep their meaning")
    if not fingerprints:
        content = json.dumps({"definitions": asdict(ledger.definitions), "currency": ledger.currency,
                              "prices": {m: asdict(p) for m, p in ledger.prices.items()},
                              "electricity_price_per_kwh": ledger.electricity_price_per_kwh, "pue": ledger.pue},
                             sort_keys=True)
        client.insert("definitions", [[ledger.definition_version, ledger.fingerprint, content]],
                      column_names=["definition_version", "fingerprint", "content"], database=database)
    rows = history_rows(ledger)
    if rows:
        client.insert("coefficients",
                      [[r["model"], r["coefficient"], date.fromisoformat(r["valid_from"]), r["version"]] for r in rows],
                      column_names=["model", "coefficient", "valid_from", "version"], database=database)
    return {"coefficients": len(rows), "definition_version": ledger.definition_version,
            "definition_recorded": not fingerprints}


def rebill(client, database: str, ledger: LedgerConfig, day_from: date, day_to: date, as_of: date) -> str:
    """Recompute [day_from, day_to] with the coefficients valid on `as_of`; returns the rebill id."""
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
    client.command(
        f"""
        INSERT INTO `{database}`.rebilled_usage
        SELECT {{id:String}}, day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version,
               g_ms,
               transform(toString(gpu_model), {{models:Array(String)}}, {{coefs:Array(Float64)}}, {{default_coef:Float64}}) AS coef,
               transform(toString(gpu_model), {{models:Array(String)}}, {{versions:Array(String)}}, {{default_version:String}}),
               toUInt64(round(g_ms * coef)), c_micros
        FROM
        (
            SELECT day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version,
                   sum(gpu_ms) AS g_ms, sum(cost_micros) AS c_micros
            FROM `{database}`.usage_by_job_daily
            WHERE day BETWEEN {{from:Date}} AND {{to:Date}}
            GROUP BY day, cluster, tenant, queue, job_id, attempt, gpu_model, state, definition_version
        )
        """, parameters=params)
    client.insert("rebill_runs", [[rebill_id, day_from, day_to, as_of]],
                  column_names=["rebill_id", "day_from", "day_to", "coefficients_as_of"], database=database)
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
               r.total_cost_micros AS total_cost_micros
        FROM `{database}`.tenant_daily_rebill AS r
        LEFT JOIN `{database}`.tenant_daily_bill AS o
            ON o.day = r.day AND o.tenant = r.tenant AND o.definition_version = r.definition_version
        WHERE r.rebill_id = {{id:String}}
        ORDER BY day, tenant
        """, parameters={"id": rebill_id})
    return [dict(zip(result.column_names, row)) for row in result.result_rows]
