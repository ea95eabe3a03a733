"""The package version, in a module of its own: the kernel cache key needs it, and the layers
below the API must not import the package (which imports the API)."""

__version__ = "0.1.0"
