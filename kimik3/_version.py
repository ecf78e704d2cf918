"""The package version, one definition (read by the package and by provenance records)."""

__version__ = "0.1.0"
