"""CURVE security: node key pairs, the trusted-key folder and the ZAP authenticator.

Every ZeroMQ connection of a secure node is CURVE-encrypted and authenticated (pyzmq's
``zmq.auth``): the node's ROUTER is a CURVE server that admits a client only if its public key is
in the trusted folder, and each DEALER, a CURVE client, must know the public key of the node it
dials (learned from member records, which carry each member's key; an address whose key is not
known yet, a bootstrap address, is tried with every trusted key). Keys are pyzmq certificates:
``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600).

The trusted folder is re-read whenever its listing changes (a key file added, removed or
replaced), at the next handshake: no restart is needed. A handshake costs one ``stat`` of the
folder (a file added or removed changes its time); the files themselves are listed and
compared (a key replaced in place) at most once per ``RESCAN_S``, so a flood of handshakes
costs little. ZeroMQ never redials a connection whose handshake was refused; the dialer does,
at its next message to that peer and at most once a second (``p2p.transport.connections``), so a
key trusted after its node started admits it within about a second.
Revoking a key refuses new connections from it; a connection already open stays until it drops.
Refused handshakes are counted and logged at most once per key every 10 s.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from p2p.security.ratelimit import QuietLog

log = logging.getLogger(__name__)

ZAP_DOMAIN = "gossipmesh"
RESCAN_S = 1.0


class SecurityError(ValueError):
    """Keys that cannot be used; the message says what to run or pass instead."""


class KeyExistsError(SecurityError):
    """A key file that :func:`keygen` would overwrite."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} exists; remove it first or pick another name=")
        self.path = path


def keygen(folder: Path, name: str) -> tuple[Path, Path]:
    """Make a key pair ``folder/NAME.key`` and ``folder/NAME.key_secret`` (never overwrites)."""
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise KeyExistsError(path)
    zmq.auth.create_certificates(folder, name)
    secret.chmod(0o600)
    return public, secret


@dataclass(frozen=True)
class NodeKeys:
    """This node's key pair (z85), and the secret file it was read from."""

    public: bytes
    secret: bytes
    file: Path | None = None

    @classmethod
    def load(cls, folder: Path, node_id: str) -> NodeKeys:
        """``folder/NODE_ID.key_secret``, or the only ``*.key_secret`` in ``folder``."""
        own = folder / f"{node_id}.key_secret"
        candidates = [own] if own.exists() else sorted(folder.glob("*.key_secret"))
        if len(candidates) > 1:
            raise SecurityError(
                f"keys={folder}: found {', '.join(p.name for p in candidates)} and no {own.name}; "
                "give node_id=NAME to use NAME.key_secret, or keep one pair there"
            )
        if not candidates:
            raise SecurityError(
                f"keys={folder}: found no *.key_secret; make one with: gossipmesh keygen {folder} "
                f"--name {node_id}"
            )
        try:
            public, secret = zmq.auth.load_certificate(candidates[0])
        except (OSError, ValueError) as exc:
            raise SecurityError(f"cannot read the key pair {candidates[0]}: {exc}") from None
        if secret is None:
            raise SecurityError(f"{candidates[0]} holds no secret key; make a pair with gossipmesh keygen")
        return cls(public, secret, candidates[0])


