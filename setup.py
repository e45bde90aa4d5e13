"""The compiled hot path: built where a C compiler is, skipped where not.

Metadata lives in pyproject.toml; this file only declares the extensions:
the event path (proxy.dataplane._events) and the chunked-body decoder
(proxy.upstream._framing). ``optional=True``: an image without gcc
(docker/Dockerfile.proxy) still installs, and runs the pure-Python reference
(proxy.dataplane.sse) and llhttp alone.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.dataplane._events",
            ["proxy/dataplane/_events.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "proxy.upstream._framing",
            ["proxy/upstream/_framing.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
    ]
)
