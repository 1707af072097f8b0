"""The one throwaway certificate authority of the Python test and bench harnesses (``openssl``):
every sidecar they start gets a certificate naming its engine id, so peers authenticate each other
as in production (docs/security.md). TypeScript's twin is ``src/sim/pki.ts``.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path


class Pki:
    """A throwaway CA (``openssl``): every sidecar the harness starts gets a certificate naming
    its engine id, so peers authenticate each other as in production (docs/security.md)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvxfer-pki-"))
        self.ca = self.dir / "ca.pem"
        self._n = 0
        self._issued: dict[str, list[str]] = {}
        self._ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "ca.key")
        self._ssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvxfer test CA", "-days", "7",
                  "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign",
                  "-out", "ca.pem")
        atexit.register(self.close)

    def _ssl(self, *args: str) -> None:
        subprocess.run(["openssl", *args], cwd=self.dir, check=True, capture_output=True)

    def flags(self, engine_id: str) -> list[str]:
        """``--peer-cert/--peer-key/--peer-ca`` for ``engine_id`` (issued once)."""
        if engine_id not in self._issued:
            self._n += 1
            n = self._n
            (self.dir / f"{n}.ext").write_text(
                "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")
            self._ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{n}.key")
            self._ssl("req", "-new", "-key", f"{n}.key", "-subj", f"/CN={engine_id}", "-out", f"{n}.csr")
            self._ssl("x509", "-req", "-in", f"{n}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial",
                      str(n), "-days", "7", "-extfile", f"{n}.ext", "-out", f"{n}.pem")
            self._issued[engine_id] = ["--peer-cert", str(self.dir / f"{n}.pem"),
                                       "--peer-key", str(self.dir / f"{n}.key"), "--peer-ca", str(self.ca)]
        return self._issued[engine_id]

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


_shared_pki: Pki | None = None


def shared_pki() -> Pki:
    global _shared_pki
    if _shared_pki is None:
        _shared_pki = Pki()
    return _shared_pki
