"""Export errors, each with the exit code the CLI returns for it."""


class ExportError(Exception):
    """Base: a one-line message for the user; ``exit_code`` for the CLI."""

    exit_code = 1


class InputError(ExportError):
    """Bad input: missing/truncated/not-ONNX file, no KV-cache I/O, bad options."""

    exit_code = 2


class UnsupportedError(ExportError):
    """The model (or this machine) needs something we do not implement or have."""

    exit_code = 3


class ValidationError(ExportError):
    """The rewritten model does not reproduce the original within tolerance."""

    exit_code = 4
