"""Job logic as plain functions over the database: input, submit, claim, run, relay, export.

Celery tasks (batchd.queue.tasks) are thin wrappers that call into here with a job id.
"""
