"""batchd: queue-driven batch service for long-context LLM generation (docs/design.md)."""
__version__ = "0.1.0"
