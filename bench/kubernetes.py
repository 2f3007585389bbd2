"""The Kubernetes agent's state file at fleet scale (pure core, a real disk): what a 1-s cycle that
changed something costs to save, with the journal (`StateFile`) against rewriting the whole state
(what the agent did before, and still does at its first save and when the journal outgrows it).

A cluster of N GPUs as 8-GPU pods, one per job, as the core tracks them (`PodTrack`, `JobTrack`,
container ids and device uuids of the usual lengths); each cycle CHANGED pods change (a pod starts,
ends or moves on) and the watermark moves on. Per cycle: CPU seconds of this process and bytes
written, both ways, in the same run on the same disk (fsync included in the wall time).

    .venv/bin/python -m bench.kubernetes
"""

from __future__ import annotations

import json
import shutil
import statistics
import time

from bench.common import QUICK, say, workdir

GPUS = (1_000, 10_000) if QUICK else (1_000, 10_000, 100_000)
CYCLES = 10
CHANGED = 4   # pods changed per 1-s cycle: a 12,500-pod cluster whose pods live ~1 h, each changing ~3 times


def cluster(gpus: int):
    from gpuledger.agents.kubernetes import JobTrack, KubernetesLedger, KubernetesMapping, PodTrack

    core = KubernetesLedger(KubernetesMapping(cluster="bench"))
    for i in range(gpus // 8):
        namespace, job_id, uid = f"team-{i % 40}", f"team-{i % 40}/job/train-{i}", f"{i:08x}-5e1f-4c0a-9d2b-7f3e21a0c4d9"
        core.jobs[job_id] = JobTrack(job_id=job_id, tenant=namespace, queue="gpu-queue", requested_gpus=8.0, attempt=1,
                                     running=True, live=[uid], last_ts=1_796_000_000_000)
        core.pods[uid] = PodTrack(uid=uid, namespace=namespace, name=f"train-{i}-worker-0", job_id=job_id, attempt=1,
                                  node=f"gpu-node-{i:05d}", scheduled_ms=1_796_000_000_000, allocated=True, started=True,
                                  gpus=[[f"gpu-node-{i:05d}", f"GPU-{i:08x}-3f1c-4b6e-9a27-{g:012x}", g, 1.0, "trainer",
                                         f"{i:056x}{g:08x}"] for g in range(8)])
    core.watermark_ms = 1_796_000_000_000
    return core


def measure(gpus: int) -> dict:
    from gpuledger.agents.kubernetes_agent import StateFile, _write_atomically

    core = cluster(gpus)
    folder = workdir() / f"k8s-state-{gpus}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    files = StateFile(folder / "state.json")
    t0 = time.process_time()
    files.save(core)
    first_cpu_s = time.process_time() - t0
    whole_bytes = files.path.stat().st_size
    pods = list(core.pods.values())
    journal, whole = [], []
    for cycle in range(CYCLES):
        for k in range(CHANGED):
            pod = pods[(cycle * CHANGED + k) * 7919 % len(pods)]
            pod.started = not pod.started
        core.watermark_ms += 1000
        before = files.journal_path.stat().st_size
        c0, w0 = time.process_time(), time.perf_counter()
        files.save(core)
        journal.append((time.process_time() - c0, time.perf_counter() - w0, files.journal_path.stat().st_size - before))
        c0, w0 = time.process_time(), time.perf_counter()
        data = core.state_bytes()            # the whole state, as every such cycle wrote it before
        _write_atomically(folder / "whole.json", data)
        whole.append((time.process_time() - c0, time.perf_counter() - w0, len(data)))
    shutil.rmtree(folder, ignore_errors=True)
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    out = {"gpus": gpus, "pods": len(pods), "changed_pods_per_cycle": CHANGED, "whole_bytes": whole_bytes,
           "first_save_cpu_s": round(first_cpu_s, 3),
           "journal_bytes_per_cycle": round(med(journal, 2)), "journal_cpu_s": round(med(journal, 0), 4),
           "journal_wall_s": round(med(journal, 1), 4),
           "whole_bytes_per_cycle": round(med(whole, 2)), "whole_cpu_s": round(med(whole, 0), 4),
           "whole_wall_s": round(med(whole, 1), 4)}
    # one whole rewrite each time the journal has grown past the whole state: twice the lines, amortized
    out["bytes_ratio"] = round(2 * out["journal_bytes_per_cycle"] / out["whole_bytes_per_cycle"], 5)
    say(f"kubernetes state file, {gpus:,} GPUs ({len(pods):,} pods, {whole_bytes / 1e6:.1f} MB whole), {CHANGED} pods "
        f"changed a cycle: journal {out['journal_bytes_per_cycle']:,} B, {out['journal_cpu_s']:.3f} s CPU, "
        f"{out['journal_wall_s']:.3f} s wall; whole rewrite {out['whole_bytes_per_cycle']:,} B, "
        f"{out['whole_cpu_s']:.3f} s CPU, {out['whole_wall_s']:.3f} s wall")
    return out


def run() -> dict:
    rows = [measure(g) for g in GPUS]
    return {"kubernetes_state_bytes_ratio": rows[-1]["bytes_ratio"], "kubernetes_state_detail": {"sizes": rows}}


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
