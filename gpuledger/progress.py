"""Training signals from inside a training loop: line 4, `<prefix>job-progress` (docs/planning.md).

    from gpuledger.progress import ProgressReporter

    progress = ProgressReporter("team-a/pytorchjob/llm-7b", attempt=0)
    for step, batch in enumerate(loader, 1):
        loss = train_step(batch)
        progress.report(step=step, tokens=step * TOKENS_PER_STEP, loss=float(loss))
    progress.close()

`report` never blocks on the network and never raises into the loop: a report is queued in the
Kafka client's memory and sent in the background (confluent-kafka); a full queue, a broker away, a
bad value or anything else drops that report and counts it (`dropped`, `failed`). At most one
report per `min_interval_s` is tried (a loop may call it every step), sent or dropped alike: a
dropped one is not tried again at the next step; rates and the step time are computed from the
counts since the last sent report when the loop gives none (none where a count went back).

One reporter per attempt: a report carries every rank's step time (`ranks`), and reports of the
same attempt from several processes read as one series with steps out of order. In a process whose
rank is not 0 (`RANK`, as torchrun, DeepSpeed and Accelerate set it, else Slurm's `SLURM_PROCID`)
the reporter sends nothing unless given `rank=0`. The attempt defaults to Slurm's restart count
(`SLURM_RESTART_COUNT`, the Slurm agent's attempt) where set, else 0: a requeued job runs its script
again, and its reports must not land in the first attempt.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterable

log = logging.getLogger(__name__)


def _env_int(*names: str) -> int | None:
    """The first of these environment variables that holds an integer, else None."""
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


class ProgressReporter:
    """Publishes JobProgress messages for one job attempt, keyed by job id.

    `bootstrap`/`topic` default to the ledger's settings (GPULEDGER_KAFKA_BOOTSTRAP, the topic prefix);
    `producer` is any object with confluent-kafka's produce/poll/flush (tests pass the real one).
    `attempt`: the scheduler's attempt (None: `SLURM_RESTART_COUNT`, else 0). `rank`: this process's
    rank (None: `RANK`, else `SLURM_PROCID`, else 0); only rank 0 reports (`active`)."""

    def __init__(self, job_id: str, *, attempt: int | None = None, cluster: str | None = None,
                 bootstrap: str | None = None, topic: str | None = None, producer=None, min_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.time, rank: int | None = None) -> None:
        if attempt is None:  # Slurm's restart count is the Slurm agent's attempt (agents/slurm.py)
            attempt = _env_int("SLURM_RESTART_COUNT") or 0
        if rank is None:
            rank = _env_int("RANK", "SLURM_PROCID") or 0
        self.job_id, self.attempt, self.cluster, self.rank = job_id, attempt, cluster, rank
        self.active = rank == 0  # one reporter per attempt: the other ranks' reports would interleave with it
        self.min_interval_s = min_interval_s
        self.sent = self.dropped = self.failed = 0  # failed: delivery errors reported by the client
        self._clock = clock
        self._last: tuple[float, int, int | None, int | None] | None = None  # (t, step, samples, tokens) sent
        self._tried: float | None = None  # when the last report was tried (sent or dropped): the throttle
        self._producer = producer
        self.topic = topic
        if not self.active:
            self._producer = None
        elif producer is None or topic is None:
            try:
                from gpuledger.config import Settings

                settings = Settings(**({"kafka_bootstrap": bootstrap} if bootstrap else {}))
                self.topic = topic or settings.topics.job_progress
                if producer is None:
                    from confluent_kafka import Producer

                    # small and lossy on purpose: a progress report is a signal, not a bill
                    self._producer = Producer({**settings.kafka_client_config(), "linger.ms": 200,
                                               "queue.buffering.max.messages": 10_000, "message.timeout.ms": 60_000,
                                               "enable.idempotence": False, "acks": 1})
            except Exception as exc:  # never into the training loop: progress is optional
                log.warning("progress reporting disabled: %s", exc)
                self._producer = None

    def report(self, step: int, *, samples: int | None = None, tokens: int | None = None, epoch: float | None = None,
               loss: float | None = None, step_time_ms: float | None = None, samples_per_s: float | None = None,
               tokens_per_s: float | None = None, ranks: dict[int, float] | Iterable[tuple[int, float]] | None = None,
               force: bool = False) -> bool:
        """Queue one report (step and cumulative counts of this attempt; `ranks`: rank -> step time, ms).
        Returns whether it was queued; never raises."""
        if not self.active:  # a rank other than 0: rank 0 reports for the attempt
            return False
        try:
            now = self._clock()
            if not force and self._tried is not None and now - self._tried < self.min_interval_s:
                return False
            self._tried = now  # a report dropped below waits its interval too, as a sent one does
            if self._producer is None:
                self.dropped += 1
                return False
            if self._last is not None:
                dt, d_step = now - self._last[0], step - self._last[1]
                if dt > 0 and d_step > 0 and step_time_ms is None:
                    step_time_ms = dt * 1000 / d_step
                # a count that went back (a restart from a checkpoint): no rate, rather than 0
                if dt > 0 and samples is not None and self._last[2] is not None and samples_per_s is None \
                        and samples >= self._last[2]:
                    samples_per_s = (samples - self._last[2]) / dt
                if dt > 0 and tokens is not None and self._last[3] is not None and tokens_per_s is None \
                        and tokens >= self._last[3]:
                    tokens_per_s = (tokens - self._last[3]) / dt
            from gpuledger.schemas.models import JobProgress
            from gpuledger.schemas.wire import encode

            rank_items = ranks.items() if isinstance(ranks, dict) else (ranks or ())
            message = JobProgress(
                ts_ms=int(now * 1000), cluster=self.cluster, job_id=self.job_id, attempt=self.attempt, step=step,
                samples=samples, tokens=tokens, epoch=epoch, loss=loss, step_time_ms=step_time_ms,
                samples_per_s=samples_per_s, tokens_per_s=tokens_per_s,
                ranks=[{"rank": int(r), "step_time_ms": float(t)} for r, t in rank_items])
            self._producer.produce(self.topic, key=self.job_id.encode(), value=encode(message),
                                   on_delivery=self._delivered)
            self._producer.poll(0)  # serve delivery callbacks; returns at once
        except BufferError:  # the client's queue is full (broker away for long): drop, do not wait
            self.dropped += 1
            try:
                # serve the delivery reports of what expired or went out: the queue frees only when they
                # are served, and poll is otherwise called only after a report that was queued
                self._producer.poll(0)
            except Exception:
                pass
            return False
        except Exception as exc:  # a bad value (NaN loss, negative step) or anything else: drop and say so once
            self.dropped += 1
            if self.dropped == 1:
                log.warning("progress report dropped: %s", exc)
            return False
        self._last = (now, step, samples, tokens)
        self.sent += 1
        return True

    def _delivered(self, err, _msg) -> None:
        if err is not None:
            self.failed += 1

    def close(self, timeout_s: float = 5.0) -> int:
        """Send what is queued, waiting at most `timeout_s`; returns the reports left unsent."""
        if self._producer is None:
            return 0
        try:
            return self._producer.flush(timeout_s)
        except Exception as exc:
            log.warning("progress reporter could not flush: %s", exc)
            return 0

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
