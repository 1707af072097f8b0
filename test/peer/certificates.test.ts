// Our own certificate outside its validity is refused at start-up, naming its dates (issue 31,
// case 7): the peer certificate (checkCredentials) and the gRPC one (the same validityProblem,
// called by `kvxfer sidecar` for --tls-cert). The clock is moved, not the certificate.
import { X509Certificate } from "node:crypto";

import { afterAll, afterEach, describe, expect, it, vi } from "vitest";

import { checkCredentials, validityProblem } from "../../src/peer/side-channel.js";
import { Pki } from "../../sim/pki.js";
import { credentials } from "../sidecar/multiprocess/rogue-peer.js";

const pki = new Pki("validity test CA");
afterAll(() => pki.close());
afterEach(() => {
  vi.useRealTimers();
});

describe("own certificate validity", () => {
  const creds = credentials(pki, "p0");
  const cert = new X509Certificate(creds.cert);
  const from = Date.parse(cert.validFrom);
  const to = Date.parse(cert.validTo);

  it("names both dates when the certificate is not valid yet or has expired", () => {
    expect(validityProblem(cert, "--peer-cert", from + 1000)).toBeUndefined();
    const early = validityProblem(cert, "--peer-cert", from - 86_400_000);
    expect(early).toMatch(/^--peer-cert is not valid yet \(valid from .* to .*, now .*\)$/);
    expect(early).toContain(cert.validFrom);
    expect(early).toContain(cert.validTo);
    const late = validityProblem(cert, "--tls-cert 'x.pem'", to + 1000);
    expect(late).toMatch(/^--tls-cert 'x.pem' has expired \(valid from /);
  });

  it("checkCredentials refuses a peer certificate not valid yet (ERR_CONFIG), and accepts it in its window", () => {
    expect(() => checkCredentials(creds, "p0")).not.toThrow();
    vi.useFakeTimers({ toFake: ["Date"] });
    vi.setSystemTime(from - 3600_000);
    expect(() => checkCredentials(creds, "p0")).toThrow(
      expect.objectContaining({
        code: "ERR_CONFIG",
        message: expect.stringMatching(/--peer-cert is not valid yet .*valid from/),
      }),
    );
    vi.setSystemTime(to + 3600_000);
    expect(() => checkCredentials(creds, "p0")).toThrow(/--peer-cert has expired/);
  });
});
