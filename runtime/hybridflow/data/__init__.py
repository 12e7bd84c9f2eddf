"""Built-in datasets, the tiny model and task; prompt files and formats."""


class DataError(ValueError):
    """Prompts that cannot be read or rendered; the message names the spec field (spec.data.train, ...)."""
