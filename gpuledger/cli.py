"""`gpuledger` command line. Each subcommand is a thin edge over a module function;
imports are lazy so that `gpuledger report` does not load Faust, and so on.

Why one file: every command's parser and handler, so `gpuledger --help` and this file read the
same; each handler is a few lines that call into the package doing the work."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from gpuledger.config import Settings

TABLE_REPORTS = ("bills", "jobs", "queues", "utilization", "capacity", "unmatched", "alerts", "suggestions")
PERIODIC_REPORTS = ("inventory", "monthly", "weekly", "job", "forecast")  # gpuledger.warehouse.periodic.commands.REPORT_NAMES
CARD_REPORTS = ("gpu", "gpu-fleet")  # GPU ID cards: gpuledger/warehouse/cards.py
STORAGE_REPORT = "storage"  # the warehouse's tables against their retention: gpuledger/warehouse/storage.py
REPORT_NAMES = TABLE_REPORTS + PERIODIC_REPORTS + CARD_REPORTS + (STORAGE_REPORT,)


def _refuse_empty_overrides(args) -> None:
    """`--data-dir "$DIR"` with DIR unset is a mistake, not a request for the default."""
    for option in ("data_dir", "bootstrap", "warehouse"):
        if getattr(args, option, None) == "":
            raise ValueError(f"--{option.replace('_', '-')} must not be empty")


def settings_from_args(args) -> Settings:
    _refuse_empty_overrides(args)
    overrides = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = Path(args.data_dir)
    if getattr(args, "bootstrap", None):
        overrides["kafka_bootstrap"] = args.bootstrap
    if getattr(args, "warehouse", None):
        overrides["warehouse"] = args.warehouse
    return Settings(**overrides)


def cmd_topics(args) -> int:
    from gpuledger.topics import create_topics, list_topics

    settings = settings_from_args(args)
    result = create_topics(settings) if args.action == "create" else list_topics(settings)
    for name, value in sorted(result.items()):
        print(f"{name}\t{value}")
    return 0


def cmd_migrate(args) -> int:
    from gpuledger.warehouse.library import sync_library
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect
    from gpuledger.warehouse.migrations import migrate_configured

    settings = settings_from_args(args)
    ledger = load_ledger_config(settings.ledger_config)
    client = connect(settings)
    try:
        applied = migrate_configured(client, settings)  # cluster rendering and retention TTLs as configured
        synced = sync_library(client, settings.database, ledger)
        from gpuledger.warehouse.carbon import record_definition
        record_definition(client, settings.database, ledger.carbon)  # the [carbon] definition (docs/carbon.md)
    finally:
        client.close()
    print(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else " (up to date)"))
    print(f"coefficient library: {synced['coefficients']} entries; definition version {synced['definition_version']}")
    return 0


def cmd_coefficients(args) -> int:
    from gpuledger.warehouse.library import add_coefficient, history_rows, sync_library
    from gpuledger.warehouse.report_text import render
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect

    settings = settings_from_args(args)
    if args.action == "list":
        print(render(history_rows(load_ledger_config(settings.ledger_config)), args.format), end="")
        return 0
    if args.action == "add":
        if not (args.model and args.coefficient is not None and args.valid_from):  # 0 is a value (refused below)
            raise SystemExit("coefficients add needs --model, --coefficient and --valid-from")
        if args.coefficient > 0 and not math.isfinite(args.coefficient):  # inf was written, then refused on reading
            raise ValueError(f"--coefficient must be a finite number > 0, got {args.coefficient}")
        ledger = add_coefficient(settings.ledger_config, args.model, args.coefficient, _day("--valid-from", args.valid_from))
        print(f"added {args.model}@{args.valid_from} = {args.coefficient} to {settings.ledger_config}; "
              "restart workers to use it for new records")
    else:
        ledger = load_ledger_config(settings.ledger_config)
    client = connect(settings)
    try:
        synced = sync_library(client, settings.database, ledger)
    finally:
        client.close()
    print(f"warehouse coefficient table synced: {synced['coefficients']} entries")
    return 0


def cmd_rebill(args) -> int:
    from gpuledger.warehouse.library import rebill, rebill_bill, sync_library
    from gpuledger.warehouse.report_text import render
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect

    settings = settings_from_args(args)
    # dates are checked, each by its flag, before anything is opened
    day_from, day_to, as_of = _day("--from", args.day_from), _day("--to", args.day_to), _day("--as-of", args.as_of)
    ledger = load_ledger_config(settings.ledger_config)
    client = connect(settings)
    try:
        sync_library(client, settings.database, ledger)
        rebill_id = rebill(client, settings.database, ledger, day_from, day_to, as_of, cost=args.cost)
        rows = rebill_bill(client, settings.database, rebill_id)
    finally:
        client.close()
    print(f"rebill {rebill_id}: {args.day_from}..{args.day_to} with coefficients{' and prices' if args.cost else ''} "
          f"valid on {args.as_of} (original bills unchanged)", file=sys.stderr)
    print(render(rows, args.format), end="")
    return 0


def cmd_worker(args) -> int:
    from gpuledger.streams.app import run_worker

    run_worker(settings_from_args(args), loglevel=args.loglevel)
    return 0


def cmd_watch(args) -> int:
    from gpuledger.watch import run_watch

    run_watch(settings_from_args(args), loglevel=args.loglevel)
    return 0


def cmd_tail(args) -> int:
    from gpuledger.watch import tail_alerts

    tail_alerts(settings_from_args(args), as_json=args.json, from_beginning=args.from_beginning, max_messages=args.max,
                idle_timeout_s=args.idle_timeout)
    return 0


def cmd_sink(args) -> int:
    from gpuledger.metrics import start_metrics_server
    from gpuledger.sink.loop import run_sink

    settings = settings_from_args(args)
    start_metrics_server(settings.sink_metrics_port)  # 0 = off
    stats = run_sink(settings, until_caught_up=args.until_caught_up)
    print(json.dumps(stats, default=str))
    return 0


#: `gpuledger agent KIND ...` runs `main(argv)` of this module of gpuledger.agents.
AGENT_MODULES = {
    "gpu": "gpu_agent",              # NVML (or simulated) GPU samples
    "slurm": "slurm_agent",          # Slurm controller -> lifecycle events, snapshots, watermarks
    "kubernetes": "kubernetes_agent",  # Kubernetes pods + PodResources + Kueue -> the same
    "dcgm": "dcgm_agent",            # a dcgm-exporter /metrics endpoint -> GPU samples
}


def cmd_agent(args) -> int:
    import importlib
    import os

    # the agents read their settings (load_settings) from the environment: the options go that way
    _refuse_empty_overrides(args)
    if args.bootstrap:
        os.environ["GPULEDGER_KAFKA_BOOTSTRAP"] = args.bootstrap
    if args.data_dir:  # e.g. the GPU agent's spool, <data dir>/spool/<node>
        os.environ["GPULEDGER_DATA_DIR"] = args.data_dir
    module = importlib.import_module(f"gpuledger.agents.{AGENT_MODULES[args.kind]}")
    return module.main(args.agent_args)


def cmd_simulate(args) -> int:
    from gpuledger.agents.simcluster import SimSpec, simulate
    from gpuledger.embedded.replay import publish, write_dump

    spec = SimSpec(hours=args.hours, nodes=args.nodes, seed=args.seed)
    if args.dump:
        count = write_dump(simulate(spec), Path(args.dump))
        print(f"wrote {count} messages to {args.dump}")
        return 0
    from gpuledger.agents.publisher import KafkaPublisher

    settings = settings_from_args(args)
    with KafkaPublisher(settings) as publisher:
        counts = publish(simulate(spec), publisher, settings, speedup=args.speedup)
    print(json.dumps(counts))
    return 0


def cmd_replay(args) -> int:
    from gpuledger.agents.publisher import EVENT_PRODUCER_OVERRIDES, KafkaPublisher
    from gpuledger.embedded.replay import publish, read_dump

    from gpuledger.embedded.replay import logical_line
    from gpuledger.topics import check_topics

    settings = settings_from_args(args)
    lines = read_dump(Path(args.file), settings.topic_prefix)  # an unknown topic: refused with its line
    # a missing topic would be created by the producer with the broker's default count, and a count
    # other than the settings' leaves ticks unclosed or refuses watermark copies: checked first
    check_topics(settings, sorted({settings.topic_prefix + logical_line(x.topic, settings.topic_prefix) for x in lines}))
    with KafkaPublisher(settings, **EVENT_PRODUCER_OVERRIDES) as publisher:  # a dump's job events as the agents sent them
        counts = publish(lines, publisher, settings, speedup=args.speedup,
                         progress=_progress_printer() if not args.quiet else None)
    print(json.dumps(counts))
    return 0


def _progress_printer():
    def progress(done: int, total: int) -> None:
        if total and (done == total or done % 5000 == 0):
            print(f"\r{done}/{total} messages", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return progress


def cmd_report(args) -> int:
    settings = settings_from_args(args)
    from gpuledger.warehouse.reports import REPORTS, fetch

    if args.limit is not None and (args.report not in REPORTS or args.limit < 1):
        raise ValueError(f"report {args.report} takes no --limit" if args.report not in REPORTS
                         else f"--limit must be a positive number of rows, got {args.limit}")
    if args.busy_floor_pct is not None and args.report != "unmatched":
        raise ValueError(f"report {args.report} takes no --busy-floor-pct (report unmatched does)")
    if args.report not in PERIODIC_REPORTS:  # those refuse theirs in report_options
        _refuse_options_not_taken(args)
    if args.report in PERIODIC_REPORTS:
        return _periodic_report(args, settings)
    if args.report in CARD_REPORTS:
        from gpuledger.warehouse.cards import report_command
        return report_command(args, settings)
    if args.format not in ("table", "json", "csv"):
        raise SystemExit(f"report {args.report} is printed as table, json or csv")
    if args.report == STORAGE_REPORT:
        return _storage_report(args, settings)
    from gpuledger.warehouse.report_text import render
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect_readonly

    filters = _report_filters(args)
    if args.limit is not None:
        filters["limit"] = args.limit
    if args.busy_floor_pct is not None:
        filters["busy_floor_pct"] = args.busy_floor_pct
    if args.by is not None:  # utilization only (_refuse_options_not_taken)
        if not args.by.strip(", "):  # an empty --by is a mistake, not a request for the default grouping
            from gpuledger.warehouse.reports import UTILIZATION_DIMENSIONS
            raise ValueError(f"--by needs at least one of {','.join(UTILIZATION_DIMENSIONS)} (comma-separated), "
                             f"got {args.by!r}")
        filters["by"] = args.by
    ledger = load_ledger_config(settings.ledger_config)
    if args.report == "jobs":
        import time  # the price valid now: not one agreed in advance for a later date

        filters["reference_cost_per_gpu_hour"] = ledger.reference_cost_per_gpu_hour(at_ms=int(time.time() * 1000))
    if args.report == "bills":  # each row's idle as its definition version's [idle] policy; the flag: every row's
        filters.update(idle_redistribution=args.idle_redistribution,
                       ledger_idle_redistribution=ledger.definitions.idle_redistribution)
    if args.report in ("bills", "jobs", "capacity"):
        filters["currency"] = ledger.currency
    if args.report == "suggestions":
        filters["followed_within_s"] = ledger.watch.reclaim.followed_within_s
    client = connect_readonly(settings)  # reports never create anything: a SELECT-only account is enough
    try:
        rows = fetch(client, settings.database, args.report, **filters)
    finally:
        client.close()
    _print_or_write(render(rows, args.format, utc_days=True), args.output)
    return 0


def _storage_report(args, settings: Settings) -> int:
    from gpuledger.warehouse import connect_readonly
    from gpuledger.warehouse.report_text import render
    from gpuledger.warehouse.storage import storage_rows

    if any(getattr(args, name, None) is not None for name in REPORT_FILTER_FLAGS):
        raise ValueError(f"report {STORAGE_REPORT} takes no {', '.join(REPORT_FILTER_FLAGS.values())}")
    client = connect_readonly(settings)
    try:
        rows = storage_rows(client, settings.database, settings)
    finally:
        client.close()
    _print_or_write(render(rows, args.format, utc_days=True), args.output)
    return 0


def _print_or_write(text: str, output: str | None) -> None:
    """A report's text on stdout, or in the --output file (every report's --output does the same)."""
    if output:
        Path(output).write_text(text)
        print(f"wrote {output}", file=sys.stderr)
    else:
        print(text, end="" if not text or text.endswith("\n") else "\n")


#: the options of register_report_cli, --by, --idle-redistribution and JOB_ID that a table, storage or
#: card report takes (the periodic reports' are in gpuledger/warehouse/periodic/commands.py _TAKES)
OTHER_REPORTS_TAKE = {"bills": ("idle_redistribution",), "utilization": ("by",), "gpu": ("job_id",),
                      "gpu-fleet": ("job_id",)}  # cards.report_command says gpu-fleet needs no UUID


def _refuse_options_not_taken(args) -> None:
    """An option the report does not take is an error, worded as the periodic reports' (report_options),
    not silently dropped: `report jobs j1` is not one job's report, `report bills --as-of D` not one day's."""
    from gpuledger.warehouse.periodic.commands import REPORT_OPTION_FLAGS
    from gpuledger.warehouse.reports import REPORT_FILTERS

    takes = OTHER_REPORTS_TAKE.get(args.report, ())
    extra = [flag for key, flag in REPORT_OPTION_FLAGS.items() if key not in takes and getattr(args, key, None) is not None]
    if not extra:
        return
    accepted = [flag for name, flag in REPORT_FILTER_FLAGS.items() if name in REPORT_FILTERS.get(args.report, ())]
    accepted += ["--limit"] if args.report in REPORT_FILTERS else []
    accepted += ["--busy-floor-pct"] if args.report == "unmatched" else []
    accepted += [REPORT_OPTION_FLAGS[k] for k in takes if k != "job_id"]
    hint = "; `report job JOB_ID` is one job's report" if args.report == "jobs" and args.job_id is not None else ""
    raise ValueError(f"report {args.report} takes no {', '.join(extra)} (it takes {', '.join(accepted) or 'no options'})"
                     + hint)


#: report filter flags -> fetch filter names (bills, jobs and queues take all of them)
REPORT_FILTER_FLAGS = {"tenant": "--tenant", "queue": "--queue", "cluster": "--cluster", "day_from": "--from",
                       "day_to": "--to"}


def _day(flag: str, value: str):
    from datetime import date

    try:
        return date.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"{flag} must be a UTC day YYYY-MM-DD, got {value!r}") from None


def _report_filters(args) -> dict:
    """The filters given on the command line, checked against what the report takes."""
    from gpuledger.warehouse.reports import REPORT_FILTERS

    out = {}
    for name, flag in REPORT_FILTER_FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if name not in REPORT_FILTERS.get(args.report, frozenset()):
            raise ValueError(f"report {args.report} takes no {flag}")
        out[name] = _day(flag, value) if name.startswith("day_") else value
    if out.get("day_from") and out.get("day_to") and out["day_from"] > out["day_to"]:
        raise ValueError(f"--from {out['day_from']} is after --to {out['day_to']}")
    return out


def _periodic_report(args, settings: Settings) -> int:
    from gpuledger.warehouse.periodic import commands as pr
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect_readonly

    if args.format not in ("table", "markdown", "html"):
        raise SystemExit(f"report {args.report} is printed as table, markdown or html")
    if args.report == "job" and not args.job_id:
        raise SystemExit("usage: gpuledger report job JOB_ID")
    if any(getattr(args, name, None) is not None for name in REPORT_FILTER_FLAGS):
        raise ValueError(f"report {args.report} takes no {', '.join(REPORT_FILTER_FLAGS.values())}")
    ledger = load_ledger_config(settings.ledger_config)
    options = pr.report_options(args.report, args)
    if args.report == "weekly":  # "reclaimed" counts suggestions followed within this long (docs/alerts.md)
        options["followed_within_s"] = ledger.watch.reclaim.followed_within_s
    client = connect_readonly(settings)
    try:
        report = pr.build_report(client, settings.database, args.report, **options, currency=ledger.currency)
    finally:
        client.close()
    _print_or_write(pr.render_report(report, args.format), args.output)
    return 0


#: `gpuledger bills ACTION` options -> the actions that take them (--format: every action that prints a table)
BILLS_OPTIONS = {"day": ("--day", ("show",)), "cluster": ("--cluster", ("show", "audit")),
                 "day_from": ("--from", ("audit",)), "day_to": ("--to", ("audit",)), "run": ("--run", ("publish",)),
                 "no_publish": ("--no-publish", ("close",)), "limit": ("--limit", ("list",)),
                 "textfile": ("--textfile", ("audit",)), "fail_on_duplicates": ("--fail-on-duplicates", ("audit",))}


def _refuse_bills_options_not_taken(args) -> None:
    """An option the action does not take is an error, not dropped: `bills audit --day D` audited every
    day, `bills close --cluster C` closed every cluster."""
    given = [flag for key, (flag, actions) in BILLS_OPTIONS.items()
             if args.action not in actions and getattr(args, key, None) not in (None, False)]
    if given:
        takes = [flag for flag, actions in BILLS_OPTIONS.values() if args.action in actions]
        raise ValueError(f"bills {args.action} takes no {', '.join(given)} (it takes {', '.join(takes) or 'no options'})")


def cmd_bills(args) -> int:
    """`gpuledger bills close|list|show|audit|publish` (gpuledger/warehouse/bills.py)."""
    from gpuledger.warehouse import bills
    from gpuledger.warehouse.report_text import render
    from gpuledger.ledger_files import load_ledger_config
    from gpuledger.warehouse import connect, connect_readonly

    _refuse_bills_options_not_taken(args)
    settings = settings_from_args(args)
    if args.action == "close":
        ledger = load_ledger_config(settings.ledger_config)
        publisher = None
        if not args.no_publish:
            from gpuledger.agents.publisher import KafkaPublisher

            _check_broker(settings)
            publisher = KafkaPublisher(settings)
        client = connect(settings)
        try:
            # lock_wait_s=0: a run started (by cron) while another still runs does nothing and exits 0
            result = bills.close_due(client, settings, ledger, publisher=publisher, lock_wait_s=0)
        finally:
            client.close()
            if publisher is not None:
                publisher.close()
        print(json.dumps(result.as_dict()))
        return 0
    if args.action == "publish":
        if not args.run:
            raise ValueError("bills publish needs --run BILL_RUN_ID (see `gpuledger bills list`)")
        from gpuledger.agents.publisher import KafkaPublisher

        _check_broker(settings)
        client = connect_readonly(settings)
        try:
            messages = bills.run_messages(client, settings.database, args.run)
        finally:
            client.close()
        if not messages:
            raise ValueError(f"no bill run {args.run!r} with rows in the warehouse")
        with KafkaPublisher(settings) as publisher:
            count = bills.publish(publisher, settings, messages)
        print(f"published {count} bill row(s) of {args.run} to {settings.topics.bills}")
        return 0
    if args.action == "show" and not args.day:
        raise ValueError("bills show needs --day YYYY-MM-DD")
    day = _day("--day", args.day) if args.day else None  # dates are checked before anything is opened
    day_from = _day("--from", args.day_from) if args.day_from else None
    day_to = _day("--to", args.day_to) if args.day_to else None
    if day_from and day_to and day_from > day_to:  # an audit of no day finds no duplicates
        raise ValueError(f"--from {day_from} is after --to {day_to}")
    client = connect_readonly(settings)
    try:
        if args.action == "list":
            rows = bills.list_runs(client, settings.database, limit=args.limit)
        elif args.action == "show":
            rows = bills.show(client, settings.database, day, cluster=args.cluster)
        else:  # audit
            rows = bills.audit(client, settings.database, day_from, day_to, cluster=args.cluster)
            bills.export_audit(rows)
            if args.textfile:
                from prometheus_client import REGISTRY, write_to_textfile

                write_to_textfile(args.textfile, REGISTRY)
    finally:
        client.close()
    print(render(rows, args.format, utc_days=True), end="")
    if args.action == "audit" and args.fail_on_duplicates and any(r["duplicates"] > 0 for r in rows):
        return 1
    return 0


def _check_broker(settings: Settings, timeout_s: float = 5.0) -> None:
    """Fail fast, in one line, when the broker does not answer."""
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({**settings.kafka_client_config(), "logger": logging.getLogger("gpuledger.kafka")}).list_topics(
            timeout=timeout_s)
    except Exception as exc:
        raise ConnectionError(f"cannot reach the Kafka broker at {settings.kafka_bootstrap} within {timeout_s:.0f} s "
                              f"({exc})") from exc


def cmd_demo(args) -> int:
    from gpuledger.embedded.demo import run_demo

    return run_demo(settings_from_args(args), hours=args.hours, nodes=args.nodes, seed=args.seed, dump=args.input)


def cmd_schemas(args) -> int:
    from gpuledger.schemas.export import default_output_dir, export

    for path in export(Path(args.output) if args.output else default_output_dir()):
        print(path)
    return 0


#: commands whose parsers live with their code (each module's `register_cli`), in `--help` order.
#: Importing them costs ~0.3 s (trace readers and models, Jinja, YAML, ...), so a command line that
#: names another command does not load them.
MODULE_COMMANDS = {
    "superset": "gpuledger.integrations.superset",
    "gpu": "gpuledger.warehouse.cards",
    "carbon": "gpuledger.warehouse.carbon",
    "replay-trace": "gpuledger.traces.run",
    "estimate": "gpuledger.warehouse.estimate",  # estimate, approvals (docs/planning.md)
    "approvals": "gpuledger.warehouse.estimate",
    "forecast": "gpuledger.warehouse.forecast",  # forecast run|backtest
}


def _positive_number(text: str) -> float:
    """argparse type: a finite number > 0 (a usage error before anything is opened: `--speedup 0`
    failed only after the broker was contacted, `--idle-timeout nan` never timed out)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (`tail --max 0` printed one message)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _command_word(argv: list[str]) -> str | None:
    """The subcommand a command line names: its first word that is not an option (the top level
    has only flags without values), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; `command` (the subcommand the caller will parse) leaves out the parsers of the
    modules in MODULE_COMMANDS when it is none of theirs."""
    parser = argparse.ArgumentParser(
        prog="gpuledger", description="GPU Ledger: turns GPU-cluster telemetry into an accounting of compute.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func, help: str, kafka: bool = False, warehouse: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        p.add_argument("--data-dir", help="data directory (default: GPULEDGER_DATA_DIR or ./.gpuledger)")
        if kafka:
            p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: GPULEDGER_KAFKA_BOOTSTRAP)")
        if warehouse:
            p.add_argument("--warehouse", help="'chdb', 'chdb:/dir' or http(s)://host:port (default: GPULEDGER_WAREHOUSE)")
        return p

    p = add("topics", cmd_topics, "create or list the ledger's Kafka topics", kafka=True)
    p.add_argument("action", choices=["create", "list"])

    add("migrate", cmd_migrate, "apply pending ClickHouse migrations (idempotent)", warehouse=True)

    p = add("coefficients", cmd_coefficients, "list or add throughput coefficients (history is kept); sync them to the warehouse",
            warehouse=True)
    p.add_argument("action", choices=["list", "add", "sync"])
    p.add_argument("--model")
    p.add_argument("--coefficient", type=float)
    p.add_argument("--valid-from", help="first UTC day the coefficient applies, YYYY-MM-DD")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")

    p = add("rebill", cmd_rebill, "recompute a past period's effective GPU-hours with the coefficients valid on a date",
            warehouse=True)
    p.add_argument("--from", dest="day_from", required=True, help="first day, YYYY-MM-DD")
    p.add_argument("--to", dest="day_to", required=True, help="last day, YYYY-MM-DD")
    p.add_argument("--as-of", required=True, help="use the coefficients valid on this day, YYYY-MM-DD")
    p.add_argument("--cost", action="store_true", help="recompute cost too, with the prices valid on the as-of day "
                                                      "(the original cost stays beside it)")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")

    p = add("worker", cmd_worker, "run the Faust worker (join + attribution)", kafka=True)
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])

    p = add("sink", cmd_sink, "move ledger output and lifecycle data from Kafka into ClickHouse", kafka=True, warehouse=True)
    p.add_argument("--until-caught-up", action="store_true", help="exit once every partition is consumed")

    p = add("watch", cmd_watch, "run the watcher: behaviour alerts and reclaim suggestions from the ledger's output "
                                "(docs/alerts.md)", kafka=True)
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])

    p = add("tail", cmd_tail, "print the ledger's alerts and reclaim suggestions as they arrive", kafka=True)
    p.add_argument("what", choices=["alerts"], help="alerts: the alerts and reclaim-suggestions topics")
    p.add_argument("--json", action="store_true", help="one JSON message per line instead of a sentence")
    p.add_argument("--from-beginning", action="store_true", help="start at the oldest message, not the newest")
    p.add_argument("--max", type=_positive_int, help="exit after this many messages")
    p.add_argument("--idle-timeout", type=_positive_number, help="exit after this many seconds without a message")

    p = add("agent", cmd_agent, "run an agent: 'gpu' samples GPUs with NVML (or the simulated backend); 'slurm' and "
                                "'kubernetes' read a scheduler; 'dcgm' reads a dcgm-exporter endpoint", kafka=True)
    p.add_argument("kind", choices=sorted(AGENT_MODULES))
    p.add_argument("agent_args", nargs=argparse.REMAINDER,
                   help="the agent's own options (`gpuledger agent KIND --help`)")

    p = add("simulate", cmd_simulate, "run the simulated cluster: publish its three data lines, or write a dump", kafka=True)
    p.add_argument("--hours", type=float, default=6.0)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--speedup", type=_positive_number, help="event-time speed-up (default: as fast as possible)")
    p.add_argument("--dump", help="write a JSON Lines topic dump to this file instead of publishing")

    p = add("replay", cmd_replay, "publish a recorded topic dump (JSON Lines) in event-time order", kafka=True)
    p.add_argument("file")
    p.add_argument("--speedup", type=_positive_number, help="event-time speed-up (default: as fast as possible)")
    p.add_argument("--quiet", action="store_true")

    p = add("report", cmd_report, "print a report from the ClickHouse tables", warehouse=True)
    p.add_argument("report", choices=REPORT_NAMES)
    p.add_argument("job_id", nargs="?", help="report job: the job's id; report gpu: the GPU's UUID")
    p.add_argument("--format", choices=["table", "json", "csv", "markdown", "html"], default="table",
                   help="bills/jobs/queues/utilization/capacity/unmatched/storage: table|json|csv; inventory/monthly/weekly/job: "
                        "table|markdown|html (self-contained, with plots); gpu/gpu-fleet: table|json|markdown|html")
    p.add_argument("--output", help="write the report to this file instead of printing it")
    p.add_argument("--by", help="utilization: group by any of day,cluster,gpu_model,queue,tenant,job_id (comma-separated)")
    p.add_argument("--idle-redistribution", choices=["none", "even", "usage"],
                   help="bills, monthly, weekly: share the cluster idle cost among tenants, every row alike (default: "
                        "each row's definition version's [idle] policy as recorded, the ledger's where none is)")
    p.add_argument("--tenant", help="bills, jobs, queues, utilization, alerts: only this tenant")
    p.add_argument("--queue", help="bills, jobs, queues, utilization, alerts, suggestions: only this queue")
    p.add_argument("--cluster", help="bills, jobs, queues, utilization, capacity, unmatched, alerts, suggestions: "
                                     "only this cluster")
    p.add_argument("--from", dest="day_from", help="first UTC day, YYYY-MM-DD (inclusive)")
    p.add_argument("--to", dest="day_to", help="last UTC day, YYYY-MM-DD (inclusive)")
    p.add_argument("--limit", type=int, help="bills, jobs, queues, utilization, capacity, unmatched, alerts, suggestions: "
                                              "the first N rows in the report's order (jobs: the most expensive)")
    p.add_argument("--busy-floor-pct", type=float,
                   help="unmatched: utilization above which unallocated GPU time is busy (default 1)")
    from gpuledger.warehouse.periodic.commands import register_report_cli
    register_report_cli(p)

    p = add("bills", cmd_bills, "closed billing periods: close due days (and publish them to the bills topic), list "
                                "bill runs, show a closed day with its adjustments, audit duplicate usage records",
            kafka=True, warehouse=True)
    p.add_argument("action", choices=["close", "list", "show", "audit", "publish"])
    p.add_argument("--day", help="show: the UTC day, YYYY-MM-DD")
    p.add_argument("--cluster", help="show, audit: only this cluster (audit's metrics then count this cluster's records)")
    p.add_argument("--from", dest="day_from", help="audit: first UTC day, YYYY-MM-DD")
    p.add_argument("--to", dest="day_to", help="audit: last UTC day, YYYY-MM-DD")
    p.add_argument("--run", help="publish: the bill run to send again")
    p.add_argument("--no-publish", action="store_true", help="close: write the warehouse only, send nothing to Kafka")
    p.add_argument("--limit", type=int, help="list: the latest N runs")
    p.add_argument("--textfile", help="audit: also write the metrics in Prometheus text format to this file "
                                      "(node_exporter's textfile collector)")
    p.add_argument("--fail-on-duplicates", action="store_true", help="audit: exit 1 when any record is counted twice")
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")

    p = add("demo", cmd_demo, "run the whole pipeline on the embedded default (Tansu + chDB) and print the reports")
    p.add_argument("--hours", type=float, default=6.0, help="simulated event time")
    p.add_argument("--nodes", type=int, default=8, help="simulated nodes (8 GPUs each)")
    p.add_argument("--seed", type=int, default=7, help="the simulation's random seed")
    p.add_argument("--input", metavar="DUMP", help="your own data instead of the simulation: a JSON Lines topic dump "
                                                   "(gpuledger simulate --dump, gpuledger agent slurm --print)")

    # a command of this file needs none of the modules; `--help`, a module's command and a mistyped
    # one (whose error lists every choice) need them all
    if command is None or command not in sub.choices:
        import importlib

        for module in dict.fromkeys(MODULE_COMMANDS.values()):
            importlib.import_module(module).register_cli(sub)

    p = add("schemas", cmd_schemas, "export the JSON Schema files from the pydantic models")
    p.add_argument("action", choices=["export"])
    p.add_argument("--output", metavar="DIR", help="where to write the files (default: schemas/json/ in a checkout, "
                                                   "else ./gpuledger-schemas)")
    return parser


