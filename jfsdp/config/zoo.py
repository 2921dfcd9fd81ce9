"""The repository's model zoo (`models/`), found at run time. pip installs only jfsdp: the named models
are the repository's own, so the command lines that take `--model` (train.py, the planner, export)
import them when they run, and say what to do when they are not there. Nothing else in jfsdp imports
`models`."""
from __future__ import annotations

from jfsdp.config.errors import ConfigError


def repo_models(command: str = "this command"):
    """The repository's `models` package (with `models.factory` loaded), or a ConfigError that says how
    to run `command` so that it finds it."""
    try:
        import models
        import models.factory  # noqa: F401  (the glue between models/ and jfsdp)
        models.get_config
    except (ImportError, AttributeError):
        raise ConfigError(f"--model names come from the repository's models/ package, which pip does not install: "
                          f"run {command} from the jfsdp repository root") from None
    return models
