/**
 * The sidecar's certificates and keys: PEM files read (a missing file is an ERR_CONFIG naming
 * its flag), CA files and our own certificates checked before anything listens, the side
 * channel's credentials (--peer-*) and the gRPC server's TLS (--tls-*).
 */
import { X509Certificate } from "node:crypto";
import { readFileSync } from "node:fs";

import type { ApiTlsOptions } from "../api/server-options.js";
import { KvxferError } from "../errors.js";
import { validityProblem, type PeerCredentials } from "../peer/side-channel.js";
import type { SettingName } from "./sidecar-settings.js";

/** A PEM file's bytes; a file that cannot be read is an ERR_CONFIG naming its flag. */
export function readPem(flag: string, path: string): Buffer {
  try {
    return readFileSync(path);
  } catch (err) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${flag}: cannot read '${path}': ${(err as Error).message}`,
    );
  }
}

/**
 * Reads a CA file and checks it holds at least one certificate, each PEM certificate block
 * parsing as X.509: gRPC would otherwise start with it and refuse every client.
 */
export function readCa(flag: string, path: string): Buffer {
  const pem = readPem(flag, path);
  const blocks =
    pem.toString("latin1").match(/-----BEGIN CERTIFICATE-----[\s\S]*?-----END CERTIFICATE-----/g) ??
    [];
  if (blocks.length === 0) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${flag} '${path}' holds no PEM certificate (-----BEGIN CERTIFICATE-----)`,
    );
  }
  for (const [i, block] of blocks.entries()) {
    try {
      new X509Certificate(block);
    } catch (err) {
      throw new KvxferError(
        "ERR_CONFIG",
        `--${flag} '${path}': certificate ${i + 1} of ${blocks.length} does not parse: ${(err as Error).message}`,
      );
    }
  }
  return pem;
}

/** Our own certificate must parse and be valid now: refused at start-up naming its dates. */
function checkOwnCertificate(flag: string, path: string): void {
  let cert: X509Certificate;
  try {
    cert = new X509Certificate(readPem(flag, path));
  } catch (err) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--${flag} '${path}' is not a PEM certificate: ${(err as Error).message}`,
    );
  }
  const when = validityProblem(cert, `--${flag} '${path}'`);
  if (when !== undefined) throw new KvxferError("ERR_CONFIG", when);
}

/** --peer-cert/--peer-key/--peer-ca: all three or none. */
export function peerCredentials(s: Record<SettingName, string>): {
  peerCredentials?: PeerCredentials;
} {
  const given = (["peer-cert", "peer-key", "peer-ca"] as const).filter((f) => s[f] !== "");
  if (given.length === 0) return {};
  if (given.length !== 3)
    throw new KvxferError(
      "ERR_CONFIG",
      `--peer-cert, --peer-key and --peer-ca go together (got only ${given.map((f) => `--${f}`).join(", ")})`,
    );
  return {
    peerCredentials: {
      cert: readPem("peer-cert", s["peer-cert"]),
      key: readPem("peer-key", s["peer-key"]),
      ca: readPem("peer-ca", s["peer-ca"]),
    },
  };
}

/**
 * --tls-cert/--tls-key/--tls-ca read and checked (the CA's certificates parse, our own
 * certificate is valid now): called before anything listens, so a TLS mistake stops the start.
 */
export function grpcServerTls(s: Record<SettingName, string>): ApiTlsOptions | undefined {
  if ((s["tls-cert"] === "") !== (s["tls-key"] === ""))
    throw new KvxferError("ERR_CONFIG", "--tls-cert and --tls-key go together");
  if (s["tls-ca"] !== "" && s["tls-cert"] === "")
    throw new KvxferError("ERR_CONFIG", "--tls-ca needs --tls-cert and --tls-key");
  if (s["tls-cert"] !== "") checkOwnCertificate("tls-cert", s["tls-cert"]);
  return s["tls-cert"] !== ""
    ? {
        cert: readPem("tls-cert", s["tls-cert"]),
        key: readPem("tls-key", s["tls-key"]),
        ...(s["tls-ca"] !== ""
          ? { ca: readCa("tls-ca", s["tls-ca"]), requireClientCert: true }
          : {}),
      }
    : undefined;
}
