"""Group commit: the concurrent admissions of one gateway process share their transactions.

An admission writes little (a budget reservation when a budget limits it, the Job row, its
`job.queued` event), but each transaction costs round trips to PostgreSQL and passes through the
ORM; at a few hundred admissions a second they are most of admission's cost. So the admission
threads hand their jobs to one writer thread per process, which writes everything handed to it
meanwhile in one transaction: the reservations, then one INSERT of the jobs sent with each org's
event lock and one INSERT of the events (Job.objects.submit_all: a single round trip when no
budget is involved). It never waits for company: it takes whatever queued while it wrote the
last group, so a quiet gateway writes each job alone and a busy one in groups (their sizes under
bench/job_queue.py: docs/performance.md).

What a caller is told is what it would be told alone. It returns after its job's commit; a
reservation that does not fit fails that job alone (402, nothing of it written); and a group
whose transaction fails is written again one job at a time, so a bad row, or a deadlock with
another process, fails no neighbour; a job that PostgreSQL aborts as a deadlock's victim is
written again (a few times) rather than answered with a 500. Admissions already inside a
transaction (a batch writes its lines with the batch) write inline, in it.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from decimal import Decimal

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connections, transaction
from django.utils import timezone

from controlplane.api.errors import ApiError
from controlplane.billing import budgets
from controlplane.jobs.models import Job

logger = logging.getLogger(__name__)
# Jobs a group holds at most: a bound on one transaction's size and its locks' time.
MAX_GROUP = 64


@dataclass
class PendingJob:
    """A job to write (unsaved), and the maximum cost to reserve for it (None: no budget)."""

    job: Job
    cost: Decimal | None
    error: BaseException | None = None
    written: threading.Event = field(default_factory=threading.Event)

    def outcome(self) -> Job:
        """Its job, written; or the error that refused it, raised."""
        if self.error is not None:
            raise self.error
        return self.job


def write_jobs(pending: list[PendingJob]) -> None:
    """Write `pending` in one transaction: reserve each budgeted job's cost, in org and key
    order (so concurrent groups take the counters' locks in one order), then insert the jobs
    that fit and their events. A job whose reservation does not fit gets its ApiError 402 in
    `error` and is not written; any other failure raises, and nothing is written. Without
    reservations the inserts are one statement batch, a transaction of its own on PostgreSQL
    (Job.objects.submit_all): one round trip for the group."""
    for item in pending:
        item.error = None  # from an earlier try, when a failed group is written job by job
    if all(item.cost is None for item in pending):
        Job.objects.submit_all([item.job for item in pending])
        return
    now = timezone.now()
    with transaction.atomic(savepoint=False):
        for item in sorted(pending, key=lambda p: (p.job.org_id, p.job.api_key_id or 0)):
            if item.cost is None:
                continue
            try:
                reservation = budgets.reserve(item.job.org, item.job.api_key, item.cost, now)
            except budgets.BudgetExceeded as exceeded:
                item.error = ApiError(402, str(exceeded), code="budget_exceeded")
                continue
            item.job.reserved_cost, item.job.budget_scopes = reservation.cost, reservation.scopes
        Job.objects.submit_all([item.job for item in pending if item.error is None])


# PostgreSQL's answers that say "try again": it broke a deadlock by aborting this transaction,
# or could not serialise it. Nothing of the transaction was written.
TRANSIENT_SQLSTATES = {"40P01", "40001"}
TRANSIENT_RETRIES = 3


def is_transient(error: BaseException) -> bool:
    """Whether `error` is a database failure that the same transaction may not meet again."""
    cause = error.__cause__ if isinstance(error, DatabaseError) else None
    return getattr(cause, "sqlstate", None) in TRANSIENT_SQLSTATES


def write_group(group: list[PendingJob]) -> None:
    """Write a group in one transaction; should that fail, each of its jobs alone, so that a
    failure stays with the job that caused it (in that job's `error`). A job alone is written
    again, up to TRANSIENT_RETRIES times, when PostgreSQL aborted it as a deadlock's victim."""
    if len(group) > 1:
        try:
            write_jobs(group)
            return
        except Exception as error:
            close_old_connections()  # a broken connection is replaced before the retries
            logger.warning("a group of %d jobs failed (%s); writing each alone", len(group), error)
    for item in group:
        for attempt in range(TRANSIENT_RETRIES + 1):
            try:
                write_jobs([item])
                break
            except Exception as error:
                close_old_connections()
                item.error = error
                if attempt == TRANSIENT_RETRIES or not is_transient(error):
                    break
                logger.warning("job write aborted (%s); writing it again", error)


class JobWriter:
    """The process's writer thread (started on first use) and the queue of jobs handed to it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[PendingJob | None] = queue.SimpleQueue()  # None: stop
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def write(self, item: PendingJob) -> Job:
        """Have the writer write `item` with whatever else is waiting; its job once committed,
        or the error that refused it."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="hearth-job-writer", daemon=True
                )
                self._thread.start()
        self._queue.put(item)
        item.written.wait()
        return item.outcome()

    def stop(self) -> None:
        """End the writer thread, closing its database connection (a test run's database can
        then be dropped); the next write starts another."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)
                self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                connections.close_all()
                return
            group = [first]
            while len(group) < MAX_GROUP:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # stop once this group is written
                    self._queue.put(None)
                    break
                group.append(item)
            try:
                write_group(group)
            finally:
                for item in group:
                    item.written.set()


_writer = JobWriter()


def write_job(job: Job, cost: Decimal | None) -> Job:
    """Write a queued job (and its event), with `cost` reserved in its budgets when not None:
    through the writer thread, or inline within a transaction the caller holds."""
    item = PendingJob(job, cost)
    if not settings.ADMISSION_GROUP_COMMIT or transaction.get_connection().in_atomic_block:
        write_jobs([item])
        return item.outcome()
    return _writer.write(item)


def stop_writer() -> None:
    _writer.stop()
