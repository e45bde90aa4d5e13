"""ft-proxy: a fault-tolerance-aware front door for vLLM data-parallel ranks."""
