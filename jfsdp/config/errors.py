"""The one exception class for bad input."""


class ConfigError(ValueError):
    """Bad user input (mesh, strategy, batch, model, checkpoint...): the message names the problem. The
    command lines print it as one `error: ...` line and exit with status 2."""
