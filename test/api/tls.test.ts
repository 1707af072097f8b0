// TLS and mutual TLS: certificates made here with openssl.
import * as grpc from "@grpc/grpc-js";
import { execFileSync, spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { SidecarClient } from "../../src/api/client.js";
import { type ApiServer, startApiServer } from "../../src/api/server.js";
import { EventLog } from "../../src/sidecar/event-log.js";
import { FixtureSidecar, rejection } from "./fixtures.js";

const hasOpenssl = spawnSync("openssl", ["version"]).status === 0;

interface Pki {
  ca: Buffer;
  serverCert: Buffer;
  serverKey: Buffer;
  clientCert: Buffer;
  clientKey: Buffer;
  otherCaClientCert: Buffer;
  otherCaClientKey: Buffer;
}

let dir = "";
let pki: Pki;

function makePki(d: string): Pki {
  const ssl = (...args: string[]) => execFileSync("openssl", args, { cwd: d, stdio: "pipe" });
  const ca = (name: string) => {
    ssl(
      "req",
      "-x509",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-keyout",
      `${name}.key`,
      "-out",
      `${name}.pem`,
      "-days",
      "1",
      "-subj",
      `/CN=${name}`,
    );
  };
  const leaf = (name: string, caName: string, ext: string) => {
    ssl(
      "req",
      "-newkey",
      "rsa:2048",
      "-nodes",
      "-keyout",
      `${name}.key`,
      "-out",
      `${name}.csr`,
      "-subj",
      `/CN=${name}`,
    );
    writeFileSync(join(d, `${name}.ext`), ext);
    ssl(
      "x509",
      "-req",
      "-in",
      `${name}.csr`,
      "-CA",
      `${caName}.pem`,
      "-CAkey",
      `${caName}.key`,
      "-CAcreateserial",
      "-out",
      `${name}.pem`,
      "-days",
      "1",
      "-extfile",
      `${name}.ext`,
    );
  };
  ca("ca");
  ca("other-ca");
  leaf("server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n");
  leaf("client", "ca", "extendedKeyUsage=clientAuth\n");
  leaf("intruder", "other-ca", "extendedKeyUsage=clientAuth\n");
  const r = (f: string) => readFileSync(join(d, f));
  return {
    ca: r("ca.pem"),
    serverCert: r("server.pem"),
    serverKey: r("server.key"),
    clientCert: r("client.pem"),
    clientKey: r("client.key"),
    otherCaClientCert: r("intruder.pem"),
    otherCaClientKey: r("intruder.key"),
  };
}

beforeAll(() => {
  // scripts/setup.sh installs openssl: without it this file fails, rather than skip the mTLS checks.
  if (!hasOpenssl)
    throw new Error(
      "the openssl command is missing: run scripts/setup.sh (or apt-get install openssl)",
    );
  dir = mkdtempSync(join(tmpdir(), "kvxfer-tls-"));
  pki = makePki(dir);
});
afterAll(() => {
  if (dir) rmSync(dir, { recursive: true, force: true });
});

const cleanup: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const f of cleanup.splice(0).reverse()) await f();
});

async function serve(requireClientCert: boolean): Promise<ApiServer> {
  const events = new EventLog();
  const fx = new FixtureSidecar(events);
  fx.end("t1", "KV_READY");
  const s = await startApiServer({
    view: fx,
    events,
    tls: {
      cert: pki.serverCert,
      key: pki.serverKey,
      ...(requireClientCert ? { ca: pki.ca, requireClientCert: true } : {}),
    },
  });
  cleanup.push(async () => {
    await s.close(1_000);
    events.close();
  });
  return s;
}

function client(
  address: string,
  tls: ConstructorParameters<typeof SidecarClient>[1],
): SidecarClient {
  const c = new SidecarClient(address, { timeoutMs: 3_000, ...tls });
  cleanup.push(() => c.close());
  return c;
}

describe("TLS", () => {
  it("serves over TLS to a client that trusts the CA; refuses a plaintext client", async () => {
    const s = await serve(false);
    const ok = client(s.address, { tls: { ca: pki.ca } });
    expect((await ok.getStatus()).engineId).toBe("decode-0");
    const plain = client(s.address, {});
    expect((await rejection(plain.getStatus())).code).toBe(grpc.status.UNAVAILABLE);
  });

  it("mTLS: refuses a client without a certificate or with one from another CA; accepts one from the CA", async () => {
    const s = await serve(true);
    const noCert = client(s.address, { tls: { ca: pki.ca } });
    expect((await rejection(noCert.health())).code).toBe(grpc.status.UNAVAILABLE);
    const intruder = client(s.address, {
      tls: { ca: pki.ca, cert: pki.otherCaClientCert, key: pki.otherCaClientKey },
    });
    expect((await rejection(intruder.health())).code).toBe(grpc.status.UNAVAILABLE);
    const good = client(s.address, {
      tls: { ca: pki.ca, cert: pki.clientCert, key: pki.clientKey },
    });
    expect(await good.health()).toBe("SERVING");
    expect((await good.awaitTransfer("t1", 2_000)).kind).toBe("KV_READY");
  });
});
