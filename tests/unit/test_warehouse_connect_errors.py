"""What `connect` says when a ClickHouse server cannot be used: the password of a warehouse URL never
appears in the message (it goes to logs and terminals), and a refused login is told from an unreachable
server. The unreachable server is a closed port; the refused login is the driver's error for it."""

from __future__ import annotations

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from gpuledger.config import Settings
from gpuledger.warehouse import WarehouseError, client as warehouse_client, connect


def test_the_password_of_the_url_is_not_in_the_message(monkeypatch):
    def unreachable(**kwargs):
        raise OperationalError("Error HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded "
                               "(Connection refused) executing HTTP request attempt 1 (http://127.0.0.1:1)")
    monkeypatch.setattr(warehouse_client.clickhouse_connect, "get_client", unreachable)
    with pytest.raises(WarehouseError) as err:
        connect(Settings(warehouse="http://alice:s3cret@127.0.0.1:1", database="x"))
    assert "s3cret" not in str(err.value)
    assert "cannot reach ClickHouse at http://alice:***@127.0.0.1:1" in str(err.value)


def test_a_refused_login_says_so(monkeypatch):
    def refuse(**kwargs):
        raise DatabaseError("Received ClickHouse exception, code: 516, server response: Code: 516. DB::Exception: "
                            "bob: Authentication failed: password is incorrect, or there "
                            "is no user with such name. (AUTHENTICATION_FAILED)",
                            code=516, name="AUTHENTICATION_FAILED")
    monkeypatch.setattr(warehouse_client.clickhouse_connect, "get_client", refuse)
    with pytest.raises(WarehouseError) as err:
        connect(Settings(warehouse="https://ch:8123", database="x", clickhouse_user="bob"))
    message = str(err.value)
    assert "cannot reach" not in message and "\n" not in message
    assert message.startswith("ClickHouse at https://ch:8123 refused user 'bob': authentication failed")
    assert "GPULEDGER_CLICKHOUSE_PASSWORD" in message
    # a user named in the URL is not the one the driver logs in as (GPULEDGER_CLICKHOUSE_USER is)
    with pytest.raises(WarehouseError) as err:
        connect(Settings(warehouse="https://carol:pw@ch:8123", database="x", clickhouse_user="bob"))
    assert "the user 'carol' in GPULEDGER_WAREHOUSE is not used" in str(err.value)
    assert "pw@" not in str(err.value) and "https://carol:***@ch:8123" in str(err.value)
