"""Runs on Celery workers (``stockade worker``): Redis as the broker, the database (PostgreSQL)
for the run store, the audit trails, approvals and kill switches. At the edge: the core never
imports Celery; ``stockade.server`` loads ``CeleryExecutor`` only when Redis is configured.

Why a run survives its worker:

- **late acks** (``task_acks_late``, ``task_reject_on_worker_lost``): a run's message is
  acknowledged when the run stops, not when it starts; a worker that dies leaves it unacked;
- **visibility timeout**: Redis gives an unacknowledged message to another worker after
  ``visibility_timeout_s``; a run still running then is refused by its lease (``RunLeased``)
  and the copy retries after the lease's time, so a long run is never run twice at once;
- **idempotent task ids**: a message names the run (``run:<id>:<reason>``) and carries only
  its id; running it again starts nothing new: the runner resumes the run from the run
  store (each returned tool call kept, a non-idempotent call cut mid-way ``OutcomeUnknown``,
  the workspace of the last call restored) or leaves a run that ended as it is;
- **the lease**: a worker on the same machine sees at once that the dead worker's process is
  gone; elsewhere the lease expires (15 s).

Needs the ``celery`` extra: ``pip install "stockade[celery,postgres,server]"``.
"""

__all__: list[str] = []
