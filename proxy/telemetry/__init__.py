"""Metrics, the access log, traces and log formats."""