def error_message(exc: BaseException) -> str | None:
    """The one-line message of an error the CLI knows (None: a bug, shown with its traceback)."""
    from clickhouse_connect.driver.exceptions import ClickHouseError
    from pydantic import ValidationError

    from gpuledger.embedded.pipeline import PipelineError
    from gpuledger.streams.pricing import LedgerConfigError
    from gpuledger.warehouse import WarehouseError

    if isinstance(exc, ValidationError) and exc.title == Settings.__name__:
        return f"bad settings: {'; '.join(_setting_problem(e) for e in exc.errors())}"
    if isinstance(exc, ValidationError):  # a message or record built from an option or input, not a setting
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" if e.get("loc") else e["msg"]
                             for e in exc.errors())
        return f"invalid {exc.title}: {problems}"
    if isinstance(exc, (WarehouseError, LedgerConfigError, PipelineError)):
        return str(exc)
    if isinstance(exc, ClickHouseError):
        first = next((line for line in str(exc).splitlines() if line.strip()), repr(exc))
        return f"warehouse: {first.strip()}"
    try:
        from confluent_kafka import KafkaException
    except ImportError:  # pragma: no cover
        KafkaException = ()  # noqa: N806
    if isinstance(exc, KafkaException):
        err = exc.args[0] if exc.args else exc
        return f"Kafka: {err.str() if hasattr(err, 'str') else err}"
    if isinstance(exc, (ValueError, ConnectionError, FileNotFoundError, PermissionError, TimeoutError)):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:  # a directory given for a file, a full disk, ...
        return str(exc)
    if type(exc) is RuntimeError:  # topics, publishing: messages written for people
        return str(exc)
    return None


