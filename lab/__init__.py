"""distributed-llm-lab's shared core (see docs/architecture.md)."""

__version__ = "0.1.0"
"""The project's version, in one place (pyproject.toml reads it from here)."""
