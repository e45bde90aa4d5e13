"""Optional TLS: the listener's certificate, and how ranks are verified.

Both are checked at config load by building the context once, so a missing
or unreadable file, a key that does not match its certificate or a key
without a certificate is a config error (exit 2), not a failure at the first
connection. Plain ``http://`` rank URLs never use TLS, whatever is set here.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import BaseModel, model_validator


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path | None) -> None:
    """Load a certificate chain (the key may be in ``cert``) with a clear error."""
    for what, path in (("cert_file", cert), ("key_file", key)):
        if path is not None and not path.is_file():
            raise ValueError(f"{what} {path} does not exist or is not a file")
    try:
        ctx.load_cert_chain(str(cert), str(key) if key is not None else None)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"cannot load cert_file {cert} / key_file {key}: {e}") from None


def _load_ca(ctx: ssl.SSLContext, ca: Path, what: str) -> None:
    if not ca.is_file():
        raise ValueError(f"{what} {ca} does not exist or is not a file")
    try:
        ctx.load_verify_locations(cafile=str(ca))
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"cannot load {what} {ca}: {e}") from None


class ListenerTLS(BaseModel):
    """``listen.tls``: serve HTTPS (HTTP/1.1) instead of plain HTTP."""

    cert_file: Path  # PEM, the server certificate and its chain
    key_file: Path | None = None  # PEM; omitted: the key is in cert_file
    # Set: clients must present a certificate signed by this CA (mutual TLS).
    client_ca_file: Path | None = None

    @model_validator(mode="after")
    def _loads(self) -> ListenerTLS:
        self.context()
        return self

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.load_into(ctx)
        if self.client_ca_file is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
        # The listener speaks HTTP/1.1 only; say so, so a client never tries h2.
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def load_into(self, ctx: ssl.SSLContext) -> None:
        """Load the files into ``ctx``: at start, and on reload into the
        listener's live context, whose later handshakes then use them (a
        rotated certificate needs no restart). A client CA is added to the
        ones trusted; dropping one takes a restart (OpenSSL cannot unload)."""
        _load_chain(ctx, self.cert_file, self.key_file)
        if self.client_ca_file is not None:
            _load_ca(ctx, self.client_ca_file, "client_ca_file")


class UpstreamTLS(BaseModel):
    """``upstream_tls``: for ``https://`` rank URLs (relay, polls, admin calls)."""

    # CA bundle the ranks' certificates are checked against; None: the system's.
    ca_file: Path | None = None
    # False: encrypt but do not check the rank's certificate or host name.
    verify: bool = True
    # A client certificate for ranks that require one (mutual TLS).
    cert_file: Path | None = None
    key_file: Path | None = None  # omitted: the key is in cert_file

    @model_validator(mode="after")
    def _loads(self) -> UpstreamTLS:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file needs cert_file")
        if not self.verify and self.ca_file is not None:
            raise ValueError("ca_file is for verifying ranks; it cannot go with verify: false")
        self.context()
        return self

    def context(self) -> ssl.SSLContext | bool:
        """What the rank client takes: a context, or False (no verification)."""
        if not self.verify and self.cert_file is None:
            return False
        if self.ca_file is None:
            ctx = ssl.create_default_context()
        else:  # this CA instead of the system's, not beside them
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            _load_ca(ctx, self.ca_file, "ca_file")
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file is not None:
            _load_chain(ctx, self.cert_file, self.key_file)
        return ctx
