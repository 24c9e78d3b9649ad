"""TLS and mutual TLS: throwaway certificates made in the test (cryptography's x509 builder)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from service_harness import SPEC, fresh_tokens, random_kv, start

from kvstore.admin_client import AdminClient
from kvstore.client import Client, ClientTLS
from kvstore.errors import KVStoreError


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, issuer_key: ec.EllipticCurvePrivateKey,
          *, ca: bool = False, usage: x509.ObjectIdentifier | None = None) -> x509.Certificate:
    now = dt.datetime.now(dt.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if usage == ExtendedKeyUsageOID.SERVER_AUTH:
        b = b.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        path.with_suffix(".key").chmod(0o600)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """ca.pem, server.pem/.key (localhost, 127.0.0.1), client.pem/.key, all from one throwaway CA."""
    d = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("kvstore test CA", ca_key, "kvstore test CA", ca_key, ca=True)
    _write(d / "ca", ca)
    for name, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        _write(d / name, _cert(f"kvstore {name}", key, "kvstore test CA", ca_key, usage=usage), key)
    return d


def _tls(pki: Path, mutual: bool) -> dict[str, str]:
    cfg = {"cert_file": str(pki / "server.pem"), "key_file": str(pki / "server.key")}
    if mutual:
        cfg["client_ca_file"] = str(pki / "ca.pem")
    return cfg


def _refused(target: str, token: str, tls: ClientTLS | None) -> None:
    with Client(target, token, local=False, timeout=3, tls=tls) as c, pytest.raises(KVStoreError) as err:
        c.whoami()
    assert err.value.code == "UNAVAILABLE"


def test_tls_client_works_and_plaintext_client_fails(tmp_path, pki):
    sc = start(tmp_path, tls=_tls(pki, mutual=False))
    try:
        tls = ClientTLS(root_cert_file=pki / "ca.pem")
        with AdminClient(sc.target, sc.admin_token, tls=tls) as admin:
            token = admin.create_tenant("secure")
        with Client(sc.target, token, local=False, tls=tls) as c:
            assert c.whoami()["principal"] == "secure"
            keys = c.block_keys(SPEC, fresh_tokens(2))
            kv = random_kv(2, seed=2)
            c.put(SPEC, keys, kv)
            assert torch.equal(c.get(SPEC, keys).view(torch.int16), kv.view(torch.int16))
        _refused(sc.target, token, None)
    finally:
        sc.stop()


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, pki):
    sc = start(tmp_path, tls=_tls(pki, mutual=True))
    try:
        with_cert = ClientTLS(root_cert_file=pki / "ca.pem", cert_file=pki / "client.pem", key_file=pki / "client.key")
        with AdminClient(sc.target, sc.admin_token, tls=with_cert) as admin:
            token = admin.create_tenant("mutual")
        with Client(sc.target, token, local=False, tls=with_cert) as c:
            assert c.whoami()["principal"] == "mutual"
        _refused(sc.target, token, ClientTLS(root_cert_file=pki / "ca.pem"))
        _refused(sc.target, token, None)
    finally:
        sc.stop()


# -- the operators' CLI over (mutual) TLS -------------------------------------------------------------
def _cli(sc, *args: str):
    from typer.testing import CliRunner

    from kvstore.cli_serve import admin_app

    return CliRunner().invoke(admin_app, [*args, "--target", sc.target, "--token", sc.admin_token],
                              env={"COLUMNS": "200"})


def test_admin_cli_talks_to_a_mutual_tls_server_with_a_client_certificate(tmp_path, pki):
    sc = start(tmp_path, tls=_tls(pki, mutual=True))
    tls = ["--ca-file", str(pki / "ca.pem"), "--cert-file", str(pki / "client.pem"), "--key-file", str(pki / "client.key")]
    try:
        added = _cli(sc, "tenant", "add", "mtls-cli", *tls)
        assert added.exit_code == 0, added.output
        assert added.output.strip().startswith("kvs_")
        for args in (["tenant", "rotate", "mtls-cli"], ["policy", "set", "mtls-cli", "--ttl", "60"],
                     ["policy", "get", "mtls-cli"], ["tenant", "list"], ["stats"], ["audit", "--json"],
                     ["tenant", "delete", "mtls-cli", "--yes"]):
            result = _cli(sc, *args, *tls)
            assert result.exit_code == 0, (args, result.output)
        assert _cli(sc, "stats", *tls, "--server-name", "localhost").exit_code == 0
        wrong_name = _cli(sc, "stats", *tls, "--server-name", "not-this-server.example")
        assert wrong_name.exit_code == 1 and "UNAVAILABLE" in wrong_name.output
        no_cert = _cli(sc, "stats", "--ca-file", str(pki / "ca.pem"))
        assert no_cert.exit_code == 1 and "UNAVAILABLE" in no_cert.output
    finally:
        sc.stop()


@pytest.mark.parametrize("args, says", [
    (["--cert-file", "{pki}/client.pem"], "--cert-file needs --key-file"),
    (["--key-file", "{pki}/client.key"], "--key-file needs --cert-file"),
    (["--ca-file", "{pki}/missing.pem"], "--ca-file '{pki}/missing.pem': cannot read it: No such file"),
    (["--cert-file", "{pki}/missing.pem", "--key-file", "{pki}/client.key"], "--cert-file '{pki}/missing.pem': cannot read it"),
    (["--cert-file", "{pki}/client.pem", "--key-file", "{pki}/server.key"], "is not the key of the certificate in --cert-file"),
    (["--cert-file", "{pki}/client.key", "--key-file", "{pki}/client.key"], "holds no PEM certificate"),
])
def test_admin_cli_says_which_tls_file_is_wrong(pki, args, says):
    from typer.testing import CliRunner

    from kvstore.cli_serve import admin_app

    args = [a.format(pki=pki) for a in args]
    result = CliRunner().invoke(admin_app, ["stats", "--target", "127.0.0.1:1", "--token", "kvs_x", *args],
                                env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    assert "INVALID_ARGUMENT" in result.output and says.format(pki=pki) in result.output


# -- the server's own key pair is checked before it binds -----------------------------------------------
def _encrypted_key(pki: Path) -> Path:
    key = serialization.load_pem_private_key((pki / "server.key").read_bytes(), password=None)
    path = pki / "encrypted.key"
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.BestAvailableEncryption(b"secret")))
    return path


@pytest.mark.parametrize("change, says", [
    ({"key_file": "client.key"}, ("tls.key_file '{pki}/client.key' is not the key of the certificate in "
                                  "tls.cert_file '{pki}/server.pem'")),
    ({"key_file": "ca.pem"}, "tls.key_file '{pki}/ca.pem' holds no PEM private key"),
    ({"key_file": "missing.key"}, "tls.key_file '{pki}/missing.key': cannot read it"),
    ({"key_file": "encrypted.key"}, "tls.key_file '{pki}/encrypted.key' is encrypted"),
    ({"cert_file": "server.key"}, "tls.cert_file '{pki}/server.key' holds no PEM certificate"),
    ({"client_ca_file": "client.key"}, "tls.client_ca_file '{pki}/client.key' holds no PEM certificate"),
    ({"key_file": "open.key"}, "tls.key_file '{pki}/open.key' has permissions 0644: other users may read"),
])
def test_a_bad_server_key_pair_is_a_config_error_naming_the_files(tmp_path, pki, change, says):
    """A key that is not the certificate's was reported as "cannot bind 127.0.0.1:0"."""
    from kvstore.errors import InvalidArgument

    _encrypted_key(pki)
    (pki / "open.key").write_bytes((pki / "server.key").read_bytes())  # NOTE: was taken at 0644
    (pki / "open.key").chmod(0o644)
    tls = {**_tls(pki, mutual=True), **{k: str(pki / v) for k, v in change.items()}}
    with pytest.raises(InvalidArgument) as err:
        start(tmp_path, tls=tls)
    assert says.format(pki=pki) in str(err.value)
    assert "bind" not in str(err.value) and "\n" not in str(err.value)
