"""The ``stockade`` command."""
