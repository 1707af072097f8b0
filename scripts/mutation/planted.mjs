#!/usr/bin/env node
// The seven lifecycle bugs of issue 17, planted one at a time in a copy of the sources and run
// against the in-process tests (vitest.mutation.config.ts). Each must be caught: some test fails,
// every time it is run. Prints which tests caught each, and exits 1 if any bug got through.
//
//   node scripts/mutation/planted.mjs [--runs N] [--only NAME]
//
// A bug is a text replaced in one source file; the replaced text must occur exactly once, so a
// change to the code that moves it makes this script fail loudly rather than test nothing.
// The work tree is not touched: each bug gets its own sandbox (src/ and test/ copied, the rest
// linked).
import { spawnSync } from "node:child_process";
import { cpSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

const ROOT = resolve(new URL("../..", import.meta.url).pathname);

export const BUGS = [
  {
    name: "ready-one-rank-early",
    what: "D reports KV ready one rank pair early (completion count >= size - 1)",
    file: "src/sidecar/decode.ts",
    from: "if (t.donePairs.size === t.expectedPairs.size) {",
    to: "if (t.donePairs.size >= t.expectedPairs.size - 1) {",
  },
  {
    name: "heartbeat-no-renew",
    what: "D's heartbeats no longer renew P's held lease",
    file: "src/sidecar/prefill.ts",
    from: "t.deadline = d.now! + ctx.settings.leaseMs;",
    to: "void 0;",
  },
  {
    name: "write-after-registration-lease",
    what: "P writes into D's blocks after the registration's lease ran out (D may have reused them)",
    file: "src/sidecar/prefill-writes.ts",
    from: "if (ctx.clock.now() > t.regDeadline || ",
    to: "if (",
  },
  {
    name: "no-transfer-cap",
    what: "the transfer cap is never reached (no ERR_OVERLOADED)",
    file: "src/sidecar/side-table.ts",
    from: "return this.liveCount >= this.ctx.settings.maxTransfers;",
    to: "return false && this.liveCount >= this.ctx.settings.maxTransfers;",
  },
  {
    name: "no-peer-cap",
    what: "the peer cap is never reached (a handshake from the 4097th engine is accepted)",
    file: "src/peer/peer-table.ts",
    from: "if (this.peers.size >= MAX_PEERS) {",
    to: "if (false) {",
  },
  {
    name: "no-receiver-epoch-check",
    what: "a peer message naming another epoch of ours (sent before we restarted) is accepted",
    file: "src/peer/peer-table.ts",
    from: "m.receiverEpoch !== host.epoch ||",
    to: "",
  },
  {
    name: "unauthenticated-handshake",
    what: "with mutual TLS, a handshake whose metadata names another engine than its certificate is accepted",
    file: "src/peer/peer-table.ts",
    from: "if (this.host.channel.authenticated && identity !== md.engineId) {",
    to: "if (false) {",
  },
];

function sandbox() {
  const dir = mkdtempSync(join(tmpdir(), "kvxfer-planted-"));
  for (const d of ["src", "sim", "test", "scripts"])
    cpSync(join(ROOT, d), join(dir, d), {
      recursive: true,
      filter: (p) => !p.includes("node_modules"),
    });
  for (const f of ["vitest.mutation.config.ts", "tsconfig.json", "package.json"])
    cpSync(join(ROOT, f), join(dir, f));
  for (const d of ["node_modules", "build", "native"]) symlinkSync(join(ROOT, d), join(dir, d));
  return dir;
}

function plant(dir, bug) {
  const path = join(dir, bug.file);
  const text = readFileSync(path, "utf8");
  const n = text.split(bug.from).length - 1;
  if (n !== 1)
    throw new Error(`${bug.name}: '${bug.from}' occurs ${n} times in ${bug.file}, not once`);
  writeFileSync(path, text.replace(bug.from, bug.to));
}

/** One vitest run of the in-process tests in `dir`: the names of the tests that failed. */
function run(dir) {
  const out = join(dir, "vitest.json");
  const r = spawnSync(
    join(dir, "node_modules/.bin/vitest"),
    ["run", "-c", "vitest.mutation.config.ts", "--reporter=json", `--outputFile=${out}`],
    { cwd: dir, encoding: "utf8", timeout: 300_000 },
  );
  if (r.error !== undefined) throw r.error;
  let report;
  try {
    report = JSON.parse(readFileSync(out, "utf8"));
  } catch {
    throw new Error(`vitest wrote no report (exit ${r.status}): ${r.stderr.slice(-2000)}`);
  }
  const failed = [];
  for (const file of report.testResults) {
    const rel = file.name.slice(dir.length + 1);
    for (const t of file.assertionResults)
      if (t.status === "failed") failed.push(`${rel} > ${t.fullName}`);
    if (file.status === "failed" && file.assertionResults.length === 0)
      failed.push(`${rel} (failed to load: ${file.message.slice(0, 200)})`);
  }
  return { failed, exit: r.status };
}

function main() {
  const args = process.argv.slice(2);
  const runsAt = args.indexOf("--runs");
  const runs = runsAt >= 0 ? Number(args[runsAt + 1]) : 2;
  const onlyAt = args.indexOf("--only");
  const only = onlyAt >= 0 ? args[onlyAt + 1] : undefined;
  const bugs = BUGS.filter((b) => only === undefined || b.name === only);
  if (bugs.length === 0) throw new Error(`no planted bug named '${only}'`);
  // The baseline: with no bug, every test passes (else a "catch" means nothing).
  const base = sandbox();
  try {
    const r = run(base);
    if (r.failed.length > 0 || r.exit !== 0)
      throw new Error(
        `the in-process tests fail without any bug planted:\n  ${r.failed.join("\n  ")}`,
      );
  } finally {
    rmSync(base, { recursive: true, force: true });
  }
  let missed = 0;
  for (const bug of bugs) {
    const dir = sandbox();
    try {
      plant(dir, bug);
      const seen = [];
      for (let i = 0; i < runs; i++) seen.push(run(dir).failed);
      const always = seen[0].filter((t) => seen.every((s) => s.includes(t)));
      const caughtEvery = seen.every((s) => s.length > 0);
      if (!caughtEvery) missed++;
      console.log(
        `${caughtEvery ? "caught" : "MISSED"} ${bug.name}: ${bug.what}\n` +
          `  failing in all ${runs} runs (${always.length}):\n` +
          always.map((t) => `    ${t}`).join("\n"),
      );
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
  console.log(`${bugs.length - missed} of ${bugs.length} planted bugs caught in every run`);
  process.exit(missed === 0 ? 0 : 1);
}

main();
