/**
 * The error code catalogues against the sources and the docs. The product's (`ERROR_CODES` in
 * src/errors.ts, docs/api.md "Error codes"): every `ERR_*` code written in src/ (not src/gen),
 * native/src/ or the vLLM connector (connectors/vllm/kvxfer_vllm, not its _gen), in a string or
 * a comment, is in it, and every code in it is written there. The simulated engine's
 * (`SIM_ERROR_CODES` in sim/errors.ts, docs/testing.md "The simulated engine's error codes"):
 * every code sim/ writes is the product's or the simulator's, every simulator code is written in
 * sim/ and nowhere in the product, and no code is in both. Each table has the same codes, in the
 * same order, with the same one-line meanings as its catalogue, and no other doc has one.
 * Only text is read: a new code fails here whether or not a test reaches it.
 */
import { readFileSync, readdirSync } from "node:fs";
import { join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

import { ERROR_CODES, errorCode } from "../src/errors.js";
import { SIM_ERROR_CODES } from "../sim/errors.js";

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

const CONNECTOR = join("connectors", "vllm", "kvxfer_vllm");
const PRODUCT_SOURCES = [
  ...filesUnder("src", (p) => p.endsWith(".ts") && !p.startsWith(join("src", "gen"))),
  ...filesUnder(join("native", "src"), () => true),
  ...filesUnder(CONNECTOR, (p) => p.endsWith(".py") && !p.startsWith(join(CONNECTOR, "_gen"))),
];
const SIM_SOURCES = filesUnder("sim", (p) => p.endsWith(".ts"));

/** A catalogue's file without the catalogue itself: what is left of it emits codes too. */
function withoutCatalogue(text: string, name: string): string {
  const start = text.indexOf(`export const ${name} = {`);
  const end = text.indexOf("} as const;", start);
  expect(start, `${name} not found`).toBeGreaterThanOrEqual(0);
  expect(end, `the end of ${name} not found`).toBeGreaterThan(start);
  return text.slice(0, start) + text.slice(end);
}

/** Every code written in `files`: code -> "file:line" places. */
function codesIn(files: readonly string[]): Map<string, string[]> {
  const out = new Map<string, string[]>();
  for (const file of files) {
    let text = readFileSync(join(ROOT, file), "utf8");
    if (file === join("src", "errors.ts")) text = withoutCatalogue(text, "ERROR_CODES");
    if (file === join("sim", "errors.ts")) text = withoutCatalogue(text, "SIM_ERROR_CODES");
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

/** The rows of the code table under `heading` in `doc`: code and meaning, in order. */
function docTable(doc: string, heading: string): [string, string][] {
  const text = readFileSync(join(ROOT, "docs", doc), "utf8");
  const start = text.indexOf(`\n${heading}\n`);
  expect(start, `docs/${doc} has no "${heading}" section`).toBeGreaterThanOrEqual(0);
  const next = text.indexOf("\n## ", start + 1);
  const section = text.slice(start, next < 0 ? undefined : next);
  const rows: [string, string][] = [];
  for (const line of section.split("\n")) {
    const m = /^\| `(ERR_[A-Z0-9_]+)` \| ([^|]*) \|/.exec(line);
    if (m !== null) rows.push([m[1]!, m[2]!.trim()]);
  }
  return rows;
}

const product = Object.entries(ERROR_CODES);
const simulator = Object.entries(SIM_ERROR_CODES);

/** The prefix of a family (e.g. "ERR_REGION_" in `code.startsWith(...)`) names codes of `cat`. */
const isFamily = (code: string, cat: [string, string][]): boolean =>
  code.endsWith("_") && cat.some(([c]) => c.startsWith(code));

describe("the error code catalogues", () => {
  it("find the sources they read", () => {
    expect(PRODUCT_SOURCES).toContain(join("src", "sidecar", "sidecar.ts"));
    expect(PRODUCT_SOURCES).toContain(join("native", "src", "addon.cc"));
    expect(PRODUCT_SOURCES).toContain(join(CONNECTOR, "worker.py"));
    expect(SIM_SOURCES).toContain(join("sim", "engine.ts"));
    expect(
      PRODUCT_SOURCES.some((f) => f.includes("_gen") || f.startsWith(join("src", "gen"))),
    ).toBe(false);
  });

  it("the product's lists every ERR_ code written in src/, native/src/ and the vLLM connector", () => {
    const missing: string[] = [];
    for (const [code, places] of codesIn(PRODUCT_SOURCES)) {
      if (code in ERROR_CODES || code in NOT_OURS || isFamily(code, product)) continue;
      missing.push(`${code} (${places.join(", ")})`);
    }
    expect(missing, "add these to ERROR_CODES in src/errors.ts and to docs/api.md").toEqual([]);
  });

  it("the product's lists no code that the product does not emit", () => {
    const used = codesIn(PRODUCT_SOURCES);
    const unused = product.map(([c]) => c).filter((c) => !used.has(c));
    expect(unused, "remove these from ERROR_CODES and docs/api.md").toEqual([]);
  });

  it("the simulator's lists what only sim/ emits: every code sim/ writes is in one of the two, none in both", () => {
    const missing: string[] = [];
    for (const [code, places] of codesIn(SIM_SOURCES)) {
      if (code in ERROR_CODES || code in SIM_ERROR_CODES || code in NOT_OURS) continue;
      if (isFamily(code, product) || isFamily(code, simulator)) continue;
      missing.push(`${code} (${places.join(", ")})`);
    }
    expect(missing, "add these to SIM_ERROR_CODES in sim/errors.ts and docs/testing.md").toEqual(
      [],
    );
    const inBoth = simulator.map(([c]) => c).filter((c) => c in ERROR_CODES);
    expect(inBoth).toEqual([]);
    const simUsed = codesIn(SIM_SOURCES);
    const productUsed = codesIn(PRODUCT_SOURCES);
    expect(
      simulator.map(([c]) => c).filter((c) => !simUsed.has(c)),
      "emitted by nothing",
    ).toEqual([]);
    expect(
      simulator.map(([c]) => c).filter((c) => productUsed.has(c)),
      "the product emits these: move them to ERROR_CODES",
    ).toEqual([]);
  });

  it("keeps its exceptions honest: not ours, yet still written", () => {
    const used = codesIn([...PRODUCT_SOURCES, ...SIM_SOURCES]);
    for (const code of Object.keys(NOT_OURS)) {
      expect(code in ERROR_CODES || code in SIM_ERROR_CODES, `${code} is listed as not ours`).toBe(
        false,
      );
      expect(used.has(code), `${code} is written nowhere any more`).toBe(true);
    }
  });

  it("give each code a one-line meaning", () => {
    for (const [code, meaning] of [...product, ...simulator]) {
      expect(meaning.trim(), code).not.toBe("");
      expect(meaning, code).not.toMatch(/[\n|]/);
    }
  });

  it("are docs/api.md's and docs/testing.md's tables, code for code and meaning for meaning", () => {
    expect(docTable("api.md", "## Error codes")).toEqual(product);
    expect(docTable("testing.md", "## The simulated engine's error codes")).toEqual(simulator);
  });

  it("are the only tables of error codes in docs/", () => {
    const elsewhere: string[] = [];
    for (const file of filesUnder("docs", (p) => p.endsWith(".md"))) {
      const text = readFileSync(join(ROOT, file), "utf8");
      // The two tables' own sections.
      const own =
        file === join("docs", "api.md")
          ? "\n## Error codes\n"
          : file === join("docs", "testing.md")
            ? "\n## The simulated engine's error codes\n"
            : undefined;
      const start = own === undefined ? -1 : text.indexOf(own);
      const end = start < 0 ? -1 : text.indexOf("\n## ", start + 1);
      let at = 0;
      text.split("\n").forEach((line, i) => {
        const inOwn = start >= 0 && at > start && (end < 0 || at < end);
        if (!inOwn && /^\| `ERR_/.test(line)) elsewhere.push(`${file}:${i + 1}`);
        at += line.length + 1;
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
