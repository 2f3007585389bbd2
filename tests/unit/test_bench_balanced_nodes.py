"""bench/join.py `balanced_node_names`: the join benchmark's nodes fill every gpu-samples partition
evenly under the partitioner the ledger's producers use (murmur2 of the node name, Java-compatible)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.join import balanced_node_names, sample_partition


def test_names_fill_every_partition_evenly():
    names = balanced_node_names(48, 8)
    assert len(set(names)) == 48 and names[0] == "sim-node00"
    assert Counter(sample_partition(n, 8) for n in names) == {p: 6 for p in range(8)}
    # the simulator's own first 48 names do not: 26 of them on the even partitions, 22 on the odd
    plain = Counter(sample_partition(f"sim-node{i:02d}", 8) for i in range(48))
    assert sum(plain[p] for p in (0, 2, 4, 6)) == 26


@pytest.mark.parametrize("partitions", [1, 3, 8])
def test_counts_differ_by_at_most_one(partitions):
    for nodes in range(1, 60):
        counts = Counter(sample_partition(n, partitions) for n in balanced_node_names(nodes, partitions))
        per_partition = [counts.get(p, 0) for p in range(partitions)]
        assert sum(per_partition) == nodes and max(per_partition) - min(per_partition) <= 1, (nodes, per_partition)


@pytest.mark.parametrize("key, java_hash", [
    # Apache Kafka's own test vectors for Utils.murmur2 (the hash of its default partitioner,
    # which librdkafka's murmur2_random and aiokafka's DefaultPartitioner reproduce)
    ("21", -973932308), ("foobar", -790332482), ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829), ("abc", 479470107),
])
def test_partition_is_kafkas_murmur2(key, java_hash):
    for partitions in (3, 8, 24):
        assert sample_partition(key, partitions) == (java_hash & 0x7FFFFFFF) % partitions
