// `kvxfer bench peers --faults` on a small scale with kvxfer's agent alone (NIXL and Mooncake are
// not needed here: a missing peer is a row saying so): every case runs on the fault harness's
// link, kvxfer's agent (error mode peer, over TCP) moves every transfer on a capped, lossy,
// delayed and cut link, and after the cut heals the next READ goes through on the same
// endpoint. Needs root, tc and iptables; skipped by name without them.
import { describe, expect, it } from "vitest";

import { faultSupport } from "../../bench/net/faults.js";
import { formatPeerFaults, parsePeerFaultsArgs, runPeerFaults } from "../../bench/peer-faults.js";

const support = faultSupport();

describe("bench peers --faults", () => {
  it("parses its flags and refuses unknown ones", () => {
    expect(parsePeerFaultsArgs(["--systems", "kvxfer,nixl", "--quick"])).toMatchObject({
      systems: ["kvxfer", "nixl"],
      count: 8,
      cutS: 8,
    });
    expect(() => parsePeerFaultsArgs(["--systems", "ucx"])).toThrow(/unknown system/);
    expect(() => parsePeerFaultsArgs(["--sizes", "4k"])).toThrow(/unknown argument/);
  });

  it.skipIf(support.missing !== undefined)(
    `runs every fault with kvxfer's agent and reports a missing peer as not installed${support.missing !== undefined ? ` (skipped: ${support.missing})` : ""}`,
    async () => {
      const r = await runPeerFaults({
        json: true,
        systems: ["kvxfer", "nixl"],
        count: 4,
        size: 1 << 20,
        capMbit: 50,
        cutS: 3,
        python: "/nonexistent/python3",
      });
      expect(r.systems.map((s) => [s.label, s.status])).toEqual([
        ["kvxfer", "ok"],
        ["nixl", "not installed"],
      ]);
      expect(r.rows.map((row) => row.fault)).toEqual([
        "clean link",
        "cap 50 Mbit/s",
        "1% loss each way",
        "5 ms ± 1 ms each way",
        "1% loss and 5 ms ± 1 ms each way, 8 in flight",
        "cut 3 s both ways, 50 Mbit/s",
      ]);
      for (const row of r.rows) {
        const c = row.values.kvxfer!;
        if (row.fault.includes("5 ms") && support.delayMissing !== undefined) {
          expect(c.error).toMatch(/^not run: /);
          continue;
        }
        expect(c, row.fault).toMatchObject({ done: row.count, failed: 0, pending: 0 });
        expect(row.values.nixl).toMatchObject({ error: "not installed" });
      }
      const cut = r.rows.at(-1)!.values.kvxfer!;
      // The READs were cut mid-flight and finished after the heal, 3 s later at least.
      expect(cut.lastDoneMs).toBeGreaterThan(3_000);
      expect(cut.after).toMatchObject({ ok: true });
      expect(formatPeerFaults(r)).toContain("| cut 3 s both ways, 50 Mbit/s | 4/4 done");
    },
    180_000,
  );
});
