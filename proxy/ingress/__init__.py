"""The proxy's port: connections, the request pipeline, probes and /admin."""
