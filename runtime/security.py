"""Who may talk to a runtime (docs/SECURITY.md): private ipc endpoints, loopback tcp, and CURVE
keys when a tcp endpoint is opened to other machines.

- An `ipc://` endpoint must lie in a directory that only this user can open, and its path must
  not exist yet: binding would silently replace a file or take over a socket another runtime
  serves. The supervisor records the path in its run directory so a later start removes the
  socket file of a runtime that was killed (runtime/shm.py, `sweep_stale_runs`). A Linux
  abstract socket (`ipc://@name`) has no file and no permissions: it is served only with CURVE.
- `--allow-remote` turns CURVE on: the supervisor's key pair and the public keys of the clients
  allowed in live in a key directory (mode 0700, secrets 0600). Only a client whose public key is
  in `clients/` completes the handshake; everything after it is encrypted.

`deltafin-keys` creates the server keys and client key pairs (`python -m deltafin.runtime.security`).
"""
from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

from deltafin.runtime.cli import Help

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
SERVER = "server"
CLIENT = "client"


class SecurityError(RuntimeError):
    pass


# -- endpoints -----------------------------------------------------------------------------------
def check_endpoint(endpoint: str, allow_remote: bool) -> None:
    """A tcp endpoint binds loopback unless remote access is allowed; only ipc and tcp exist.
    An endpoint no file permission guards (a Linux abstract socket, `ipc://@name`) needs CURVE,
    which --allow-remote turns on; an ipc path ZeroMQ would choose itself (`ipc://*`) is refused."""
    if endpoint.startswith("tcp://"):
        host = endpoint[6:].rsplit(":", 1)[0]
        if host not in LOOPBACK_HOSTS and not allow_remote:
            raise SecurityError(f"{endpoint} is not a loopback address; pass --allow-remote to "
                                f"expose the runtime to other machines (with CURVE keys)")
    elif is_abstract(endpoint):
        if not allow_remote:
            raise SecurityError(f"{endpoint} is a Linux abstract socket: no file permission guards "
                                f"it, so every local user could connect; use an ipc path in a "
                                f"private directory, or pass --allow-remote (CURVE keys)")
    elif endpoint.startswith("ipc://"):
        if endpoint[len("ipc://"):] in ("", "*"):
            raise SecurityError(f"{endpoint}: name the socket path (ipc://DIR/NAME in a private "
                                f"directory); ZeroMQ would choose one no check covers")
        check_ipc_path(ipc_path(endpoint))
    else:
        raise SecurityError(f"endpoint {endpoint!r} must start with ipc:// or tcp://")


def is_abstract(endpoint: str) -> bool:
    """`ipc://@name`: a Linux abstract socket, which has no file and no permissions."""
    return endpoint.startswith("ipc://@")


def needs_curve(endpoint: str, allow_remote: bool) -> bool:
    """CURVE guards a tcp endpoint opened with --allow-remote, and an abstract socket."""
    return allow_remote and (endpoint.startswith("tcp://") or is_abstract(endpoint))


def ipc_path_max(platform: str | None = None) -> int:
    """The longest ipc socket path the OS takes: sun_path less its NUL (108 bytes on Linux,
    104 on macOS and the BSDs)."""
    return 107 if (platform or sys.platform).startswith("linux") else 103


def check_ipc_length(path, platform: str | None = None) -> None:
    """Refuses a socket path longer than the OS takes (ZeroMQ would fail with a bare error)."""
    n, most = len(os.fsencode(str(path))), ipc_path_max(platform)
    if n > most:
        raise SecurityError(f"the ipc socket path {path} is {n} bytes; this OS takes at most {most}: "
                            f"use a shorter path (or set DELTAFIN_RUN_ROOT to a shorter directory)")


def ipc_path(endpoint: str) -> Path:
    return Path(os.path.abspath(endpoint[len("ipc://"):]))


def check_private_dir(directory: Path, what: str) -> None:
    """The directory exists, belongs to this user and is closed to everyone else."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        raise SecurityError(f"{what}: directory {directory} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SecurityError(f"{what}: {directory} is not a directory")
    if st.st_uid != os.getuid():
        raise SecurityError(f"{what}: directory {directory} belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o077:
        raise SecurityError(f"{what}: directory {directory} is open to other users (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}); use a directory only you can open "
                            f"(chmod 700)")


def check_ipc_path(path: Path) -> None:
    """Refuses a socket path in a directory others can open, and a path that exists: binding
    would replace a file, or take over the socket of a runtime that is serving it."""
    check_ipc_length(path)
    check_private_dir(path.parent, f"ipc endpoint {path}")
    if os.path.lexists(path):
        kind = "a socket (another runtime may be serving it)" if stat.S_ISSOCK(os.lstat(path).st_mode) \
            else "a file"
        raise SecurityError(f"ipc endpoint {path} already exists as {kind}; refusing to replace it "
                            f"(remove it yourself if nothing uses it)")


def remove_socket_file(path: Path, identity: tuple[int, int] | None) -> None:
    """Removes the socket file we bound (same device and inode), never one that replaced it."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISSOCK(st.st_mode) and identity == (st.st_dev, st.st_ino):
        os.unlink(path)


