"""The database is the record (docs/design.md section 1): batches, jobs, results, job events."""
