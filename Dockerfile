# GPU Ledger image: one image for every ledger service (topics, migrate, worker, sink, agents,
# simulate, replay, report). `docker compose build` builds it; `docker run IMAGE --help` lists
# the subcommands.

# ---- build stage: wheels for the package and all of its dependencies
FROM python:3.11-slim AS build

# A compiler only for the rare dependency without a wheel for this platform (e.g. on arm64);
# it stays in this stage and never reaches the runtime image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, in their own layer, read from pyproject.toml: they change far less often
# than the code, so a code edit does not re-download them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
 && pip wheel --wheel-dir /wheels -r requirements.txt

# The package itself as a regular (non-editable) wheel: package data (sql/*.sql,
# schemas/json/*.json, gpuledger/ledger_defaults.toml, the Superset bundle, the report templates,
# the PodResources proto) is declared in pyproject.toml.
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- runtime stage
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GPULEDGER_DATA_DIR=/var/lib/gpuledger

RUN useradd --create-home --uid 10001 ledger \
 && mkdir -p /var/lib/gpuledger \
 && chown ledger:ledger /var/lib/gpuledger

COPY --from=build /wheels /tmp/wheels
RUN pip install --no-index --find-links /tmp/wheels gpuledger \
 && rm -rf /tmp/wheels \
 && python -c "from importlib.resources import files as f; \
assert (f('gpuledger') / 'ledger_defaults.toml').is_file(), 'ledger_defaults.toml missing'; \
assert any(p.name.endswith('.sql') for p in f('gpuledger.sql').iterdir()), 'sql/*.sql missing'; \
assert any(p.name.endswith('.json') for p in (f('gpuledger.schemas') / 'json').iterdir()), 'schemas/json/*.json missing'" \
 && gpuledger --help > /dev/null

USER ledger
WORKDIR /home/ledger

ENTRYPOINT ["gpuledger"]
CMD ["--help"]
