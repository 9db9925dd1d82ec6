"""Errors that end a run with a one-line message instead of a traceback."""


class ConfigError(ValueError):
    """Bad user input: a flag, a config file, a dataset, a cluster request.

    Raised on the driver before any Ray worker starts; the CLI prints the
    message as one line and exits with code 2.
    """
