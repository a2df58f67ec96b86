"""Celery on Redis: the app, its settings for hour-long GPU jobs, and the one task."""
