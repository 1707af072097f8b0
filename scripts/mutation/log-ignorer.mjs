// A StrykerJS ignorer: no mutants inside calls to a logger (`log.debug(...)`, `ctx.log.warn(...)`,
// `this.host.log.error(...)`). Their fields and texts are read by people only; a mutant there
// changes no behaviour a test could or should assert. Refusal texts, noted errors and events are
// not logs and stay mutated. Registered in stryker.config.mjs (`plugins`, `ignorers`).
import { PluginKind, declareValuePlugin } from "@stryker-mutator/api/plugin";

const LEVELS = new Set(["trace", "debug", "info", "warn", "error", "fatal"]);

/** True for `log`, `x.log`, `this.x.log`: the object a log level is called on. */
function isLogger(node) {
  if (node.type === "Identifier") return node.name === "log";
  return (
    node.type === "MemberExpression" &&
    !node.computed &&
    node.property.type === "Identifier" &&
    node.property.name === "log"
  );
}

export const strykerPlugins = [
  declareValuePlugin(PluginKind.Ignore, "log-calls", {
    shouldIgnore(path) {
      const node = path.node;
      if (node.type !== "CallExpression") return undefined;
      const callee = node.callee;
      if (
        callee.type === "MemberExpression" &&
        !callee.computed &&
        callee.property.type === "Identifier" &&
        LEVELS.has(callee.property.name) &&
        isLogger(callee.object)
      )
        return "a log call: read by people only";
      return undefined;
    },
  }),
];
