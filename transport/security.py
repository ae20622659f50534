"""ZeroMQ CURVE authentication and encryption.

Keys are ZeroMQ certificate files made by `tether-keys DIR NAME` (NAME.key is public,
NAME.key_secret is secret). The learner runs a ZAP authenticator that admits only clients whose
public key file sits in `transport.curve_allowed_dir`; a client without such a key cannot
complete the handshake, so it can neither say Hello, take leases, push trajectories, nor pull
weights. With CURVE off (no keys configured) traffic is plain TCP: use it on trusted networks only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from configs.schema import TransportConfig


def start_authenticator(ctx: zmq.Context, t: TransportConfig) -> ThreadAuthenticator | None:
    """Learner side: admit only the public keys in curve_allowed_dir. None when CURVE is off."""
    if not t.curve_server_secret:
        return None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(Path(t.curve_allowed_dir)))
    return auth


def make_server(sock: zmq.Socket, t: TransportConfig) -> None:
    if t.curve_server_secret:
        public, secret = zmq.auth.load_certificate(t.curve_server_secret)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True


def make_client(sock: zmq.Socket, t: TransportConfig) -> None:
    if t.curve_client_secret:
        public, secret = zmq.auth.load_certificate(t.curve_client_secret)
        server_public, _ = zmq.auth.load_certificate(t.curve_server_public)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tether-keys",
                                description="Make a CURVE key pair: DIR/NAME.key and DIR/NAME.key_secret.")
    p.add_argument("dir", help="directory for the key files (created if missing)")
    p.add_argument("name", help="e.g. learner, or an actor's name")
    ns = p.parse_args(argv)
    d = Path(ns.dir)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(d), ns.name)
    Path(secret).chmod(0o600)
    print(f"public: {public}\nsecret: {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
