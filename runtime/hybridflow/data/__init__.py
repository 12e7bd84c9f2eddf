"""Built-in datasets, the tiny model and task."""
