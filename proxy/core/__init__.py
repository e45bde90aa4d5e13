"""Settings, errors, strict JSON, TLS, tasks: what every other package uses."""
