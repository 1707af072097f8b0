/**
 * The commands `kvxfer` offers from packages the product does not depend on:
 * the simulated engine and the demo (kvxfer-sim, sim/ in a checkout) and the
 * benchmarks (kvxfer-bench, bench/). Each package exports `commands`, declared
 * with this CLI's contract (contract.ts); the product knows only the package's
 * name and the first words of its commands, and loads it, here and nowhere
 * else, when one of them or the main usage is asked for. A product command
 * (`sidecar`, `status`, ...) loads neither.
 */
import type { CommandSpec } from "./contract.js";

interface OptionalPackage {
  /** The npm package. */
  readonly name: string;
  /** What it holds, for the line that says it is missing. */
  readonly holds: string;
  /** The checkout's folder it is installed from. */
  readonly folder: string;
  /** The first word of each command it declares. */
  readonly commands: readonly string[];
}

export const OPTIONAL_PACKAGES: readonly OptionalPackage[] = [
  {
    name: "kvxfer-sim",
    holds: "the simulated engine and the demo",
    folder: "sim/",
    commands: ["sim-engine", "demo"],
  },
  {
    name: "kvxfer-bench",
    holds: "the benchmarks and the native demo",
    folder: "bench/",
    commands: ["native-demo", "bench"],
  },
];

/** Why a package's commands could not be loaded, in one line that names what to install. */
function missing(pkg: OptionalPackage, command: string, err: unknown): Error {
  const e = err as NodeJS.ErrnoException;
  const absent = e.code === "ERR_MODULE_NOT_FOUND" && e.message.includes(`'${pkg.name}'`);
  return new Error(
    absent
      ? `${command} is in the package ${pkg.name} (${pkg.holds}), which is not installed: ` +
          `in a checkout, 'npm ci' installs it from ${pkg.folder} and 'npm run build' builds it`
      : `${command} is in the package ${pkg.name} (${pkg.holds}), which did not load ` +
          `(run 'npm run build' in a checkout): ${e.message}`,
    { cause: err },
  );
}

async function load(pkg: OptionalPackage): Promise<readonly CommandSpec[]> {
  // The name is a variable: the package is found at run time, never bundled with the product.
  const name = pkg.name;
  const mod = (await import(name)) as { commands?: readonly CommandSpec[] };
  if (!Array.isArray(mod.commands)) throw new Error(`${name} exports no commands`);
  return mod.commands;
}

/** For the main usage: a command of a package that is not there, and what to install. */
function absent(pkg: OptionalPackage, command: string, err: unknown): CommandSpec {
  return {
    path: [command],
    summary: `not available: needs the package ${pkg.name} (${pkg.holds}); kvxfer ${command} says why`,
    options: [],
    valueStyle: "eq",
    run: () => Promise.reject(missing(pkg, command, err)),
  };
}

/**
 * The optional commands `argv` needs: the package of its command (an error naming the package
 * when it is not installed), or, for the main usage, every package (a line saying what to
 * install for one that is not there).
 */
export async function optionalCommands(argv: readonly string[]): Promise<CommandSpec[]> {
  const first = argv[0];
  const mainUsage = first === undefined || /^(-h|--help|help)$/.test(first);
  const out: CommandSpec[] = [];
  for (const pkg of OPTIONAL_PACKAGES) {
    if (mainUsage) {
      out.push(
        ...(await load(pkg).catch((err: unknown) => pkg.commands.map((c) => absent(pkg, c, err)))),
      );
    } else if (pkg.commands.includes(first)) {
      try {
        out.push(...(await load(pkg)));
      } catch (err) {
        throw missing(pkg, first, err);
      }
    }
  }
  return out;
}
