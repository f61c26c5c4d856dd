"""Throwaway TLS certificates and SuperNode keys, made with the ``cryptography`` package (no downloads).

- ``make_tls(directory, hosts)``: a self-signed CA (``ca.crt``) and a server certificate signed
  by it (``server.pem``, ``server.key``) whose subject alternative names cover ``hosts``
  (IP addresses or DNS names). The SuperLink serves with ``server.pem``/``server.key`` and names
  ``ca.crt`` in ``--ssl-ca-certfile``; SuperNodes and the ``flwr`` CLI trust ``ca.crt``
  (``--root-certificates`` / ``root-certificates`` in the connection).
- ``make_node_key(directory, name)``: an ECDSA P-384 key pair in OpenSSH format for SuperNode
  authentication: ``<name>`` (private, ``flower-supernode --auth-supernode-private-key``) and
  ``<name>.pub`` (public, ``flwr supernode register <name>.pub <connection>``).

For anything beyond a test, issue certificates from your organisation's CA instead; the CA key
written here is only for signing the one server certificate.

    python deploy/certs.py tls DIR [--host 127.0.0.1 --host myserver.example.org ...]
    python deploy/certs.py node-key DIR NAME
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path  # trusted by SuperNodes and the CLI
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class NodeKey:
    private_key: Path
    public_key: Path


def _write(path: Path, data: bytes, private: bool = False) -> Path:
    path.write_bytes(data)
    if private:
        path.chmod(0o600)
    return path


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_tls(directory: Path, hosts: list[str] | tuple[str, ...] = ("127.0.0.1", "localhost")) -> TlsFiles:
    """A fresh CA and a server certificate for ``hosts``, written to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + VALIDITY

    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flwr-verl throwaway CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    server_key = _key()
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(_san(list(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    pem = serialization.Encoding.PEM
    _write(directory / "ca.key", ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()), private=True)
    return TlsFiles(
        ca_cert=_write(directory / "ca.crt", ca_cert.public_bytes(pem)),
        server_cert=_write(directory / "server.pem", server_cert.public_bytes(pem)),
        server_key=_write(directory / "server.key", server_key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), private=True),
    )


def make_node_key(directory: Path, name: str) -> NodeKey:
    """An ECDSA P-384 key pair in OpenSSH format (what ``flwr supernode register`` accepts)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private = _write(directory / name, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()), private=True)
    public = _write(directory / f"{name}.pub", key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n")
    return NodeKey(private_key=private, public_key=public)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tls = sub.add_parser("tls", help="a throwaway CA and a server certificate")
    tls.add_argument("directory", type=Path)
    tls.add_argument("--host", action="append", help="IP or DNS name the SuperLink is reached at (repeatable)")
    node = sub.add_parser("node-key", help="a SuperNode authentication key pair")
    node.add_argument("directory", type=Path)
    node.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "tls":
        files = make_tls(args.directory, args.host or ["127.0.0.1", "localhost"])
        print(f"CA certificate: {files.ca_cert}\nserver certificate: {files.server_cert}\n"
              f"server key: {files.server_key}")
    else:
        key = make_node_key(args.directory, args.name)
        print(f"private key: {key.private_key}\npublic key: {key.public_key}")


if __name__ == "__main__":
    main()
