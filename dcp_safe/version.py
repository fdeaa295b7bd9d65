"""The package version, in a module of its own so the layers below the root can read it."""

__version__ = "0.1.0"
