"""Superset configuration for GPU Ledger (the CI check and the compose stack).

Environment:
  SUPERSET_SECRET_KEY         set your own outside tests and the demo stack: the default below is public,
                              and whoever knows the key can forge Superset sessions (Superset refuses only
                              its own placeholder, not this one)
  SUPERSET_METADATA_URI       metadata database (default: SQLite under SUPERSET_HOME)
"""

import os

SECRET_KEY = os.environ.get("SUPERSET_SECRET_KEY", "gpuledger-test-only-change-me")
_home = os.environ.get("SUPERSET_HOME", os.path.expanduser("~/.superset"))
SQLALCHEMY_DATABASE_URI = os.environ.get("SUPERSET_METADATA_URI", f"sqlite:///{_home}/superset.db?check_same_thread=false")

# roles and users through the REST API (tenant roles for row-level security)
FAB_ADD_SECURITY_API = True
# no outside network: no example data, no map tiles, no telemetry
SUPERSET_LOAD_EXAMPLES = False
FEATURE_FLAGS = {"DASHBOARD_RBAC": False, "ENABLE_TEMPLATE_PROCESSING": False}
# single-process server in CI: keep results in process memory
CACHE_CONFIG = {"CACHE_TYPE": "SimpleCache", "CACHE_DEFAULT_TIMEOUT": 300}
DATA_CACHE_CONFIG = CACHE_CONFIG
FILTER_STATE_CACHE_CONFIG = CACHE_CONFIG
EXPLORE_FORM_DATA_CACHE_CONFIG = CACHE_CONFIG
THUMBNAIL_CACHE_CONFIG = {"CACHE_TYPE": "NullCache"}
RATELIMIT_STORAGE_URI = "memory://"
# the embedded chDB engine is in this process: no async query workers
GLOBAL_ASYNC_QUERIES = False
SQLLAB_ASYNC_TIME_LIMIT_SEC = 60
WTF_CSRF_TIME_LIMIT = None
TALISMAN_ENABLED = False