class TrustedKeys:
    """The public keys in a folder of ``*.key`` files, re-read when the folder changes."""

    def __init__(self, folder: Path) -> None:
        if not folder.is_dir():
            raise SecurityError(
                f"trusted={folder} is not a folder; put the public .key file of every node "
                "allowed in the mesh there"
            )
        self.folder = folder
        self._lock = threading.Lock()
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._keys: frozenset[bytes] = frozenset()
        self._looked_at = float("-inf")
        self._folder_time: int | None = None
        self.current()
        if not self._keys:
            raise SecurityError(f"trusted={folder} holds no .key files; copy the nodes' public keys there")

    def current(self) -> frozenset[bytes]:
        """The trusted public keys (z85), re-read if any key file was added, removed or changed."""
        with self._lock:
            now, folder_time = time.monotonic(), self._folder_time_ns()
            if folder_time == self._folder_time and now - self._looked_at < RESCAN_S:
                return self._keys
            self._looked_at, self._folder_time = now, folder_time
            signature = self._scan()
            if signature != self._signature:
                self._keys = frozenset(self._read())
                if self._signature is not None:
                    log.warning("trusted keys reloaded from %s: %d keys", self.folder, len(self._keys))
                self._signature = signature
            return self._keys

    def _folder_time_ns(self) -> int | None:
        try:
            return self.folder.stat().st_mtime_ns
        except OSError:  # gone: the listing below finds nothing
            return None

    def allows(self, key: bytes) -> bool:
        return key in self.current()

    def _scan(self) -> tuple[tuple[str, int, int], ...]:
        found = []
        for path in self.folder.glob("*.key"):
            try:
                stat = path.stat()
            except OSError:  # removed while listing
                continue
            found.append((path.name, stat.st_mtime_ns, stat.st_size))
        return tuple(sorted(found))

    def _read(self) -> list[bytes]:
        keys = []
        for path in sorted(self.folder.glob("*.key")):
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable trusted key %s: %s", path, exc)
                continue
            keys.append(public)
        return keys


@dataclass(frozen=True)
class Curve:
    """What a transport needs to run CURVE on every socket."""

    keys: NodeKeys
    trusted: TrustedKeys

    @classmethod
    def load(cls, keys_folder: Path, trusted_folder: Path, node_id: str) -> Curve:
        return cls(NodeKeys.load(keys_folder, node_id), TrustedKeys(trusted_folder))


class _TrustedProvider:
    """zmq.auth's credentials-provider interface over :class:`TrustedKeys`."""

    def __init__(self, trusted: TrustedKeys) -> None:
        self.trusted = trusted
        self.refused = 0
        self.errors = 0  # handshakes refused because the check itself failed
        self._log = QuietLog(log)

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether ``key`` is trusted. Its own error scope: a failing check (e.g. EMFILE while
        the folder is listed) refuses this handshake, and the ZAP thread lives on."""
        try:
            allowed = self.trusted.allows(key)
        except Exception as exc:
            self.errors += 1
            self._log.warning("check", "could not check a key (%d times): %r", self.errors, exc)
            return False
        if not allowed:
            self.refused += 1
            shown = key.decode(errors="replace")
            self._log.warning(
                shown,
                "refused a connection with untrusted key %s: it is not in --trusted %s; copy that "
                "node's public .key there to admit it (%d refused)",
                shown,
                self.trusted.folder,
                self.refused,
            )
        return allowed


class Authenticator:
    """The ZAP handler of a context: its own thread and socket (pyzmq's ThreadAuthenticator)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], trusted: TrustedKeys) -> None:
        self._provider = _TrustedProvider(trusted)
        self._thread = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._thread.start()
        self._thread.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._provider)

    @property
    def refused(self) -> int:
        """Handshakes refused for an untrusted key."""
        return self._provider.refused

    def check(self) -> None:
        """Raise SecurityError if the ZAP thread has stopped (no peer could connect again)."""
        if not self._thread.is_alive():
            raise SecurityError("CURVE authenticator stopped; restart the node")

    def stop(self) -> None:
        self._thread.stop()


def configure_server(socket: zmq.Socket[bytes], keys: NodeKeys) -> None:
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    socket.zap_domain = ZAP_DOMAIN.encode()


def configure_client(socket: zmq.Socket[bytes], keys: NodeKeys, server_key: bytes) -> None:
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = server_key


def insecure_warning() -> str:
    return (
        "RUNNING WITHOUT CURVE (--insecure): traffic is neither encrypted nor authenticated; "
        "any host that reaches this port can join the mesh and change the model"
    )
