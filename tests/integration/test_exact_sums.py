"""Report figures that are sums of floats do not change from one run to the next: the engine adds a
group's rows in whatever order its threads deliver them, and a float sum's last digits follow that order
(a job's co2e_kg in `gpuledger report jobs` read 5.268479999999999 in one run and 5.26848 in the next on
the same warehouse). carbon.exact_sum adds whole units instead (docs/carbon.md)."""

from __future__ import annotations

import tempfile

import pytest
from clickhouse_connect import get_client

from gpuledger.warehouse.carbon import exact_sum

pytestmark = pytest.mark.integration

VALUES = [0.1, 0.2, 0.3]


@pytest.fixture(scope="module")
def client():
    return get_client(interface="chdb", path=tempfile.mkdtemp(prefix="exact-sums-"))


def summed(client, expression: str, values: list[float]) -> float:
    # one thread: the rows are added in the array's order
    sql = f"SELECT {expression} FROM (SELECT arrayJoin({values!r}) AS v) SETTINGS max_threads = 1"
    return client.query(sql).result_rows[0][0]


def test_a_float_sum_depends_on_the_order_and_the_exact_sum_does_not(client):
    forward, backward = VALUES, VALUES[::-1]
    assert summed(client, "sum(v)", forward) != summed(client, "sum(v)", backward)  # what the fix is for
    exact = summed(client, exact_sum("v", 9), forward)
    assert exact == summed(client, exact_sum("v", 9), backward)
    assert exact == 0.6  # 0.6000000000000001 in one order of the float sum, 0.6 in the other


def test_the_divisor_is_applied_once_to_the_whole_number(client):
    # 61,200.4 J in two rows: 61,200,400 mJ / 3,600,000,000 = 0.0170001111... kWh
    assert summed(client, exact_sum("v", 3, 3_600_000), [61_200.1, 0.3]) == 61_200_400 / 3_600_000_000
    assert summed(client, exact_sum("v", 9, 1000), [4139.52]) == 4.13952
