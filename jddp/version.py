"""The version of jddp (also in pyproject.toml)."""

__version__ = "0.1.0"
