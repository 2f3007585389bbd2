-- A GPU's down records, each record id once, for the GPU ID cards (issue #13 point 3; docs/gpu-cards.md).
-- The gpu_cards view (sql/0020) summed every card's down time from usage_raw, deduplicating every `down`
-- record of every day with LIMIT 1 BY (0.7-1.0 s at 100 M records, for a chart of a few rows). Down
-- records are a small share of usage (one in fifty in the benchmark); this table keeps only them, as a
-- ReplacingMergeTree sorted by the record's identity, so FINAL folds the copies a replay writes, as in
-- usage_raw (sql/0022). Filled by its materialized view and back-filled from usage_raw (only into an
-- empty table: a file run again adds nothing; apply it with the sinks stopped, as 0018).

CREATE TABLE IF NOT EXISTS gpu_down_records
(
    cluster     LowCardinality(String),
    gpu_uuid    String,
    day         Date,
    start_ms    Int64,
    record_id   String,
    gpu_ms      UInt64
)
ENGINE = ReplacingMergeTree
PARTITION BY toYYYYMM(day)
ORDER BY (cluster, gpu_uuid, start_ms, record_id)
SETTINGS non_replicated_deduplication_window = 1000;

CREATE MATERIALIZED VIEW IF NOT EXISTS gpu_down_records_mv TO gpu_down_records AS
SELECT cluster, gpu_uuid, day, start_ms, record_id, gpu_ms
FROM usage_raw
WHERE state = 'down';

INSERT INTO gpu_down_records
SELECT cluster, gpu_uuid, day, start_ms, record_id, gpu_ms
FROM usage_raw
WHERE state = 'down' AND (SELECT count() FROM gpu_down_records) = 0;

-- The cards as in sql/0020, with down time from gpu_down_records.
CREATE OR REPLACE VIEW gpu_cards AS
SELECT
    s.gpu_uuid AS gpu_uuid, s.gpu_model AS gpu_model, s.serial AS serial, s.board_part_number AS board_part_number,
    s.vbios_version AS vbios_version, s.first_seen AS first_seen, s.last_seen AS last_seen, s.nodes AS nodes,
    r.repairs AS repairs, if(r.repairs > 0, r.last_repaired, NULL) AS last_repaired,
    if(r.repairs >= 2, 'suggest lower-priority work', '') AS flag,
    d.down_seconds AS down_seconds, h.xid_errors AS xid_errors,
    h.avg_temperature_c AS avg_temperature_c, h.max_temperature_c AS max_temperature_c
FROM
(
    SELECT
        gpu_uuid,
        argMax(toString(gpu_model), last_seen_ms) AS gpu_model,
        argMaxIf(serial, last_seen_ms, serial != '') AS serial,
        argMaxIf(board_part_number, last_seen_ms, board_part_number != '') AS board_part_number,
        argMaxIf(vbios_version, last_seen_ms, vbios_version != '') AS vbios_version,
        fromUnixTimestamp64Milli(min(first_seen_ms), 'UTC') AS first_seen,
        fromUnixTimestamp64Milli(max(last_seen_ms), 'UTC') AS last_seen,
        uniqExact(cluster, node) AS nodes
    FROM gpu_sightings
    GROUP BY gpu_uuid
) AS s
LEFT JOIN
(
    SELECT gpu_uuid, count() AS repairs, fromUnixTimestamp64Milli(max(repaired_ms), 'UTC') AS last_repaired
    FROM gpu_repairs
    GROUP BY gpu_uuid
) AS r ON s.gpu_uuid = r.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, sum(gpu_ms) / 1000 AS down_seconds
    FROM gpu_down_records FINAL
    GROUP BY gpu_uuid
) AS d ON s.gpu_uuid = d.gpu_uuid
LEFT JOIN
(
    SELECT gpu_uuid, sum(xid_count) AS xid_errors, avgMerge(temperature_c) AS avg_temperature_c,
           maxMerge(max_temperature_c) AS max_temperature_c
    FROM gpu_health_hourly
    GROUP BY gpu_uuid
) AS h ON s.gpu_uuid = h.gpu_uuid;
