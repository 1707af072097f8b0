#!/usr/bin/env node
// Type-checks each surviving and uncovered mutant of a Stryker JSON report on its own, as the
// TypeScript checker of `npm run mutation` would before running it, and prints per file the
// score with the mutants that do not compile taken out. For runs made with `--checkers ""`
// (much faster on two cores): the checker-on score without the checker's hour and a half.
//
//   node scripts/mutation/compile-survivors.mjs [reports/mutation/mutation.json] [--list]
//
// --list prints every survivor that compiles: file:line:column, mutator, replacement.
// Uses the TypeScript 6 that scripts/mutation installs for Stryker (TypeScript 7 has no
// JavaScript API), through one language service, so each mutant costs one file's diagnostics.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { resolve } from "node:path";

const ROOT = resolve(new URL("../..", import.meta.url).pathname);
const require = createRequire(resolve(ROOT, "scripts/mutation/package.json"));
const ts = require("typescript");

const args = process.argv.slice(2);
const list = args.includes("--list");
const reportPath = resolve(
  ROOT,
  args.find((a) => !a.startsWith("--")) ?? "reports/mutation/mutation.json",
);
const report = JSON.parse(readFileSync(reportPath, "utf8"));

const configPath = resolve(ROOT, "tsconfig.json");
const parsed = ts.parseJsonConfigFileContent(
  ts.readConfigFile(configPath, ts.sys.readFile).config,
  ts.sys,
  ROOT,
);
const overrides = new Map(); // absolute path -> text
const versions = new Map();
const service = ts.createLanguageService(
  {
    getScriptFileNames: () => parsed.fileNames,
    getScriptVersion: (f) => String(versions.get(f) ?? 0),
    getScriptSnapshot: (f) => {
      const text = overrides.get(f) ?? (ts.sys.fileExists(f) ? ts.sys.readFile(f) : undefined);
      return text === undefined ? undefined : ts.ScriptSnapshot.fromString(text);
    },
    getCurrentDirectory: () => ROOT,
    getCompilationSettings: () => parsed.options,
    getDefaultLibFileName: (o) => ts.getDefaultLibFilePath(o),
    fileExists: ts.sys.fileExists,
    readFile: ts.sys.readFile,
    readDirectory: ts.sys.readDirectory,
    directoryExists: ts.sys.directoryExists,
    getDirectories: ts.sys.getDirectories,
  },
  ts.createDocumentRegistry(),
);

function setText(file, text) {
  overrides.set(file, text);
  versions.set(file, (versions.get(file) ?? 0) + 1);
}

/** Offset of a 1-based line and column (Stryker's report) in `text`. */
function offsetOf(lineStarts, loc) {
  return lineStarts[loc.line - 1] + loc.column - 1;
}

function errorsIn(file) {
  return service.getSemanticDiagnostics(file).length + service.getSyntacticDiagnostics(file).length;
}

const rows = [];
const tally = { mutants: 0, ignored: 0, detected: 0, survived: 0, noCoverage: 0, compileErrors: 0 };
for (const [rel, entry] of Object.entries(report.files)) {
  const file = resolve(ROOT, rel);
  const source = entry.source;
  const lineStarts = [0];
  for (let i = 0; i < source.length; i++) if (source[i] === "\n") lineStarts.push(i + 1);
  setText(file, source);
  const baseline = errorsIn(file);
  let detected = 0;
  let survived = 0;
  let noCoverage = 0;
  let compileErrors = 0;
  let ignored = 0;
  const compiling = [];
  for (const m of entry.mutants) {
    if (m.status === "Killed" || m.status === "Timeout") {
      detected++;
      continue;
    }
    if (m.status !== "Survived" && m.status !== "NoCoverage") {
      if (m.status === "CompileError") compileErrors++;
      if (m.status === "Ignored") ignored++;
      continue; // runtime errors and ignored mutants count in no score
    }
    const start = offsetOf(lineStarts, m.location.start);
    const end = offsetOf(lineStarts, m.location.end);
    setText(file, source.slice(0, start) + m.replacement + source.slice(end));
    const broken = errorsIn(file) > baseline;
    if (broken) compileErrors++;
    else if (m.status === "Survived") {
      survived++;
      compiling.push(m);
    } else {
      noCoverage++;
      compiling.push(m);
    }
  }
  setText(file, source);
  const score = (100 * detected) / (detected + survived + noCoverage || 1);
  rows.push({
    rel,
    mutants: entry.mutants.length,
    ignored,
    detected,
    survived,
    noCoverage,
    compileErrors,
    score,
  });
  tally.mutants += entry.mutants.length;
  tally.ignored += ignored;
  tally.detected += detected;
  tally.survived += survived;
  tally.noCoverage += noCoverage;
  tally.compileErrors += compileErrors;
  if (list) {
    for (const m of compiling) {
      const original = source.slice(
        offsetOf(lineStarts, m.location.start),
        offsetOf(lineStarts, m.location.end),
      );
      const short = (s) => JSON.stringify(s.length > 70 ? `${s.slice(0, 67)}...` : s);
      console.log(
        `${rel}:${m.location.start.line}:${m.location.start.column} ${m.status} ${m.mutatorName} ${short(original)} -> ${short(m.replacement)}`,
      );
    }
  }
}
console.log(
  "| file | mutants | ignored | killed or timed out | survived | no coverage | do not compile | score |",
);
console.log("|---|---|---|---|---|---|---|---|");
for (const r of rows)
  console.log(
    `| \`${r.rel}\` | ${r.mutants} | ${r.ignored} | ${r.detected} | ${r.survived} | ${r.noCoverage} | ${r.compileErrors} | ${r.score.toFixed(1)} % |`,
  );
const all = (100 * tally.detected) / (tally.detected + tally.survived + tally.noCoverage || 1);
console.log(
  `| all | ${tally.mutants} | ${tally.ignored} | ${tally.detected} | ${tally.survived} | ${tally.noCoverage} | ${tally.compileErrors} | ${all.toFixed(1)} % |`,
);
