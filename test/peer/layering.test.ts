/**
 * "Peer" lives in one folder, below the sidecar (src/sidecar/README.md): nothing under src/peer/
 * imports src/sidecar/, src/api/ or src/cli/; the sidecar hands the peer table what it needs.
 */
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const PEER_DIR = fileURLToPath(new URL("../../src/peer/", import.meta.url));

describe("src/peer/", () => {
  it("imports nothing from src/sidecar/, src/api/ or src/cli/", () => {
    const files = readdirSync(PEER_DIR).filter((f) => f.endsWith(".ts"));
    expect(files).toEqual(
      expect.arrayContaining(["messages.ts", "peer-state.ts", "peer-table.ts", "side-channel.ts"]),
    );
    const wrong: string[] = [];
    for (const file of files) {
      const text = readFileSync(join(PEER_DIR, file), "utf8");
      for (const m of text.matchAll(/(?:\bfrom|\bimport)\s*\(?\s*["']([^"']+)["']/g))
        if (/^\.\.\/(sidecar|api|cli)\//.test(m[1]!)) wrong.push(`${file} -> ${m[1]}`);
    }
    expect(wrong).toEqual([]);
  });
});
