// A process that ends while the addon still has notifications queued for JavaScript: Node tears its
// environment down with the batch undelivered, and JavaScript can no longer run. That used to
// abort the process ("terminate called after throwing an instance of 'Napi::Error'", 3 of 130
// runs of this script before the fix, 0 of 200 after): the delivery callback let a C++ exception
// out. Each run here must end as Node decides (0 when the notification came first, 13 for the
// unsettled await), never by SIGABRT.
import { existsSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";

import { runNode } from "../run-node.js";

const face = join(import.meta.dirname, "..", "..", "dist", "src", "native", "index.js");
const dir = mkdtempSync(join(tmpdir(), "kvxfer-teardown-"));
const prefix = `kvxfer-teardown-${process.pid}-`;

const script = `
import { rmSync, writeFileSync } from "node:fs";
import { Agent } from ${JSON.stringify(face)};
const file = "/dev/shm/${prefix}" + process.pid;
writeFileSync(file, Buffer.alloc(1 << 20));
process.on("exit", () => rmSync(file, { force: true }));
const p = new Agent({ name: "p", transports: "shm,self" });
const d = new Agent({ name: "d", transports: "shm,self" });
const src = p.registerMemory(Buffer.alloc(1 << 20, 7));
const dst = d.mapFile(file, { offset: 0, length: 1 << 20 });
const ep = p.connect(d.address);
const remote = ep.importRemote(dst.remoteKey());
await p.write(ep, src, remote, new Float64Array([0, 0, 4096]), Buffer.from("done"));
// Nothing keeps Node alive here: it may exit with the notification still queued.
await new Promise((resolve) => d.on("notifications", resolve));
`;

afterAll(() => {
  rmSync(dir, { recursive: true, force: true });
  for (const f of readdirSync("/dev/shm")) if (f.startsWith(prefix)) rmSync(join("/dev/shm", f));
});

describe("exit with notifications queued", () => {
  it("never aborts the process (40 runs)", { timeout: 120_000 }, async () => {
    expect(existsSync(face), `${face} is built by npm run build`).toBe(true);
    const file = join(dir, "exit.mjs");
    writeFileSync(file, script);
    for (let i = 0; i < 40; i++) {
      const r = await runNode([file]);
      expect(r.stderr).not.toContain("terminate called");
      expect([0, 13], `run ${i}: status ${r.status}, stderr ${r.stderr.slice(-500)}`).toContain(
        r.status,
      );
    }
  });
});
