"""The Helm chart's values model and the files generated from it (values.schema.json, README.md)."""
