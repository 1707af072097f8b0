/**
 * Dependencies point one way (docs/architecture.md): nothing under
 * src/sidecar/ imports src/api/ or src/cli/. The sidecar reports through
 * `TransferMetrics` (src/sidecar/metrics.ts); the composition root
 * (src/cli/sidecar-start.ts) wires the API to it.
 */
import { readFileSync, readdirSync } from "node:fs";
import { dirname, join, sep } from "node:path";
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

/** Every .ts file under `dir` (relative to the repository), recursively. */
function tsFiles(dir: string): string[] {
  const root = fileURLToPath(new URL(`../${dir}/`, import.meta.url));
  return readdirSync(root, { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile() && e.name.endsWith(".ts"))
    .map((e) => join(e.parentPath, e.name));
}

describe("the product (src/) apart from its harness", () => {
  it("imports nothing from sim/ or bench/ (their commands load by package name: src/cli/optional.ts)", () => {
    const files = tsFiles("src");
    expect(files.length).toBeGreaterThan(50);
    const wrong: string[] = [];
    for (const file of files)
      for (const spec of importsOf(readFileSync(file, "utf8")))
        if (/^(\.\.\/)+(sim|bench)\//.test(spec) || /^kvxfer-(sim|bench)/.test(spec))
          wrong.push(`${file} -> ${spec}`);
    expect(wrong).toEqual([]);
  });

  it("depends on no plotting or simulation package (those are the harness packages' own)", () => {
    const pkg = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8")) as {
      dependencies: Record<string, string>;
      devDependencies: Record<string, string>;
    };
    expect(Object.keys(pkg.dependencies).filter((d) => /resvg|kvxfer-/.test(d))).toEqual([]);
    expect(pkg.devDependencies["kvxfer-sim"]).toBe("file:sim");
    expect(pkg.devDependencies["kvxfer-bench"]).toBe("file:bench");
  });
});

describe("the harness (sim/, bench/) apart from the product's internals", () => {
  const REPO = fileURLToPath(new URL("../", import.meta.url));
  const pkg = JSON.parse(readFileSync(join(REPO, "package.json"), "utf8")) as {
    exports: Record<string, string>;
  };
  /** The product's entry points as source files: package.json's `exports` (dist/src/x.js ← src/x.ts). */
  const entries = new Set(
    Object.values(pkg.exports)
      .filter((target) => target.startsWith("./dist/src/"))
      .map((target) => join(REPO, target.slice("./dist/".length).replace(/\.js$/, ".ts"))),
  );

  it("names entry points that exist", () => {
    expect(entries.size).toBeGreaterThanOrEqual(7);
    for (const file of entries) expect(() => readFileSync(file), file).not.toThrow();
  });

  it("imports the product only through those entry points", () => {
    const files = [...tsFiles("sim"), ...tsFiles("bench")];
    expect(files.length).toBeGreaterThan(40);
    const wrong: string[] = [];
    let through = 0;
    for (const file of files) {
      for (const spec of importsOf(readFileSync(file, "utf8"))) {
        if (spec.startsWith("kvxfer/")) {
          if (!(`./${spec.slice("kvxfer/".length)}` in pkg.exports))
            wrong.push(`${file} -> ${spec}`);
          continue;
        }
        if (!spec.startsWith(".")) continue;
        const target = join(dirname(file), spec);
        if (!target.startsWith(join(REPO, "src") + sep)) continue;
        through += 1;
        if (!entries.has(target.replace(/\.js$/, ".ts"))) wrong.push(`${file} -> ${spec}`);
      }
    }
    expect(wrong).toEqual([]);
    expect(through).toBeGreaterThan(30);
  });
});
