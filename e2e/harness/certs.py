"""Certificates and keys for a throwaway control plane.

The API server needs a serving certificate, a service-account signing key pair and a client CA;
clients authenticate with client certificates whose CN/O become user and groups. ECDSA P-256
keys are used throughout because they are generated in milliseconds.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=7)
SERVING_HOSTS = (
    "127.0.0.1",
    "localhost",
    "10.0.0.1",  # first address of the service CIDR: the in-cluster `kubernetes` Service
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate (or public key) and its private key on disk."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    """Every file the control plane's components are started with."""

    directory: Path
    serving_ca: KeyPair
    serving: KeyPair
    client_ca: KeyPair
    service_account: KeyPair  # `cert` holds the public key
    admin: KeyPair


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + VALIDITY)
    )


def _load(pair: KeyPair) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
    key = serialization.load_pem_private_key(pair.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return cert, key


def make_ca(directory: Path, name: str) -> KeyPair:
    """A self-signed CA; one signs serving certs, another client certs (as kubeadm separates them)."""
    key = _new_key()
    subject = _name(f"hybridflow-e2e-{name}")
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(_write_cert(cert, directory / f"{name}.crt"), _write_key(key, directory / f"{name}.key"))


def _leaf(
    ca: KeyPair,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    path_stem: Path,
    sans: list[x509.GeneralName] | None = None,
) -> KeyPair:
    ca_cert, ca_key = _load(ca)
    key = _new_key()
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(_write_cert(cert, path_stem.with_suffix(".crt")), _write_key(key, path_stem.with_suffix(".key")))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_serving_cert(ca: KeyPair, directory: Path, hosts: tuple[str, ...] = SERVING_HOSTS) -> KeyPair:
    """The API server's TLS certificate, valid for loopback and the in-cluster Service names."""
    return _leaf(
        ca,
        _name("kube-apiserver"),
        ExtendedKeyUsageOID.SERVER_AUTH,
        directory / "apiserver",
        [_san(h) for h in hosts],
    )


def make_client_cert(
    ca: KeyPair, directory: Path, user: str, groups: tuple[str, ...] = (), stem: str | None = None
) -> KeyPair:
    """A client certificate: the API server maps CN to the user name and O to its groups."""
    file_stem = stem or user.replace(":", "-")
    return _leaf(ca, _name(user, groups), ExtendedKeyUsageOID.CLIENT_AUTH, directory / file_stem)


def make_service_account_keys(directory: Path) -> KeyPair:
    """The key pair that signs and verifies service-account tokens (`cert` is the public key)."""
    key = _new_key()
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    pub_path = directory / "sa.pub"
    pub_path.write_bytes(public)
    return KeyPair(pub_path, _write_key(key, directory / "sa.key"))


def generate(directory: Path, extra_hosts: tuple[str, ...] = ()) -> PKI:
    """Everything a fresh control plane needs, written under `directory`; the serving certificate is also valid
    for `extra_hosts` (the bridge address real nodes reach the API server at)."""
    directory.mkdir(parents=True, exist_ok=True)
    serving_ca = make_ca(directory, "serving-ca")
    client_ca = make_ca(directory, "client-ca")
    return PKI(
        directory=directory,
        serving_ca=serving_ca,
        serving=make_serving_cert(serving_ca, directory, tuple(dict.fromkeys(SERVING_HOSTS + extra_hosts))),
        client_ca=client_ca,
        service_account=make_service_account_keys(directory),
        admin=make_client_cert(client_ca, directory, "admin", ("system:masters",)),
    )