def file_identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# -- CURVE keys ----------------------------------------------------------------------------------
def default_keys_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "deltafin" / "keys"


@dataclass
class KeyDir:
    """A CURVE key directory: server.key (public) and server.key_secret, clients/*.key (the
    public keys allowed in), and key pairs made for clients (NAME.key_secret, to hand over)."""
    path: Path

    @property
    def clients(self) -> Path:
        return self.path / "clients"

    def ensure(self) -> "KeyDir":
        """Creates what is missing (directory 0700, server key pair, one client key pair named
        `client`, authorized); refuses a directory or secret that others can read."""
        for d in (self.path, self.clients):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            check_private_dir(d, "CURVE key directory")
        if not (self.path / f"{SERVER}.key_secret").exists():
            self._create(SERVER)
        if not any(self.clients.glob("*.key")) and not (self.path / f"{CLIENT}.key_secret").exists():
            self.add_client(CLIENT)
        return self

    def _create(self, name: str) -> Path:
        public, secret = zmq.auth.create_certificates(self.path, name)
        os.chmod(secret, 0o600)  # written inside a 0700 directory, so never readable by others
        os.chmod(public, 0o600)
        return Path(secret)

    def add_client(self, name: str) -> Path:
        """A new client key pair; its public key is allowed in. Returns the secret file to hand
        to that client (it holds the client's public key too)."""
        if not name.replace("-", "").replace("_", "").isalnum() or name == SERVER:
            raise SecurityError(f"client name {name!r}: letters, digits, - and _ only, not {SERVER!r}")
        if (self.path / f"{name}.key_secret").exists():
            raise SecurityError(f"a key pair named {name!r} exists in {self.path}")
        secret = self._create(name)
        os.replace(self.path / f"{name}.key", self.clients / f"{name}.key")
        return secret

    def server_keys(self) -> tuple[bytes, bytes]:
        secret = self.path / f"{SERVER}.key_secret"
        mode = stat.S_IMODE(os.stat(secret).st_mode)
        if mode & 0o077:
            raise SecurityError(f"{secret} is readable by other users (mode {mode:04o}); chmod 600")
        public, private = zmq.auth.load_certificate(secret)
        return public, private


class CurveServer:
    """Turns CURVE on for one server socket, with a ZAP handler (pyzmq's authenticator thread)
    that admits exactly the public keys in the key directory's `clients/`."""

    def __init__(self, ctx: zmq.Context, keys: KeyDir):
        from zmq.auth.thread import ThreadAuthenticator
        self.keys = keys.ensure()
        self.public, self.secret = keys.server_keys()
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(keys.clients))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def stop(self) -> None:
        self.auth.stop()


def client_credentials(keys: str | os.PathLike) -> tuple[bytes, bytes, bytes]:
    """(server public key, client public key, client secret key) from a directory holding the
    server's `server.key` and one client key pair (`*.key_secret` other than the server's), or
    from a client secret file whose directory holds `server.key`."""
    p = Path(keys).expanduser()
    if p.is_dir():
        secrets = sorted(f for f in p.glob("*.key_secret") if f.name != f"{SERVER}.key_secret")
        if len(secrets) != 1:
            raise SecurityError(f"{p}: expected one client key pair (*.key_secret), found "
                                f"{[f.name for f in secrets] or 'none'}")
        secret_file, server_file = secrets[0], p / f"{SERVER}.key"
    else:
        secret_file, server_file = p, p.parent / f"{SERVER}.key"
    if not server_file.exists():
        raise SecurityError(f"{server_file}: the server's public key is missing (copy it from the "
                            f"runtime's key directory)")
    server_public, _ = zmq.auth.load_certificate(server_file)
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise SecurityError(f"{secret_file} holds no secret key")
    return server_public, public, secret


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-keys", description="CURVE keys for a runtime served "
                                "to other machines (deltafin-supervisor --allow-remote).")
    p.add_argument("--dir", help=f"key directory (default: runtime.keys_dir, else {default_keys_dir()})")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("init", formatter_class=Help, help="create the server key pair and a first client key pair")
    add = sub.add_parser("add-client", formatter_class=Help, help="create a key pair for one more client and allow it in")
    add.add_argument("name")
    a = p.parse_args(argv)
    keys = KeyDir(Path(a.dir).expanduser() if a.dir else default_keys_dir())
    try:
        keys.ensure()
        if a.cmd == "add-client":
            secret = keys.add_client(a.name)
            print(f"give the client {secret} and {keys.path / (SERVER + '.key')} (over a private channel)")
        else:
            print(f"keys in {keys.path}: server.key is the server's public key; clients/ holds the "
                  f"public keys allowed in")
        return 0
    except (SecurityError, OSError) as e:
        print(f"deltafin-keys: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
