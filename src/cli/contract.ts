/**
 * One command-line contract for every `kvxfer` subcommand, on commander:
 *
 * - `--help`/`-h` prints that command's usage, does nothing else, exits 0;
 * - an unknown flag, a missing or bad value, or a missing argument is refused
 *   with one line naming it, before anything starts: exit 2;
 * - `kvxfer --version` prints the version (package.json) and exits 0;
 * - exit codes: 0 done, 1 failed, 2 usage (some commands add their own, said
 *   in their usage).
 *
 * Each command is declared once (`COMMANDS`): its flags with their kinds, what
 * it is for and how it runs. The main usage, each command's `--help` and the
 * checks all come from those declarations, so they cannot drift apart. Once
 * commander has checked a command line, the command gets it back in one
 * canonical form (`--flag=value` or `--flag value`, then `--` and the positionals) and
 * parses it with its own parser as before; a command may also check the whole
 * line up front (`check`), so that values that depend on each other are
 * refused with exit 2 too.
 */
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Command, CommanderError, InvalidArgumentError, Option } from "commander";

/** What a flag's value must be. */
export type Kind =
  | { readonly t: "flag" }
  | { readonly t: "string" }
  | { readonly t: "int"; readonly min: number }
  | { readonly t: "number"; readonly min: number; readonly above?: boolean }
  | { readonly t: "choice"; readonly of: readonly string[]; readonly ci?: boolean }
  | { readonly t: "list"; readonly of: readonly string[] }
  | { readonly t: "ints" }
  | { readonly t: "size" }
  | { readonly t: "sizes" }
  | { readonly t: "bytes" };

export const FLAG: Kind = { t: "flag" };
export const STR: Kind = { t: "string" };
export const POS_INT: Kind = { t: "int", min: 1 };
export const NON_NEG_INT: Kind = { t: "int", min: 0 };
export const BOOL_STR: Kind = { t: "choice", of: ["true", "false"] };
export const choice = (...of: string[]): Kind => ({ t: "choice", of });
export const list = (...of: string[]): Kind => ({ t: "list", of });

/** Flags that commands in more than one package share (the product's and the optional ones). */
export const JSON_OPT: OptSpec = {
  name: "json",
  kind: FLAG,
  help: "one JSON document instead of tables",
};
export const PEER_AUTH: OptSpec = {
  name: "peer-auth",
  kind: choice("on", "off"),
  help: "side channel with mutual TLS (on) or without (off)",
};
export const LOG_LEVELS = ["fatal", "error", "warn", "info", "debug", "trace", "silent"];

export interface OptSpec {
  readonly name: string;
  readonly kind: Kind;
  /** Placeholder of the value in usage (default from the kind). */
  readonly arg?: string;
  readonly help: string;
  /** May be given more than once. */
  readonly multiple?: boolean;
  /** Shown without brackets in the synopsis (the command itself checks it is there). */
  readonly required?: boolean;
  /** Shown in help only (the command applies its own defaults). */
  readonly def?: string;
}

export interface ArgSpec {
  readonly name: string;
  readonly required: boolean;
}

export interface CommandSpec {
  /** e.g. ["bench", "native"]. */
  readonly path: readonly string[];
  readonly args?: readonly ArgSpec[];
  /** One line: what the command is for. */
  readonly summary: string;
  readonly options: readonly OptSpec[];
  /** More help text after the flags. */
  readonly epilog?: string;
  /** How values go back to the command: `--flag=value` (node:util parseArgs) or `--flag value`. */
  readonly valueStyle: "eq" | "space";
  /** Checks the whole (canonical) command line; a throw is a usage error (exit 2). */
  readonly check?: (argv: string[]) => void | Promise<void>;
  /** Runs the command; resolves to its exit code. */
  readonly run: (argv: string[]) => Promise<number>;
}

export const EXIT_CODES = "exit codes: 0 done, 1 failed, 2 usage (bad command line)";

/** A usage error of a command (exit 2). */
export class CliUsageError extends Error {}

const SIZE_RE = /^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$/i;

function placeholder(k: Kind): string {
  switch (k.t) {
    case "flag":
      return "";
    case "int":
      return "N";
    case "number":
      return "X";
    case "choice":
      return k.of.join("|");
    case "list":
      return k.of.join(",");
    case "ints":
      return "N,N,...";
    case "size":
    case "bytes":
      return "BYTES";
    case "sizes":
      return "4k,64k,...";
    case "string":
      return "VALUE";
  }
}

