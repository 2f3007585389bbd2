-- Approvals per cluster (review finding on sql/0021): Slurm numbers jobs per cluster, but an approval
-- named only its job id, and `gpuledger approvals` sent each row to <prefix>approvals keyed by the job
-- id: approving cluster c1's `llm-1` read, on the topic, as the approval of cluster c2's pending `llm-1`
-- (an over-threshold run admitted). An approval is now of (cluster, job id): the rows carry the cluster
-- and the pilot attempt the estimate was priced from (gpuledger/warehouse/estimate.py fills both from
-- the estimate), and the topic's key is "<cluster>/<job id>" (docs/planning.md, "Approvals").
-- Rows written before this file have cluster '' and attempt 0; their pending row keeps the whole
-- estimate as JSON, which names both, so approvals_current reads them from there. Nothing is back-filled
-- (the table is append-only).

ALTER TABLE approvals ADD COLUMN IF NOT EXISTS cluster LowCardinality(String) DEFAULT '' AFTER approval_id;
ALTER TABLE approvals ADD COLUMN IF NOT EXISTS attempt UInt32 DEFAULT 0 AFTER job_id;

CREATE OR REPLACE VIEW approvals_current AS
SELECT approval_id,
       if(max(cluster) != '', max(cluster), JSONExtractString(argMin(estimate, ts_ms), 'cluster')) AS cluster,
       argMax(job_id, ts_ms) AS job_id,
       greatest(max(attempt), JSONExtract(argMin(estimate, ts_ms), 'attempt', 'UInt32')) AS attempt,
       argMax(status, ts_ms) AS status,
       min(ts_ms) AS requested_ms, max(ts_ms) AS updated_ms, argMax(decided_by, ts_ms) AS decided_by,
       argMax(note, ts_ms) AS note, argMax(target, ts_ms) AS target,
       argMax(cost_micros, ts_ms) / 1e6 AS estimated_cost, argMax(cost_high_micros, ts_ms) / 1e6 AS estimated_cost_high,
       argMax(threshold_micros, ts_ms) / 1e6 AS threshold_cost, argMax(currency, ts_ms) AS currency,
       argMax(gpu_hours, ts_ms) AS gpu_hours, argMax(wall_hours, ts_ms) AS wall_hours
FROM approvals GROUP BY approval_id;
