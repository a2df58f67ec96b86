"""batchd: queue-driven batch service for long-context LLM generation (DESIGN.md)."""
__version__ = "0.1.0"
