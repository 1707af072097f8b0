/**
 * The error code catalogue (`ERROR_CODES` in src/errors.ts) against the
 * source and against docs/api.md ("Error codes"):
 * - every `ERR_*` code written in src/ (not src/gen), sim/ or native/src/, in a
 *   string or in a comment, is in the catalogue;
 * - every code in the catalogue is written somewhere there (outside the
 *   catalogue itself);
 * - docs/api.md has one table with the same codes, in the same order, with
 *   the same one-line meanings, and no other doc has a table of codes.
 * Only text is read: a new code fails here whether or not a test reaches it.
 */
import { readFileSync, readdirSync } from "node:fs";
import { join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

import { ERROR_CODES, errorCode, type ErrorCode } from "../src/errors.js";

const ROOT = fileURLToPath(new URL("..", import.meta.url));

/** `ERR_*` names in kvxfer's source that are not kvxfer's codes, and why. */
const NOT_OURS: Readonly<Record<string, string>> = {
  ERR_TLS_CERT: "Node's TLS error code, recognised in a client error (src/cli/grpc-client.ts)",
  ERR_MODULE_NOT_FOUND:
    "Node's code for an import that finds nothing, recognised for an optional package (src/cli/optional.ts)",
};

/** A code: ERR_ and capitals, not part of a longer name (UCS_ERR_*, STDERR_*). */
const CODE = /(?<![A-Za-z0-9_])ERR_[A-Z0-9_]+/g;

function filesUnder(dir: string, keep: (path: string) => boolean): string[] {
  return readdirSync(join(ROOT, dir), { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => relative(ROOT, join(e.parentPath, e.name)))
    .filter(keep)
    .sort();
}

const SOURCES = [
  ...filesUnder("src", (p) => p.endsWith(".ts") && !p.startsWith(join("src", "gen"))),
  // The simulated engine's control replies (kvxfer-sim, `kvxfer sim-engine`) carry codes too.
  ...filesUnder("sim", (p) => p.endsWith(".ts")),
  ...filesUnder(join("native", "src"), () => true),
];

/** src/errors.ts without the catalogue: what is left of it emits codes too (ERR_INTERNAL). */
function withoutCatalogue(text: string): string {
  const start = text.indexOf("export const ERROR_CODES = {");
  const end = text.indexOf("} as const;", start);
  expect(start, "src/errors.ts: ERROR_CODES not found").toBeGreaterThanOrEqual(0);
  expect(end, "src/errors.ts: the end of ERROR_CODES not found").toBeGreaterThan(start);
  return text.slice(0, start) + text.slice(end);
}

/** Every code written in the sources: code -> "file:line" places. */
function codesInSource(): Map<string, string[]> {
  const out = new Map<string, string[]>();
  for (const file of SOURCES) {
    let text = readFileSync(join(ROOT, file), "utf8");
    if (file === join("src", "errors.ts")) text = withoutCatalogue(text);
    text.split("\n").forEach((line, i) => {
      for (const m of line.matchAll(CODE)) {
        const places = out.get(m[0]) ?? [];
        places.push(`${file}:${i + 1}`);
        out.set(m[0], places);
      }
    });
  }
  return out;
}

/** The rows of docs/api.md's "Error codes" table: code and meaning, in order. */
function apiDocTable(): [string, string][] {
  const doc = readFileSync(join(ROOT, "docs", "api.md"), "utf8");
  const start = doc.indexOf("\n## Error codes\n");
  expect(start, 'docs/api.md has no "## Error codes" section').toBeGreaterThanOrEqual(0);
  const next = doc.indexOf("\n## ", start + 1);
  const section = doc.slice(start, next < 0 ? undefined : next);
  const rows: [string, string][] = [];
  for (const line of section.split("\n")) {
    const m = /^\| `(ERR_[A-Z0-9_]+)` \| ([^|]*) \|/.exec(line);
    if (m !== null) rows.push([m[1]!, m[2]!.trim()]);
  }
  return rows;
}

const catalogue = Object.entries(ERROR_CODES) as [ErrorCode, string][];

describe("the error code catalogue", () => {
  it("finds the sources it reads", () => {
    expect(SOURCES).toContain(join("src", "sidecar", "sidecar.ts"));
    expect(SOURCES).toContain(join("native", "src", "addon.cc"));
    expect(SOURCES.some((f) => f.startsWith(join("src", "gen")))).toBe(false);
  });

  it("lists every ERR_ code written in src/, sim/ and native/src/", () => {
    const missing: string[] = [];
    for (const [code, places] of codesInSource()) {
      if (code in ERROR_CODES || code in NOT_OURS) continue;
      // A prefix (e.g. "ERR_REGION_" in `code.startsWith(...)`) must name a family of codes.
      if (code.endsWith("_") && catalogue.some(([c]) => c.startsWith(code))) continue;
      missing.push(`${code} (${places.join(", ")})`);
    }
    expect(missing, "add these to ERROR_CODES in src/errors.ts and to docs/api.md").toEqual([]);
  });

  it("lists no code that nothing emits", () => {
    const used = codesInSource();
    const unused = catalogue.map(([c]) => c).filter((c) => !used.has(c));
    expect(unused, "remove these from ERROR_CODES and docs/api.md").toEqual([]);
  });

  it("keeps its exceptions honest: not ours, yet still written", () => {
    const used = codesInSource();
    for (const code of Object.keys(NOT_OURS)) {
      expect(code in ERROR_CODES, `${code} is listed as not ours`).toBe(false);
      expect(used.has(code), `${code} is written nowhere any more`).toBe(true);
    }
  });

  it("gives each code a one-line meaning", () => {
    for (const [code, meaning] of catalogue) {
      expect(meaning.trim(), code).not.toBe("");
      expect(meaning, code).not.toMatch(/[\n|]/);
    }
  });

  it("is docs/api.md's table of error codes, code for code and meaning for meaning", () => {
    const rows = apiDocTable();
    expect(rows.map(([c]) => c)).toEqual(catalogue.map(([c]) => c));
    expect(rows).toEqual(catalogue);
  });

  it("is the only table of error codes in docs/", () => {
    const elsewhere: string[] = [];
    for (const file of filesUnder("docs", (p) => p.endsWith(".md"))) {
      if (file === join("docs", "api.md")) continue;
      readFileSync(join(ROOT, file), "utf8")
        .split("\n")
        .forEach((line, i) => {
          if (/^\| `ERR_/.test(line)) elsewhere.push(`${file}:${i + 1}`);
        });
    }
    expect(elsewhere, "describe codes in docs/api.md's table and link to it").toEqual([]);
  });
});

describe("errorCode", () => {
  it("reads the code before the first colon, and nothing from text that does not start with one", () => {
    expect(errorCode("ERR_ENGINE_LINK_TAKEN: another live connection owns this engine link")).toBe(
      "ERR_ENGINE_LINK_TAKEN",
    );
    expect(errorCode("ERR_TIMEOUT")).toBe("ERR_TIMEOUT");
    // Words after the code decide nothing; a code-like word later in the text is not the code.
    expect(errorCode("refused: ERR_ENGINE_LINK_TAKEN")).toBe("");
    expect(errorCode("ERR_ENGINE_LINK_TAKENx: text")).toBe("");
    expect(errorCode("")).toBe("");
  });
});
