/**
 * A throwaway certificate authority for the demo, tests and benchmarks, and the
 * only place they make certificates: peers authenticate with mutual TLS
 * (docs/security.md), so every sidecar they start gets a certificate naming
 * its engine id; the gRPC API's TLS tests get a server's and clients'. Made
 * here with the `openssl` command (scripts/setup.sh installs it). Files live
 * in one temporary folder, removed by close() or when this process exits.
 */
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { KvxferError } from "../src/errors.js";

export interface PeerCredentialFiles {
  readonly cert: string;
  readonly key: string;
  readonly ca: string;
}

/**
 * What a certificate is for: a peer's (either end of the side channel), a TLS server's on this
 * host (127.0.0.1 and localhost in its names), or a TLS client's.
 */
export type CertificateUse = "peer" | "server" | "client";

const EXTENDED_USAGE: Record<CertificateUse, string> = {
  peer: "extendedKeyUsage=serverAuth,clientAuth\n",
  server: "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
  client: "extendedKeyUsage=clientAuth\n",
};

const live = new Set<Pki>();
let exitHook = false;

/** `/CN=...` with the characters openssl's -subj treats specially escaped. */
function subject(cn: string): string {
  return `/CN=${cn.replace(/[\\/+=,]/g, (c) => `\\${c}`)}`;
}

export class Pki {
  readonly dir: string;
  readonly caCert: string;
  private readonly caKey: string;
  private readonly issued = new Map<string, PeerCredentialFiles>();
  private serial = 1;
  private closed = false;

  /** A new CA named `name` in a new temporary folder. */
  constructor(name = "kvxfer cluster CA") {
    this.dir = mkdtempSync(join(tmpdir(), "kvxfer-pki-"));
    this.caKey = join(this.dir, "ca.key");
    this.caCert = join(this.dir, "ca.pem");
    live.add(this);
    if (!exitHook) {
      exitHook = true;
      process.on("exit", () => {
        for (const p of live) p.close();
      });
    }
    this.ssl(
      "genpkey",
      "-algorithm",
      "EC",
      "-pkeyopt",
      "ec_paramgen_curve:P-256",
      "-out",
      this.caKey,
    );
    this.ssl(
      "req",
      "-x509",
      "-new",
      "-key",
      this.caKey,
      "-subj",
      subject(name),
      "-days",
      "7",
      "-addext",
      "basicConstraints=critical,CA:TRUE",
      "-addext",
      "keyUsage=critical,keyCertSign,cRLSign",
      "-out",
      this.caCert,
    );
  }

  /** Certificate and key naming `name` (an engine id for a peer), made once per name and use. */
  issue(name: string, use: CertificateUse = "peer"): PeerCredentialFiles {
    const known = this.issued.get(`${use}:${name}`);
    if (known !== undefined) return known;
    const n = this.serial++;
    const key = join(this.dir, `peer-${n}.key`);
    const csr = join(this.dir, `peer-${n}.csr`);
    const cert = join(this.dir, `peer-${n}.pem`);
    const ext = join(this.dir, `peer-${n}.ext`);
    writeFileSync(
      ext,
      "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n" + EXTENDED_USAGE[use],
    );
    this.ssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", key);
    this.ssl("req", "-new", "-key", key, "-subj", subject(name), "-out", csr);
    this.ssl(
      "x509",
      "-req",
      "-in",
      csr,
      "-CA",
      this.caCert,
      "-CAkey",
      this.caKey,
      "-set_serial",
      String(n),
      "-days",
      "7",
      "-extfile",
      ext,
      "-out",
      cert,
    );
    const files = { cert, key, ca: this.caCert };
    this.issued.set(`${use}:${name}`, files);
    return files;
  }

  /** The sidecar flags that give `engineId` its credentials. */
  sidecarFlags(engineId: string): string[] {
    const f = this.issue(engineId);
    return ["--peer-cert", f.cert, "--peer-key", f.key, "--peer-ca", f.ca];
  }

  close(): void {
    if (this.closed) return;
    this.closed = true;
    live.delete(this);
    rmSync(this.dir, { recursive: true, force: true });
  }

  private ssl(...args: string[]): void {
    try {
      execFileSync("openssl", args, { cwd: this.dir, stdio: "pipe" });
    } catch (err) {
      const e = err as NodeJS.ErrnoException & { stderr?: Buffer };
      throw new KvxferError(
        "ERR_CONFIG",
        e.code === "ENOENT"
          ? "the openssl command is missing (scripts/setup.sh installs it): it makes the peer certificates"
          : `openssl ${args[0]} failed: ${e.stderr?.toString().trim() ?? e.message}`,
      );
    }
  }
}

let shared: Pki | undefined;

/** One CA for every sidecar this process starts (made on first use). */
export function sharedPki(): Pki {
  if (shared === undefined) shared = new Pki();
  return shared;
}

/**
 * Closes every CA this process made (their folders go); a later `sharedPki()` makes a new one.
 * For a process that may be ended by a signal, where the exit hook does not run: the test
 * runner's workers call it after each file (test/setup/pki.ts).
 */
export function closeAllPkis(): void {
  for (const p of [...live]) p.close();
  shared = undefined;
}
