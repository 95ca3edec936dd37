"""Runs on Celery workers (``stockade worker``): Redis as the broker, the database (PostgreSQL)
for the run store, the audit trails, approvals and kill switches. At the edge: the core never
imports Celery; ``stockade.server`` loads ``CeleryExecutor`` only when Redis is configured.

Why a run survives its worker:

- **late acks** (``task_acks_late``, ``task_reject_on_worker_lost``): a run's message is
  acknowledged when the run stops, not when it starts; a worker that dies leaves it unacked;
- **wakes** (``server/wakes.py``): a running run's wake lets any live worker's or API
  process's waker see its process gone (its lease lapsed) and send it again within ~20 s; a
  run that waits (a window, a quota, another holder) is a time in the database, not a
  countdown message a worker holds; Redis's visibility timeout (``visibility_timeout_s``)
  only brings back a dead worker's message later, as a copy that starts nothing;
- **idempotent task ids**: a message names the run (``run:<id>:<reason>``) and carries only
  its id; running it again starts nothing new: the runner resumes the run from the run
  store (each returned tool call kept, a non-idempotent call cut mid-way ``OutcomeUnknown``,
  the workspace of the last call restored) or leaves a run that ended as it is;
- **the lease**: one process runs a run; a waker on the same machine sees at once that the
  dead worker's process is gone; elsewhere the lease expires (15 s).

Needs the ``celery`` extra: ``pip install "stockade[celery,postgres,server]"``.
"""

__all__: list[str] = []
