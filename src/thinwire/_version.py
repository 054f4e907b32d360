"""The package version, importable from every floor without importing the package."""

__version__ = "0.1.0"
