// The source's shape, checked: rules docs/architecture.md states that a reviewer would otherwise
// have to remember.
import { readFileSync, readdirSync } from "node:fs";
import { join, relative } from "node:path";

import { describe, expect, it } from "vitest";

const ROOT = join(import.meta.dirname, "..");

function sources(dir: string): string[] {
  return readdirSync(join(ROOT, dir), { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile() && e.name.endsWith(".ts"))
    .map((e) => relative(ROOT, join(e.parentPath, e.name)))
    .filter((f) => !f.startsWith("src/gen/"));
}

/** Lines of `files` matching `re`, as "file:line: text". */
function offending(files: string[], re: RegExp): string[] {
  const out: string[] = [];
  for (const f of files) {
    readFileSync(join(ROOT, f), "utf8")
      .split("\n")
      .forEach((line, i) => {
        if (re.test(line)) out.push(`${f}:${i + 1}: ${line.trim()}`);
      });
  }
  return out;
}

describe("structure", () => {
  it("a transfer's state is written only by src/sidecar/lifecycle.ts (no `.state =` elsewhere)", () => {
    const files = [...sources("src"), ...sources("sim"), ...sources("bench")].filter(
      (f) => f !== "src/sidecar/lifecycle.ts",
    );
    expect(files.length).toBeGreaterThan(20);
    expect(offending(files, /\.state\s*=(?!=)/)).toEqual([]);
  });
});