def _setting_problem(error: dict) -> str:
    """One bad setting: its variable, what it takes and the value given (a secret's never shown)."""
    message = error["msg"].removeprefix("Value error, ")
    if not error.get("loc"):
        return message
    name = str(error["loc"][0])
    given = error.get("input")
    # pydantic's own messages ("Input should be greater than 0") do not say what was given
    if isinstance(given, str) and "got " not in message and "password" not in name:
        message += f", got {given[:80]!r}"
    return f"GPULEDGER_{name.upper()}: {message}"


#: commands that run the embedded pipeline (a broker and child processes) in this process
PIPELINE_COMMANDS = ("demo", "replay-trace")


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """For the block, SIGTERM (timeout, docker stop, CI cancel) raises SystemExit(143), so the
    with-blocks stop the broker and the children; Python's default would exit without unwinding.
    Only for PIPELINE_COMMANDS: the worker, watch and agents handle SIGTERM themselves."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return

    def handler(signum, _frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_word(argv)).parse_args(argv)
    if args.command != "agent":  # agents set up their own logging (--log-level, INFO by default)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with exit_on_sigterm() if args.command in PIPELINE_COMMANDS else contextlib.nullcontext():
            return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, str):  # a command's own usage message
            print(f"gpuledger: error: {exc.code}", file=sys.stderr)
            return 2
        raise
    except Exception as exc:
        message = error_message(exc)
        if message is None:
            raise
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"gpuledger: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
