"""Replaying public production GPU traces through the real pipeline (`gpuledger replay-trace`).

Two traces from alibaba/clusterdata (docs/traces.md: where to get them, what the results show):

- **alibaba-v2023** (cluster-trace-gpu-v2023, "openb"): a pod list (creation / scheduled /
  deletion times, GPUs asked for, fractional GPU shares, allowed GPU models, QoS, final phase)
  and a node list (GPUs and their models). No utilization samples.
- **alibaba-genai** (cluster-trace-v2026-GenAI): GPU duty cycle and GPU memory of 143 serving
  pods, one sample about every 57 s over 22.8 h.

Each replay turns the trace into the ledger's three data lines (`Emission`s in event-time
order, as the simulator emits them), pushes them through Tansu, the Faust worker and the sink
into chDB (`gpuledger.embedded.pipeline.run_embedded`), then prints a JSON summary computed **from the
ClickHouse tables** (job_attempts, job_events, usage_raw, scheduler_snapshots, node_inventory).

Modules: readers.py (CSV / tar.gz -> small records, the emission stream), v2023.py and genai.py
(one per trace: records -> emissions, pure, unit tested without Kafka or ClickHouse), summary.py
(summary SQL), run.py (the replay through the pipeline, progress, the CLI edge).

Time: trace timestamps are seconds relative to the trace's own origin (the GenAI ones are
anonymized); they are mapped onto EPOCH_BASE_MS (2023-01-01T00:00:00Z) so that every ts_ms is a
valid epoch time. Replays run on event time only: as fast as the pipeline goes.
"""
