// bench/gpu/prepare.sh --check (issue 32): the GPU device check's staging, proved here since the
// GPU machine has no Node, no UCX and no internet. It stages bench/gpu/carry (the real thing: Node
// 20 stripped and xz -9, the addon, UCX's libraries), must stay under 60 MiB with the working
// tree under the device's 64, decompresses the carried node and runs it, and runs the harness's
// dry run (host memory, no CUDA) with only carried files: the agents report the addon and libucp
// they loaded, and the harness refuses a run that did not use the carried ones; two real sidecars
// (the bundled CLI) move a request registered by the connector's worker code.
import { execFileSync } from "node:child_process";
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, expect, it } from "vitest";

const ROOT = join(import.meta.dirname, "..", "..");
const PYTHON = process.env.PYTHON ?? join(ROOT, ".venv", "bin", "python");
const ready =
  existsSync(join(ROOT, "build", "native", "Release", "kvxfer.node")) &&
  existsSync(join(ROOT, ".ucx", "libucx", "lib", "libucp.so.0")) &&
  existsSync(PYTHON);

describe.skipIf(!ready)("the GPU device check's staging (needs the build, .ucx and .venv)", () => {
  it("stages under 60 MiB, and the carried node and the harness's dry run work from it", () => {
    const out = execFileSync("bash", [join(ROOT, "bench", "gpu", "prepare.sh"), "--check"], {
      cwd: ROOT,
      env: { ...process.env, PYTHON },
      encoding: "utf8",
      timeout: 480_000,
      maxBuffer: 16 << 20,
    });
    const staged = /staged bench\/gpu\/carry: ([\d.]+) MiB .*together ([\d.]+) MiB of 64/.exec(out);
    expect(staged, out).not.toBeNull();
    expect(Number(staged![1])).toBeLessThan(60);
    expect(Number(staged![2])).toBeLessThan(64);
    expect(out).toMatch(/prepare: carried node v20\.\d+\.\d+ runs/);
    // Every part of the dry run moved bytes and checked them.
    expect(out).toMatch(/\(a\) +256 KiB .* bytes ok/);
    expect(out).toMatch(/\(b\) 256 tokens, .* bytes ok/);
    expect(out).toMatch(/\(c\) placement 'device': 16 descriptors, bytes ok/);
    expect(out).toMatch(/\(c\) host_buffer: .* bytes ok/);
    // Real sidecars from the bundled CLI, run by the carried node, moved a request byte-exact.
    expect(out).toMatch(/prepare: the bundled sidecar CLI runs/);
    expect(out).toMatch(
      /\(c\) real sidecars \(shared memory\): pull of 4 blocks ready .* bytes ok/,
    );
    expect(out).toMatch(/dry run wrote results\.json results\.md/);
    expect(out).not.toMatch(/failed:/);
    const pkg = JSON.parse(
      readFileSync(join(ROOT, "bench", "gpu", "carry", "package.json"), "utf8"),
    );
    expect(pkg.type).toBe("module");
  }, 500_000);
});