/** Checks one value against its kind; returns it unchanged or throws what it must be. */
export function checkValue(k: Kind, v: string): string {
  const bad = (what: string): never => {
    throw new InvalidArgumentError(what);
  };
  switch (k.t) {
    case "flag":
    case "string":
      return v;
    case "int": {
      const n = Number(v);
      if (v.trim() === "" || !Number.isSafeInteger(n) || n < k.min)
        bad(k.min === 1 ? "must be a positive integer" : `must be an integer >= ${k.min}`);
      return v;
    }
    case "number": {
      const n = Number(v);
      if (v.trim() === "" || !Number.isFinite(n) || n < k.min || (k.above === true && n === k.min))
        bad(`must be a number ${k.above === true ? ">" : ">="} ${k.min}`);
      return v;
    }
    case "choice": {
      const ok = k.ci === true ? k.of.includes(v.toLowerCase()) : k.of.includes(v);
      if (!ok) bad(`must be one of ${k.of.join(", ")}`);
      return v;
    }
    case "list":
      for (const x of v.split(","))
        if (!k.of.includes(x)) bad(`takes a comma-separated list of ${k.of.join(", ")}`);
      return v;
    case "ints":
      for (const x of v.split(",")) {
        const n = Number(x);
        if (x.trim() === "" || !Number.isSafeInteger(n) || n < 1)
          bad("takes comma-separated positive integers");
      }
      return v;
    case "size":
      if (!SIZE_RE.test(v) || Number(SIZE_RE.exec(v)![1]) <= 0)
        bad("must be a byte count, e.g. 65536 or 64k");
      return v;
    case "sizes":
      for (const x of v.split(","))
        if (!SIZE_RE.test(x) || Number(SIZE_RE.exec(x)![1]) <= 0)
          bad("takes comma-separated byte counts, e.g. 4k,64k,1m");
      return v;
    case "bytes":
      // Empty is allowed: the command's default.
      if (v.trim() !== "" && (!SIZE_RE.test(v) || Number(SIZE_RE.exec(v)![1]) <= 0))
        bad("must be a byte count, e.g. 68719476736 or 64G (or empty)");
      return v;
  }
}

function flagsOf(o: OptSpec): string {
  if (o.kind.t === "flag") return `--${o.name}`;
  return `--${o.name} <${o.arg ?? placeholder(o.kind)}>`;
}

/** `kvxfer bench e2e [--quick] [--json] ...`: the one-line synopsis. */
export function synopsis(spec: CommandSpec, maxFlags = 8): string {
  const args = (spec.args ?? []).map((a) => (a.required ? `<${a.name}>` : `[${a.name}]`));
  const required = spec.options
    .filter((o) => o.required === true)
    .map((o) => `--${o.name} ${o.arg ?? placeholder(o.kind)}`);
  const optional = spec.options.filter((o) => o.required !== true);
  const flags =
    optional.length > maxFlags
      ? [...required, "[flags]"]
      : [
          ...required,
          ...optional.map(
            (o) =>
              `[${o.kind.t === "flag" ? `--${o.name}` : `--${o.name} ${o.arg ?? placeholder(o.kind)}`}]${o.multiple === true ? "..." : ""}`,
          ),
        ];
  return ["kvxfer", ...spec.path, ...args, ...flags].join(" ");
}

/** The version in package.json. */
export function kvxferVersion(): string {
  let dir = dirname(fileURLToPath(import.meta.url));
  for (let i = 0; i < 6; i++) {
    try {
      const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8")) as {
        name?: string;
        version?: string;
      };
      if (pkg.name === "kvxfer" && pkg.version !== undefined) return pkg.version;
    } catch {
      // not here: one folder up
    }
    dir = dirname(dir);
  }
  return "unknown";
}

/** The main usage, from the same declarations as each command's. */
export function mainUsage(specs: readonly CommandSpec[], group?: string): string {
  const lines = [
    group === undefined
      ? "usage: kvxfer <command> [arguments] [flags]"
      : `usage: kvxfer ${group} <suite> [flags]`,
    "",
  ];
  for (const s of specs) {
    if (group !== undefined && s.path[0] !== group) continue;
    lines.push(`  ${synopsis(s)}`, `      ${s.summary}`);
  }
  lines.push(
    "",
    "  kvxfer <command> --help   that command's flags (nothing else runs)",
    ...(group === undefined ? ["  kvxfer --version          the version"] : []),
    "",
    EXIT_CODES,
  );
  return lines.join("\n");
}

interface Parsed {
  spec: CommandSpec;
  argv: string[];
}

/** An error line of commander as one line: `kvxfer CMD: MESSAGE; see kvxfer CMD --help`. */
function oneLine(cmdName: string, str: string): string {
  let msg = str
    .replace(/^error: /, "")
    .replace(/\s*\n\s*/g, " ")
    .trim();
  // "option '--count <N>' argument '-1' is invalid. must be ..." -> "--count must be ..., got '-1'"
  const bad = /^option '(-[^ ']+)[^']*' argument '(.*)' is invalid\. (.*)$/.exec(msg);
  if (bad !== null) msg = `${bad[1]} ${bad[3]!.replace(/\.$/, "")}, got '${bad[2]}'`;
  return `kvxfer${cmdName === "" ? "" : ` ${cmdName}`}: ${msg} (kvxfer${cmdName === "" ? "" : ` ${cmdName}`} --help for usage)\n`;
}

