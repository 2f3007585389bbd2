import time, collections, sys
import bench.join as J
from gpuledger.broker import EmbeddedBroker
from bench.common import workdir, SIZES
from confluent_kafka import Consumer, TopicPartition
captured = {}
orig_ws = J.worker_pass
def read_topic_ts(s, topic):
    c = Consumer({**s.kafka_client_config(), "group.id": "h", "enable.auto.commit": False})
    parts = c.list_topics(topic, timeout=10).topics[topic].partitions
    c.assign([TopicPartition(topic, p, 0) for p in parts])
    out=[]; last=time.monotonic()
    while time.monotonic()-last < 2:
        for m in c.consume(1000, 0.2):
            if m.error() is None: out.append(m.timestamp()[1]); last=time.monotonic()
    c.close(); return sorted(out)
orig_stop = J.ChildProcess.stop
def stop(self):
    s = self.settings
    captured["na"] = read_topic_ts(s, s.topics.node_allocations)
    captured["us"] = read_topic_ts(s, s.topics.usage)
    return orig_stop(self)
J.ChildProcess.stop = stop
with EmbeddedBroker(log_path=workdir() / "tansu.log") as broker:
    batch = J.make_batch(SIZES.join_nodes, SIZES.join_hours)
    r = J.worker_pass(broker.bootstrap, batch, 1, "hist")
    end = captured["us"][-1] / 1000; start = end - r["seconds"]
    print(r["samples_per_s"], r["worker_cores_busy"], r["publish_s"])
    for name in ("na", "us"):
        h = collections.Counter(int((t / 1000 - start) * 4) / 4 for t in captured[name])
        print(name)
        for k in sorted(h):
            if k > -1: print(f"{k:5.2f}s {'#' * min(100, h[k] // 3)} {h[k]}")
