"""The package version, in a module of its own: the batch template and checkpoint files record it,
and nothing it is read from may import the rest of hpcrl."""
__version__ = "0.1.0"