function configure(cmd: Command, name: string): Command {
  return cmd
    .exitOverride()
    .helpOption("-h, --help", "this usage; nothing else runs")
    .allowExcessArguments(false)
    .helpCommand(false)
    .showSuggestionAfterError(true)
    .configureOutput({
      writeOut: (s) => process.stdout.write(s),
      writeErr: (s) => process.stderr.write(s),
      outputError: (s, write) => write(oneLine(name, s)),
    });
}

/** Builds the commander program; `onParsed` is told which command matched and its canonical argv. */
function program(specs: readonly CommandSpec[], onParsed: (p: Parsed) => void): Command {
  const root = configure(new Command("kvxfer"), "");
  root.version(kvxferVersion(), "-V, --version", "the version");
  // Options of `kvxfer` itself (--version) only before the command name.
  root.enablePositionalOptions();
  root.helpInformation = (): string => mainUsage(specs) + "\n";
  const groups = new Map<string, Command>();
  for (const spec of specs) {
    let parent = root;
    for (const group of spec.path.slice(0, -1)) {
      let g = groups.get(group);
      if (g === undefined) {
        g = configure(new Command(group), group);
        g.description(`${group} suites: kvxfer ${group} <suite> --help for each`);
        g.helpInformation = (): string => mainUsage(specs, group) + "\n";
        root.addCommand(g);
        groups.set(group, g);
      }
      parent = g;
    }
    const name = spec.path.join(" ");
    const cmd = configure(new Command(spec.path[spec.path.length - 1]!), name);
    cmd.description(spec.summary);
    cmd.helpInformation = ((orig) => (): string => {
      // "Usage: kvxfer bench native ..." with the full path, then commander's options list.
      const text = orig.call(cmd);
      return text.replace(/^Usage: .*$/m, `usage: ${synopsis(spec, 0)}`);
    })(cmd.helpInformation);
    for (const a of spec.args ?? []) cmd.argument(a.required ? `<${a.name}>` : `[${a.name}]`);
    for (const o of spec.options) {
      const opt = new Option(
        flagsOf(o),
        o.help + (o.def !== undefined && o.def !== "" ? ` (default ${o.def})` : ""),
      );
      if (o.kind.t !== "flag") {
        const kind = o.kind;
        if (o.multiple === true)
          opt.argParser((v: string, prev: string[] | undefined) => [
            ...(prev ?? []),
            checkValue(kind, v),
          ]);
        else opt.argParser((v: string) => checkValue(kind, v));
      }
      cmd.addOption(opt);
    }
    if (spec.epilog !== undefined) cmd.addHelpText("after", `\n${spec.epilog}`);
    cmd.addHelpText("after", `\n${EXIT_CODES}`);
    cmd.action((...actionArgs: unknown[]) => {
      const positionals = (
        actionArgs.slice(0, (spec.args ?? []).length) as (string | undefined)[]
      ).filter((x): x is string => x !== undefined);
      const argv: string[] = [];
      for (const o of spec.options) {
        const opt = cmd.options.find((x) => x.long === `--${o.name}`)!;
        const key = opt.attributeName();
        if (cmd.getOptionValueSource(key) !== "cli") continue;
        const v = cmd.getOptionValue(key) as unknown;
        if (o.kind.t === "flag") {
          argv.push(`--${o.name}`);
          continue;
        }
        for (const x of Array.isArray(v) ? (v as string[]) : [String(v)])
          argv.push(...(spec.valueStyle === "eq" ? [`--${o.name}=${x}`] : [`--${o.name}`, x]));
      }
      // Positionals last, after "--": a transfer id may start with "-".
      if (positionals.length > 0) argv.push("--", ...positionals);
      onParsed({ spec, argv });
    });
    parent.addCommand(cmd);
  }
  return root;
}

/**
 * Parses `argv` (after `kvxfer`) against `specs` and runs the command.
 * Resolves to the exit code; usage errors are printed here (one line, exit 2).
 */
export async function runCli(specs: readonly CommandSpec[], argv: string[]): Promise<number> {
  if (argv.length === 0) {
    process.stderr.write(mainUsage(specs) + "\n");
    return 2;
  }
  // `kvxfer help [command...]` is `kvxfer [command...] --help`.
  if (argv[0] === "help") argv = [...argv.slice(1), "--help"];
  let parsed: Parsed | undefined;
  const root = program(specs, (p) => (parsed = p));
  try {
    await root.parseAsync(argv, { from: "user" });
  } catch (e) {
    if (e instanceof CommanderError) {
      if (e.code === "commander.helpDisplayed" || e.code === "commander.version") return 0;
      return 2;
    }
    throw e;
  }
  if (parsed === undefined) return 2;
  const { spec, argv: canonical } = parsed;
  if (spec.check !== undefined) {
    try {
      await spec.check(canonical);
    } catch (e) {
      const msg = (e instanceof Error ? e.message : String(e)).split("\n")[0]!;
      process.stderr.write(oneLine(spec.path.join(" "), msg));
      return 2;
    }
  }
  return spec.run(canonical);
}
