"""The database is the record (DESIGN.md section 1): batches, jobs, results, job events."""
