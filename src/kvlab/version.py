"""The package's version, in a module that imports nothing: `kvlab.__version__` and `kvlab.env_report` read it."""

__version__ = "0.1.0"
