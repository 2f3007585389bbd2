"""Periodic reports from the warehouse: inventory, monthly, weekly, and the per-job health report.

    report = build_report(client, "gpuledger", "inventory", days=30, currency="USD")
    print(render_report(report, "markdown"))          # or "table", "html"

The pieces live in gpuledger/warehouse/periodic/: `queries` (shared SQL), `builders` (the four reports),
`model` (Report, Section, Plot, Coverage), `columns` (headers and units of every column),
`charts` (matplotlib plots as inline SVG), `render` (text, and Jinja2 templates for Markdown and HTML).
HTML is one self-contained page: inline CSS and SVG plots, no script, nothing fetched.
"""

from __future__ import annotations

from gpuledger.warehouse import reports as base_reports
from gpuledger.warehouse.periodic import builders
from gpuledger.warehouse import forecast  # the latest stored run (gpuledger forecast run)
from gpuledger.warehouse.periodic.model import Coverage, Plot, Report, Section
from gpuledger.warehouse.periodic.queries import LAYERS, balance_score, last_day
from gpuledger.warehouse.periodic.render import FORMATS, render_report

__all__ = ["REPORT_NAMES", "FORMATS", "LAYERS", "Coverage", "Plot", "Report", "Section", "balance_score",
           "build_report", "last_day", "register_report_cli", "render_report", "report_options"]

REPORT_NAMES = ("inventory", "monthly", "weekly", "job", "forecast")
_BUILDERS = {"inventory": builders.inventory, "monthly": builders.monthly, "weekly": builders.weekly,
             "job": builders.job, "forecast": forecast.forecast_report}


#: the reports whose money is read with its currency (the ledger's: for versions with none recorded)
_PRICED = ("inventory", "monthly", "weekly")


def build_report(client, database: str, name: str, **opts) -> Report:
    """Build one report. Options: inventory(days=30, as_of, low_util_pct=20, top=10, cards_listed=50),
    monthly(month='YYYY-MM' or as_of, top=10, idle_redistribution, ledger_idle_redistribution='none'),
    weekly(as_of, top=10, idle_share=0.3, anomalies_per_kind=20, idle_redistribution,
    ledger_idle_redistribution='none'), job(job_id, stall_s=60, stretches_listed=50); `currency`: the
    ledger's. Cluster idle is shared as each definition version's recorded [idle] policy says
    (ledger_idle_redistribution where none is recorded), or as idle_redistribution says for every row."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown report {name!r}; reports: {', '.join(REPORT_NAMES)}")
    opts = {k: v for k, v in opts.items() if v is not None}
    currency = opts.pop("currency", "")
    if name in _PRICED:
        opts["currency"] = currency
    # its sections read the open days once, and no carbon (no periodic report shows it)
    with base_reports.one_reading(), base_reports.without_carbon():
        report = _BUILDERS[name](client, database, **opts)
    # the money's own currency where the report read it (one, or none where it holds several)
    found = report.currencies
    report.currency = currency if not found else found[0] if len(found) == 1 else ""
    return report


# --------------------------------------------------------------------------- CLI
def register_report_cli(parser) -> None:
    """Options the periodic reports take, for `gpuledger report`."""
    parser.add_argument("--days", type=int, help="inventory: length of the period in days (default 30)")
    parser.add_argument("--as-of", help="last day of the period, YYYY-MM-DD (default: the last day with usage)")
    parser.add_argument("--month", help="monthly: YYYY-MM (default: the month of --as-of)")
    parser.add_argument("--top", type=int, help="how many jobs in the top lists (default 10)")
    parser.add_argument("--cards", type=int, dest="cards_listed",
                        help="inventory: the lowest-utilization cards listed, the rest summed in one row (default 50)")
    parser.add_argument("--anomalies", type=int, dest="anomalies_per_kind",
                        help="weekly: the largest anomalies listed per kind, the rest summed in one row (default 20)")
    parser.add_argument("--stretches", type=int, dest="stretches_listed",
                        help="job: the idle stretches with the most idle GPU-time listed, the rest summed in one row "
                             "(default 50)")


#: parsed-argument names of the options only some reports take -> their flags
REPORT_OPTION_FLAGS = {"job_id": "JOB_ID", "days": "--days", "as_of": "--as-of", "month": "--month", "top": "--top",
                       "cards_listed": "--cards", "anomalies_per_kind": "--anomalies", "stretches_listed": "--stretches",
                       "idle_redistribution": "--idle-redistribution", "by": "--by"}
#: what each report takes of them
_TAKES = {"inventory": ("days", "as_of", "top", "cards_listed"),
          "monthly": ("month", "as_of", "top", "idle_redistribution"),
          "weekly": ("as_of", "top", "anomalies_per_kind", "idle_redistribution"),
          "job": ("job_id", "stretches_listed"), "forecast": ()}


def report_options(name: str, args) -> dict:
    """The build_report options of `name` from parsed arguments (see register_report_cli). An option
    the report does not take is an error (as the filter flags are), not silently dropped; monthly and
    weekly share the cluster idle as `report bills` does: as --idle-redistribution says for every row,
    else as each definition version's recorded policy, the ledger's for a version with none."""
    get = lambda k: getattr(args, k, None)  # noqa: E731
    takes = _TAKES[name]
    extra = [flag for key, flag in REPORT_OPTION_FLAGS.items() if key not in takes and get(key) is not None]
    if extra:
        accepted = ", ".join(REPORT_OPTION_FLAGS[k] for k in takes if k != "job_id") or "no options"
        raise ValueError(f"report {name} takes no {', '.join(extra)} (it takes {accepted})")
    options = {key: get(key) for key in takes}
    if "idle_redistribution" in takes:
        options["ledger_idle_redistribution"] = _ledger_idle_policy(args)
    return options


def _ledger_idle_policy(args) -> str:
    """The [idle] redistribution of the ledger the command runs with (what `report bills` uses)."""
    from gpuledger.cli import settings_from_args
    from gpuledger.ledger_files import load_ledger_config

    return load_ledger_config(settings_from_args(args).ledger_config).definitions.idle_redistribution
