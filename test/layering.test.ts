/**
 * Dependencies point one way (docs/architecture.md): nothing under
 * src/sidecar/ imports src/api/ or src/cli/. The sidecar reports through
 * `TransferMetrics` (src/sidecar/metrics.ts); the composition root
 * (src/cli/sidecar.ts) wires the API to it.
 */
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const SIDECAR_DIR = fileURLToPath(new URL("../src/sidecar/", import.meta.url));

function importsOf(text: string): string[] {
  const out: string[] = [];
  for (const m of text.matchAll(/(?:\bfrom|\bimport)\s*\(?\s*["']([^"']+)["']/g)) out.push(m[1]!);
  return out;
}

describe("src/sidecar/", () => {
  it("imports nothing from src/api/ or src/cli/", () => {
    const files = readdirSync(SIDECAR_DIR).filter((f) => f.endsWith(".ts"));
    expect(files).toContain("sidecar.ts");
    const wrong: string[] = [];
    for (const file of files) {
      for (const spec of importsOf(readFileSync(join(SIDECAR_DIR, file), "utf8"))) {
        if (/^\.\.\/(api|cli)\//.test(spec)) wrong.push(`${file} -> ${spec}`);
      }
    }
    expect(wrong).toEqual([]);
  });
});
