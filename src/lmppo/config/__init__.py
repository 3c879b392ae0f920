"""The run's configuration: the schema (sections and fields), YAML input, overrides and validation."""
