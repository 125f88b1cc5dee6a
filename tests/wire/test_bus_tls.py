"""TLS for a bus that spans hosts: a real nats-server with a certificate signed by a throwaway CA
(made here with the openssl command) that also verifies its clients' certificates. ``Bus`` given
the CA (and its client certificate) connects over a tls:// URL and carries requests; without the
CA, or without a client certificate, it fails at once with a clear error instead of retrying."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli.credentials import StackCredentials
from services.cli.servers import ServerProcess, start_nats
from shared.wire import subjects
from shared.wire.bus import Bus, BusAuthError, BusError
from shared.wire.bus_auth import BusAuth


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(name: str, extension: str, d: Path) -> tuple[str, str]:
    """A key and a certificate for ``name`` signed by the CA in ``d``."""
    (d / f"{name}.ext").write_text(extension + "\n")
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
        "-subj", f"/CN={name}", cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d,
    )  # fmt: skip
    return str(d / f"{name}.pem"), str(d / f"{name}.key")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no test certificates")
    d = tmp_path_factory.mktemp("tls")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=llmserve test CA", cwd=d,
    )  # fmt: skip
    server_cert, server_key = _signed(
        "server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth", d
    )
    client_cert, client_key = _signed("client", "extendedKeyUsage=clientAuth", d)
    return dict(
        ca=str(d / "ca.pem"),
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
    )


@pytest.fixture(scope="module")
def tls_server(certs) -> Iterator[tuple[ServerProcess, StackCredentials]]:
    credentials = StackCredentials.generate()
    server = start_nats(
        extra_config=(
            f"tls {{ cert_file: {certs['server_cert']!r}, key_file: {certs['server_key']!r}, "
            f"ca_file: {certs['ca']!r}, verify: true, timeout: 2 }}\n"
            + credentials.nats_authorization()
        )
    )
    yield server, credentials
    server.stop()


def test_a_bus_over_tls_with_the_ca_and_a_client_certificate(tls_server, certs):
    server, credentials = tls_server
    url = f"tls://{server.host}:{server.port}"

    async def main() -> None:
        def auth(user: str) -> BusAuth:
            return BusAuth(
                user=user,
                password=credentials.nats_passwords[user],
                tls_ca_file=certs["ca"],
                tls_cert_file=certs["client_cert"],
                tls_key_file=certs["client_key"],
            )

        async with (
            await Bus.connect(url, "tokenizer", auth=auth("tokenizer")) as tokenizer,
            await Bus.connect(url, "gateway", auth=auth("gateway")) as gateway,
        ):

            async def on_status(msg) -> None:
                await msg.respond(b"ok over tls")

            await tokenizer.subscribe(subjects.TOKENIZER_STATUS, on_status)
            await tokenizer.flush()
            reply = await gateway.request(subjects.TOKENIZER_STATUS, b"", timeout=5)
            assert reply == b"ok over tls"

    asyncio.run(main())


def test_a_server_whose_certificate_does_not_verify_is_refused_at_once(tls_server, certs):
    server, credentials = tls_server
    url = f"tls://{server.host}:{server.port}"
    user = credentials.nats_auth("gateway")

    async def main() -> None:
        t0 = time.monotonic()
        # The system's CAs do not know the test CA.
        with pytest.raises(BusAuthError, match="certificate does not verify"):
            await Bus.connect(url, "g", auth=user, connect_timeout_s=30)
        assert time.monotonic() - t0 < 5
        # The right CA but no client certificate: the server will not talk to us.
        no_cert = BusAuth(user="gateway", password=user.password, tls_ca_file=certs["ca"])
        t0 = time.monotonic()
        with pytest.raises(BusAuthError, match="client certificate"):
            await Bus.connect(url, "g", auth=no_cert, connect_timeout_s=30)
        assert time.monotonic() - t0 < 5

    asyncio.run(main())


def test_the_tls_options_are_checked():
    with pytest.raises(ValueError, match="both its cert and its key"):
        BusAuth(tls_cert_file="c.pem")
    with pytest.raises(ValueError, match="NATS_PASSWORD"):
        BusAuth(user="gateway")
    with pytest.raises(ValueError, match="needs its user"):
        BusAuth(password="p")

    async def main() -> None:
        with pytest.raises(BusError, match="TLS files"):
            await Bus.connect("tls://127.0.0.1:1", "x", auth=BusAuth(tls_ca_file="/no/such/ca.pem"))

    asyncio.run(main())
